"""An agent's sessions on a fleet when a worker dies mid-episode: the turn it was generating moves to the other
worker, which prefills the conversation afresh and gives the tokens transformers' `generate` gives; the episode's
next turns then stay with that worker and hit its prefix cache (`cached_prompt_tokens`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout.presets import tiny_model
from service_helpers import Worker
from trainer_bridge import GroupResult, PromptGroup, RolloutClient

pytestmark = pytest.mark.timeout(180)
GREEDY = {"do_sample": False, "stop_token_ids": []}


def hf_greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on the workers' model (the tiny preset, seed 0), no EOS."""
    model = tiny_model(0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def test_a_killed_workers_session_continues_on_the_other_worker():
    victim, survivor = Worker.several(2)
    try:
        with RolloutClient([victim.address], timeout=60) as client:
            first_prompt = [(7 * i + 2) % 900 + 4 for i in range(40)]
            first = client.generate(PromptGroup(first_prompt, sampling={**GREEDY, "max_new_tokens": 4}))
            client.add_worker(survivor.address)
            # Turn 2 extends turn 1: affinity sends it to the victim, which dies while generating it.
            second_prompt = first_prompt + first.completions[0].token_ids + [5, 6, 7]
            results: list[GroupResult] = []
            sampling = {**GREEDY, "max_new_tokens": 160}
            turn = threading.Thread(
                target=lambda: results.append(client.generate(PromptGroup(second_prompt, sampling=sampling)))
            )
            turn.start()
            deadline = time.monotonic() + 30
            while victim.stats()["running"] == 0:
                assert time.monotonic() < deadline, "turn 2 never ran on the worker that held turn 1"
                time.sleep(0.005)
            victim.process.kill()
            turn.join(120)
            assert results, "turn 2 did not finish after its worker died"
            (second,) = results[0].completions
            assert second.cached_prompt_tokens == 0  # a fresh prefill on the survivor
            assert second.token_ids == hf_greedy(second_prompt, 160)
            # Turn 3 stays with the survivor now, and its prefix comes from the survivor's cache.
            third_prompt = second_prompt + second.token_ids + [8, 9]
            third = client.generate(PromptGroup(third_prompt, sampling={**GREEDY, "max_new_tokens": 4}))
            (completion,) = third.completions
            assert completion.cached_prompt_tokens >= len(second_prompt) // 16 * 16
            assert completion.token_ids == hf_greedy(third_prompt, 4)
    finally:
        victim.close()
        survivor.close()
