"""The rollout worker: the engine served to trainers over ZeroMQ + msgpack (the wire contract is `rollout.protocol`)
and to OpenAI clients over HTTP. Its subsystems, in the order a worker runs them:

- `launch/`: `rollout-worker`'s flags, the model loaded, the engine, sockets and servers built;
- `zmq/`: the serving loop on the ZeroMQ socket (generate, cancel, stats; weight updates go to `weights/`);
- `http/`: the OpenAI-compatible HTTP front end (`rollout-worker --http`), on the same engine manager;
- `compile/`: structured-output constraints compiled off the serving loop, within a budget;
- `weights/`: weight updates as transactions (staged, checked, committed);
- `observability/`: Prometheus metrics and OpenTelemetry traces;
- what several of them share: `address_checks.py` (the addresses a worker will listen on, checked before anything
  loads), `group_counters.py` (groups received, refused, finished: both front ends count into it) and
  `loopback_hosts.py` (the Host headers a loopback-only server answers).
"""
