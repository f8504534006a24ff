"""A request that leaves a sampling field out samples with the model's own generation config where it sets one
(a checkpoint's generation_config.json: Qwen3's temperature 0.6, top_k 20, top_p 0.95), as `vllm serve` does by
default and as `generate` does; a field the request sends wins."""

from __future__ import annotations

import pytest
import torch
from http_helpers import openai_client, serving

from rollout.config import FieldError
from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.settings import HttpSettings

TOKENIZER = tiny_tokenizer()
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model():
    model = tiny_model().eval()
    # top_k 1 keeps one token: sampling under this config is greedy whatever the seed
    model.generation_config.do_sample, model.generation_config.top_k, model.generation_config.temperature = True, 1, 0.7
    return model


@pytest.fixture(scope="module")
def api(model):
    with (
        serving(model, TOKENIZER, HttpSettings(max_n=4, max_prompt_len=128)) as http,
        openai_client(http.url) as client,
    ):
        yield client


def test_a_request_without_sampling_fields_samples_as_the_models_generation_config(api, model):
    ids = TOKENIZER(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    expected = expected[0, len(ids) :].tolist()
    extra = {"return_token_ids": True, "ignore_eos": True}
    answer = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, seed=5, extra_body=extra)
    assert [choice.model_extra["token_ids"] for choice in answer.choices] == [expected, expected]
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, logprobs=True, seed=5
    )
    assert [entry.logprob for entry in chat.choices[0].logprobs.content] == [0.0] * 4  # top_k 1: one token kept


def test_fields_the_request_sends_win_over_the_models(api):
    extra = {"return_token_ids": True, "ignore_eos": True, "top_k": -1}
    answer = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, logprobs=0, seed=5, extra_body=extra
    )
    assert all(logprob < -1 for logprob in answer.choices[0].logprobs.token_logprobs)  # the whole vocabulary


def test_generation_config_vllm_keeps_openais_defaults(model):
    """`--generation-config vllm` (HttpSettings.generation_config): the model's config is not read; a request that
    leaves the fields out samples the whole vocabulary at temperature 1 (OpenAI's defaults)."""
    settings = HttpSettings(max_n=4, max_prompt_len=128, generation_config="vllm")
    with serving(model, TOKENIZER, settings) as http, openai_client(http.url) as client:
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=0, seed=5)
    assert all(logprob < -1 for logprob in answer.choices[0].logprobs.token_logprobs)  # not top_k 1's 0.0
    with pytest.raises(FieldError, match="generation_config"):
        HttpSettings(generation_config="model")
