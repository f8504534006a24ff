"""The rollout worker: the engine served over ZeroMQ + msgpack.

- `protocol.py` documents the wire protocol; `messages.py` holds its dataclasses and `codec.py` the bounded codec
  (both shared with `trainer_bridge`); `sockets.py` checks addresses and reads messages within bounds;
- `cli.py` is `rollout-worker` (`presets.py`: built-in models; `limits.py`: operator limits; `auth.py`: CurveZMQ
  keys and roles);
- `worker.py` is the serving loop: it routes generate/cancel/stats to the engine manager (`groups.py` turns outputs
  into messages, `clients.py` keeps each client's link) and weight-update messages to `updates.py`;
- weight updates: `updates.py` (the single update slot), `weights.py` (one staged update), `staging.py` (the wire
  contract and staging areas), `jobs.py` (the update's job thread), `dist.py` (the torch.distributed transport);
- `http/`: the OpenAI-compatible HTTP front end (`rollout-worker --http`), on the same engine manager;
- observability: `metrics.py` (Prometheus), `tracing.py` (OpenTelemetry).
"""
