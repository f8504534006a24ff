"""Tool calls in a chat model's text (`rollout-worker --tool-call-parser`): `tool_calls.py` (the parsers and the
`tools` / `tool_choice` fields), `tool_call_stream.py` (the same, fed piece by piece while streaming),
`chat_tools.py` (each choice's text read into OpenAI's `tool_calls`)."""
