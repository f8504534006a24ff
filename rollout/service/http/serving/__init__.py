"""The HTTP server, in the order a request meets it: `flags.py` (the `--http` flags), `launch.py` (checked, and started), `settings.py`
(`HttpSettings`), `server.py` (uvicorn on a thread), `connections.py` (heads timed and capped), `guard.py` (API key,
Host header), `request_metrics.py` (every answer observed), `bodies.py` (bodies received within budgets; `json_body.py`: parsed, a key given twice refused),
`app.py` (the routes). OpenAI's error bodies, which every part of the front end answers with, are
`rollout.service.http.errors`."""
