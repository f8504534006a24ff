"""A busy event loop is not an unread stream. While the HTTP server's event loop is held up by other work (another
client's big event, a parse, a slow hook) the engine generates on, and a request's outputs wait until the loop gets
to them. That lag is the server's own: a whole answer, and a stream whose client reads it, come back whole, as
transformers' greedy generate makes them (only a client that leaves its stream unread is cut:
tests/test_http_attacks.py). Driven by the official `openai` client against an in-process server."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest
import torch

from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import HttpSettings

TOKENIZER = tiny_tokenizer()
PROMPT = "the quick brown fox"
MAX_TOKENS = 300
HELD_TOKENS = 200  # tokens the engine generates while the loop is held: far more than 64 outputs per sample


class LoopHolder:
    """The server's per-request hook (`observe`, called on its event loop as each request ends), made to hold the
    loop, as any work there would, until the engine has generated `HELD_TOKENS` more tokens."""

    def __init__(self) -> None:
        self.manager = None
        self.armed = False
        self.held = threading.Event()  # set once the engine generated HELD_TOKENS while the loop was held

    def generated(self) -> int:
        return self.manager.stats()["generated_tokens"]

    def __call__(self, endpoint: str, status: int, seconds: float) -> None:
        if endpoint != "/health" or not self.armed:
            return
        self.armed = False
        start, deadline = self.generated(), time.monotonic() + 60
        while self.generated() < start + HELD_TOKENS and time.monotonic() < deadline:
            time.sleep(0.005)  # the loop runs nothing else meanwhile; the engine thread generates on
        if self.generated() >= start + HELD_TOKENS:
            self.held.set()


@pytest.fixture(scope="module")
def model():
    return tiny_model().eval()


@pytest.fixture(scope="module")
def served(model):
    holder = LoopHolder()
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    manager = init_continuous_batching(model, continuous_batching_config=config, tokenizer=TOKENIZER).start()
    holder.manager = manager
    http = HttpServer(manager, TOKENIZER, HttpSettings(max_n=8, max_prompt_len=512), observe=holder).start()
    try:
        with openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client, holder, http.url
    finally:
        http.stop()
        manager.stop()


@pytest.fixture(scope="module")
def greedy(model):
    """transformers' greedy continuation of PROMPT (no EOS, as the requests' ignore_eos)."""
    ids = TOKENIZER(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def hold_the_loop_once_generating(served, before: int) -> None:
    """Once the request in flight generates (the engine's token count passed `before`), hold the server's event loop
    while HELD_TOKENS more are generated."""
    _, holder, url = served
    deadline = time.monotonic() + 60
    while holder.generated() <= before and time.monotonic() < deadline:
        time.sleep(0.005)
    holder.armed = True
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # its hook holds the loop after answering


def test_a_whole_answer_survives_a_busy_event_loop(served, greedy):
    api, holder, _ = served
    holder.held.clear()
    before, answer = holder.generated(), {}

    def ask() -> None:
        try:
            answer["ok"] = api.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        except openai.APIError as error:
            answer["error"] = error

    asking = threading.Thread(target=ask)
    asking.start()
    hold_the_loop_once_generating(served, before)
    asking.join(120)
    assert holder.held.is_set()
    assert "error" not in answer, answer.get("error")  # was: 408 stream_not_read, for a request that streams nothing
    (choice,) = answer["ok"].choices
    assert choice.model_extra["token_ids"] == greedy and choice.finish_reason == "length"


def test_a_read_stream_survives_a_busy_event_loop(served, greedy):
    api, holder, _ = served
    holder.held.clear()
    before = holder.generated()
    stream = api.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    holding = threading.Thread(target=hold_the_loop_once_generating, args=(served, before))
    holding.start()
    ids, finish = [], None
    for chunk in stream:  # read as fast as it comes (the openai client raises on an error event)
        (choice,) = chunk.choices
        ids += choice.model_extra["token_ids"]
        finish = choice.finish_reason or finish
    holding.join(120)
    assert holder.held.is_set()
    assert ids == greedy and finish == "length"
