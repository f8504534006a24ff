"""`return_token_ids` in a streamed chat answer, where vLLM puts them (its chat_completion_stream_generator): the
prompt's ids at the top level of the first chunks (each choice's role chunk), as the whole chat answer carries them at
its top level, and each choice's `token_ids` in its chunks; read with the official `openai` client's stream."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "name a color"}]


@pytest.fixture(scope="module")
def api(http_worker):
    with openai.OpenAI(base_url=f"{http_worker.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_a_streamed_chat_carries_the_prompt_ids_at_the_top_level_as_vllm(api):
    settings = dict(model="tiny", messages=MESSAGES, n=2, seed=4, max_tokens=6, extra_body={"return_token_ids": True})
    whole = api.chat.completions.create(**settings)
    chunks = list(api.chat.completions.create(stream=True, **settings))
    role_chunks = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.role == "assistant"]
    assert [chunk.choices[0].index for chunk in role_chunks] == [0, 1]
    for chunk in role_chunks:
        assert chunk.model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    token_ids: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            assert "prompt_token_ids" not in choice.model_extra  # (completions' choices carry theirs, not chat's)
            token_ids[choice.index] += choice.model_extra["token_ids"]
    assert [token_ids[0], token_ids[1]] == [choice.model_extra["token_ids"] for choice in whole.choices]
