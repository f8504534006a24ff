"""The OpenAI-compatible HTTP front end of `rollout-worker --http HOST:PORT` (needs the `http` extra: FastAPI,
uvicorn and orjson). Files: launch.py (the flags, started beside the ZeroMQ socket), settings.py (`HttpSettings`),
server.py (uvicorn on a thread), app.py (routes), guard.py (API key, Host check), bodies.py (bodies read and parsed
within limits), endpoints.py (completions and chat answers, streaming), openai_fields.py (request fields ->
SamplingParams), prompts.py (prompts and chat templates -> token ids), answer_size.py (a whole answer's bound),
bridge.py (a request's groups on the engine), choices.py (one sample's answer), errors.py (OpenAI error bodies)."""
