"""MoE routing replay:

- `router_taps.py`: taps on MoE routers, for whoever watches or steers an expert choice;
- `routes.py`: the routes every step records, handed to each sample (its rows: `rollout.engine.requests.route_rows`).
"""
