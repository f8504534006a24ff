"""A chat request's own chat template as vLLM takes it: the top-level `chat_template` field of /v1/chat/completions
(and of /tokenize with messages), through the official `openai` client's `extra_body`.

rollout refused it as an unknown field even with --trust-request-chat-template (it took a template only inside
`chat_template_kwargs`). With the flag it renders the prompt as the same template inside `chat_template_kwargs` does
(both given and different: refused naming `chat_template`); without it, it is refused naming `chat_template` and
the flag, with the reason the `chat_template_kwargs` form gets. The reference is transformers'
`apply_chat_template(..., chat_template=...)` on the worker's tokenizer."""

from __future__ import annotations

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest

from rollout.presets import tiny_tokenizer
from service_helpers import Worker, free_port

pytestmark = pytest.mark.timeout(120)
TOKENIZER = tiny_tokenizer()
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"}]
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)
UNTRUSTED = (
    "a request's own chat template runs on the worker: refused unless it runs with --trust-request-chat-template"
)


@pytest.fixture(scope="module")
def trusted():
    port = free_port()
    server = Worker("--http", f"127.0.0.1:{port}", "--trust-request-chat-template")
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.close()


def client_of(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)


def prompt_ids(api: openai.OpenAI, **extra) -> list[int]:
    """The prompt token ids the worker rendered for MESSAGES with `extra` in the body."""
    answer = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"return_token_ids": True, **extra}
    )
    return answer.model_extra["prompt_token_ids"]


def test_a_trusted_worker_renders_a_top_level_chat_template(trusted):
    expected = TOKENIZER.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True)["input_ids"]
    assert expected != TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    with client_of(trusted) as api:
        assert prompt_ids(api, chat_template=TEMPLATE) == expected
        assert prompt_ids(api, chat_template_kwargs={"chat_template": TEMPLATE}) == expected  # the same
        assert prompt_ids(api, chat_template=TEMPLATE, chat_template_kwargs={"chat_template": TEMPLATE}) == expected
        with pytest.raises(openai.BadRequestError) as differ:
            prompt_ids(api, chat_template=TEMPLATE, chat_template_kwargs={"chat_template": "{{ 'x' }}"})
        assert differ.value.param == "chat_template"
        assert (
            differ.value.body["message"]
            == "chat_template: differs from chat_template_kwargs.chat_template: give one of them"
        )
        with pytest.raises(openai.BadRequestError) as not_text:
            prompt_ids(api, chat_template=["{{ 'x' }}"])
        assert not_text.value.param == "chat_template" and "must be a string" in not_text.value.message
    tokens = httpx.post(f"{trusted.url}/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE}, timeout=30)
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == expected


def test_without_the_flag_a_top_level_chat_template_is_refused_naming_it_and_the_flag(http_worker):
    with client_of(http_worker) as api:
        with pytest.raises(openai.BadRequestError) as top:
            prompt_ids(api, chat_template=TEMPLATE)
        with pytest.raises(openai.BadRequestError) as nested:
            prompt_ids(api, chat_template_kwargs={"chat_template": TEMPLATE})
    assert top.value.param == "chat_template" and top.value.body["message"] == f"chat_template: {UNTRUSTED}"
    assert nested.value.body["message"] == f"chat_template_kwargs.chat_template: {UNTRUSTED}"  # the same reason
    body = {"messages": MESSAGES, "chat_template": TEMPLATE}
    refused = httpx.post(f"{http_worker.url}/tokenize", json=body, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template"
    assert refused.json()["error"]["message"] == f"chat_template: {UNTRUSTED}"


def test_a_template_is_held_to_its_own_limit_not_to_the_prompts(trusted):
    """A template is code, not prompt text: one longer than a prompt's character cap (here a 70,000-character Jinja
    comment) renders as the short one does, in either field; an empty one, or one past 256,000 characters, is
    refused naming the field it came in."""
    long = TEMPLATE + "{# " + "x" * 70_000 + " #}"
    expected = TOKENIZER.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True)["input_ids"]
    with client_of(trusted) as api:
        assert prompt_ids(api, chat_template=long) == expected
        assert prompt_ids(api, chat_template_kwargs={"chat_template": long}) == expected
        for extra, param in (
            ({"chat_template": " "}, "chat_template"),
            ({"chat_template_kwargs": {"chat_template": ""}}, "chat_template_kwargs"),
            ({"chat_template": "x" * 256_001}, "chat_template"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                prompt_ids(api, **extra)
            assert refused.value.param == param, extra
