"""The worker's ZeroMQ front end, in the order a message passes: `worker.py` (the serving loop on the ROUTER socket;
`worker_report.py`: what it says about itself, hello and stats),
`message_checks.py` (a message decoded under the limits and its sender's role checked, or refused by name),
`limits.py` (what an operator bounds), `group_desk.py` (groups checked, compiled, added to the engine, answered),
`clients.py` (each client's link, over the socket `router_options.py` sets up; `reply_backlogs.py`: its bounded
backlog of unread replies; `routing_keys.py`: with keys, the key each routing id belongs to), `large_replies.py`
(a large result encoded over several turns)."""
