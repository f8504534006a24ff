"""The OpenAI / vLLM API on the engine, in the order a request passes: `endpoints.py` (completions and chat, whole or
streamed), `openai_fields.py` (fields -> `SamplingParams`), `prompts.py` and `template_inputs.py` (prompts and chat
templates -> token ids), `structured_fields.py` and `constraint_wait.py` (structured outputs, compiled off the
loop), `answer_size.py` (a whole answer's bound), `bridge.py` (the request's groups on the engine), `choices.py` (one
sample's answer), `answers.py` (the whole answer's JSON, or its stream of events), `prompt_scoring.py` (echo and
prompt log-probs), `served_models.py` (/v1/models), `tokenize.py`
(/tokenize, /detokenize)."""
