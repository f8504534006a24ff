"""Helpers of the control routes' tests (tests/test_http_control.py): vLLM's own test helpers
(tests/entrypoints/serve/dev/rlhf/conftest.py), ported to httpx with the worker's keys, a streamed completion read on
a thread, and a PEFT adapter directory for the worker's model."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import torch
from peft import LoraConfig, get_peft_model

from rollout.presets import tiny_model

CONTROL = {"Authorization": "Bearer control-key"}
GENERATE = {"Authorization": "Bearer generation-key"}


# ---- vLLM's helpers (tests/entrypoints/serve/dev/rlhf/conftest.py); CHANGED: httpx, with the control key --------
def pause(url, mode="abort", clear_cache=True):
    return httpx.post(
        f"{url}/pause", params={"mode": mode, "clear_cache": clear_cache}, headers=CONTROL, timeout=15
    ).status_code


def resume(url):
    return httpx.post(f"{url}/resume", headers=CONTROL, timeout=10).status_code


def is_paused(url) -> bool:
    return httpx.get(f"{url}/is_paused", headers=CONTROL, timeout=5).json()["is_paused"]


def gen(url, prompt="The capital of France is", max_tokens=8, timeout=30):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=GENERATE, timeout=timeout)
    response.raise_for_status()
    return response.json()


def ok(response) -> bool:
    return response is not None and bool(response.get("choices")) and "error" not in response


class Stream:
    """A streamed completion read on a thread (vLLM's start_stream)."""

    def __init__(self, url: str, max_tokens: int):
        self.chunks: list[dict] = []
        self.finish_reason: str | None = None
        self.error: Any = None
        self.errors: list[dict] = []  # added: error events (none is expected)
        self.started = threading.Event()
        self.done = threading.Event()
        body = {"model": "tiny", "prompt": "Count upward slowly: one, two, three,", "max_tokens": max_tokens}
        body.update(temperature=0, ignore_eos=True, stream=True)
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()
        assert self.started.wait(10), "the stream did not start"
        assert not self.done.is_set()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=GENERATE, timeout=60) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    self.chunks.append(event)
                    self.started.set()
                    reason = event["choices"][0].get("finish_reason")
                    if reason is not None:
                        self.finish_reason = reason
        except Exception as error:  # noqa: BLE001 - the test reads it
            self.error = error
        finally:
            self.started.set()
            self.done.set()


def cached_tokens(response) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def golden_output(response) -> tuple:
    choice = response["choices"][0]
    return choice["text"], choice["finish_reason"], response["usage"]["prompt_tokens"]


def saved_adapter(directory, seed: int) -> str:
    """A PEFT LoRA directory for the worker's model (`tiny`), B trained away from zero."""
    torch.manual_seed(seed)
    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2)
    model.save_pretrained(directory)
    return str(directory)


def load(url, body):
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=CONTROL, timeout=30)
