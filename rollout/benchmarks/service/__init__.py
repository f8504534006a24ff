"""Benchmarks of the worker as a service:

- `service.py`: `rollout-bench service`, the socket's cost (`service_http.py`: over the HTTP API;
  `agentic.py`: `--agentic`, prefix-affine routing on a fleet);
- `weights.py`: `rollout-bench weights`, pushes per transport (`lora_push.py`: adapter-only pushes);
- `fleet.py`: `rollout-bench fleet`, a Ray fleet from launch to serving;
- `fairness.py`: `rollout-bench fairness`, a second client's short request behind a first client's work, with the
  scheduler's express lane open and closed.
"""
