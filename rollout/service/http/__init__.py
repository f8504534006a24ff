"""The OpenAI-compatible HTTP front end of `rollout-worker --http HOST:PORT` (needs the `http` extra: FastAPI,
uvicorn and orjson), on the same engine manager as the ZeroMQ socket. In the order a request passes:

- `serving/`: the server (flags, settings, uvicorn on a thread, connections, bodies read within limits, the API key
  and Host guard, request metrics, the FastAPI routes);
- `api/`: an OpenAI / vLLM request turned into the engine's groups and back into an answer (fields, prompts,
  structured outputs, the groups on the engine, choices, streaming, tokenize);
- `tools/`: tool calls read from a chat model's text (`--tool-call-parser`), whole or streamed;
- `errors.py`: OpenAI's error bodies and statuses, which all three answer with.
"""
