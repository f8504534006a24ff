"""Tool calls in a chat model's text (`rollout-worker --tool-call-parser`): `tool_calls.py` (the parsers and the
`tools` / `tool_choice` fields), `tool_call_stream.py` (the same, fed piece by piece while streaming),
`chat_tools.py` (each choice's text read into OpenAI's `tool_calls`); and back in: `replayed_calls.py` (an
assistant's `tool_calls` in a request's history, arguments parsed for the chat template)."""
