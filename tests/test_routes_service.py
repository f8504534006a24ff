"""MoE routes through a real rollout-worker (`--model tiny-moe`): a PromptGroup with `return_routes` gets each
completion's `routes` and `prompt_routes` as numpy arrays (raw frames on the wire, never lists), equal to the router
choices transformers reports for a teacher-forced forward of the same tokens; streamed deltas carry their tokens'
routes. (A dense worker's refusal of `return_routes` is in test_worker.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.service.presets import tiny_moe_model
from service_helpers import Worker
from trainer_bridge import PromptGroup, RolloutClient
from trainer_bridge.routing_replay import routes_for

pytestmark = pytest.mark.timeout(120)
PROMPTS = [[(31 * i + 7 * j) % 1000 + 4 for j in range(12 + 5 * i)] for i in range(2)]
SAMPLING = {"temperature": 1.0, "top_k": 0, "stop_token_ids": [], "max_new_tokens": 10, "return_routes": True}


@pytest.fixture(scope="module")
def worker():
    server = Worker("--model", "tiny-moe")
    yield server
    server.close()


@torch.inference_mode()
def reference_routes(tokens: list[int]) -> np.ndarray:
    output = tiny_moe_model(0)(input_ids=torch.tensor([tokens]), output_router_logits=True)
    return torch.stack([logits.topk(2, -1).indices for logits in output.router_logits], 1).numpy()


def test_routes_travel_with_completions_and_deltas(worker):
    with RolloutClient(worker.address, timeout=60) as client:
        result = client.generate(PromptGroup(PROMPTS[0], n=2, sampling=SAMPLING))
        for completion in result.completions:
            expected = reference_routes(PROMPTS[0] + completion.token_ids[:-1])
            assert completion.routes.dtype == np.int16 and completion.routes.shape == (10, 4, 2)
            assert np.array_equal(completion.prompt_routes, expected[: len(PROMPTS[0]) - 1])
            assert np.array_equal(completion.routes, expected[len(PROMPTS[0]) - 1 :])
        completion.prompt_ids = PROMPTS[0]  # routes_for reads what a Completion carries
        assert routes_for([completion]).shape == (1, len(PROMPTS[0]) + 10, 4, 2)
        *deltas, streamed = list(client.stream(PromptGroup(PROMPTS[1], sampling=SAMPLING)))
        tokens = [token for delta in deltas for token in delta.token_ids]
        expected = reference_routes(PROMPTS[1] + tokens[:-1])
        assert np.array_equal(deltas[0].prompt_routes, expected[: len(PROMPTS[1]) - 1])
        assert np.array_equal(np.concatenate([d.routes for d in deltas]), expected[len(PROMPTS[1]) - 1 :])
        assert np.array_equal(streamed.completions[0].routes, expected[len(PROMPTS[1]) - 1 :])
        plain = client.generate(PromptGroup(PROMPTS[0], sampling={**SAMPLING, "return_routes": False}))
        assert plain.completions[0].routes is None
