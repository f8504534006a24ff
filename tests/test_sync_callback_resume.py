"""`WeightSyncCallback` against workers that already serve later versions than the trainer's step count: a trainer
restarted or resumed from a checkpoint (or a second run) while its rollout workers keep running. Its pushes must
still be taken (versions above what the workers serve, growing from push to push), and the workers must then serve
exactly the pushed weights: greedy tokens equal to transformers' own `generate` on the pushed model.

The callback is driven as transformers' Trainer drives it (`on_step_end` with the trainer's state); a real
rollout-worker serves `--model tiny` (tiny_model(0))."""

from __future__ import annotations

import types

import pytest
import torch

from rollout.presets import tiny_model
from service_helpers import Worker
from trainer_bridge import PromptGroup, RolloutClient
from trainer_bridge.weights.sync_callback import WeightSyncCallback

pytestmark = pytest.mark.timeout(120)

PROMPT = [(37 * i + 5) % 101 for i in range(21)]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def worker():
    server = Worker()
    yield server
    server.close()


def step_end(callback: WeightSyncCallback, step: int, model: torch.nn.Module) -> None:
    """What transformers' Trainer calls after optimizer step `step` on the main process."""
    state = types.SimpleNamespace(global_step=step, is_world_process_zero=True)
    callback.on_step_end(None, state, None, model=model)


def transformers_greedy(model: torch.nn.Module) -> list[int]:
    output = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    return output[0, len(PROMPT) :].tolist()


def served(client: RolloutClient) -> tuple[list[int], list[list[int]]]:
    sampling = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": NEW_TOKENS}
    completion = client.generate(PromptGroup(PROMPT, sampling=sampling), timeout=30).completions[0]
    return list(completion.token_ids), completion.policy_versions


def test_a_resumed_trainer_pushes_above_what_the_workers_serve(worker):
    with RolloutClient(worker.address, timeout=30) as client:  # the first run: steps 1-3
        first = WeightSyncCallback(client)
        start = client.stats()[0]["policy_version"]
        for step in (1, 2, 3):
            step_end(first, step, tiny_model(seed=1))
        assert first.last_result.version > start
        if start == 0:  # fresh workers: the version is the global step
            assert first.last_result.version == 3
        newest = client.stats()[0]["policy_version"]
    resumed_model = tiny_model(seed=2)
    expected = transformers_greedy(resumed_model)
    assert expected != transformers_greedy(tiny_model(seed=1)), "the check could not tell the pushes apart"
    with RolloutClient(worker.address, timeout=30) as client:  # restarted, resumed from its step-2 checkpoint
        resumed = WeightSyncCallback(client)
        step_end(resumed, 3, resumed_model)  # refused before: version 3 does not exceed the workers' newest
        version = resumed.last_result.version
        assert version > newest
        assert served(client) == (expected, [[version, 0]])
        step_end(resumed, 4, tiny_model(seed=1))
        assert resumed.last_result.version == version + 1  # the offset stays: versions follow the steps
        assert served(client)[1] == [[version + 1, 0]]


def test_a_step_count_that_starts_again_keeps_versions_growing(worker):
    with RolloutClient(worker.address, timeout=30) as client:
        callback = WeightSyncCallback(client)
        step_end(callback, 1, tiny_model(seed=1))
        before = callback.last_result.version
        model = tiny_model(seed=2)
        step_end(callback, 1, model)  # a second trainer.train() in the same process: global step 1 again
        assert callback.last_result.version == before + 1
        assert served(client) == (transformers_greedy(model), [[before + 1, 0]])
