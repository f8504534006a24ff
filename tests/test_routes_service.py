"""MoE routes through a real rollout-worker (`--model tiny-moe`): a PromptGroup with `return_routes` gets each
completion's `routes` and `prompt_routes` as numpy arrays (raw frames on the wire, never lists), equal to the router
choices transformers reports for a teacher-forced forward of the same tokens; streamed deltas carry their tokens'
routes. (A dense worker's refusal of `return_routes` is in test_worker.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.presets import tiny_moe_model
from service_helpers import Worker, free_port
from trainer_bridge import PromptGroup, RolloutClient
from trainer_bridge.route_replay import routes_for

pytestmark = pytest.mark.timeout(120)
PROMPTS = [[(31 * i + 7 * j) % 1000 + 4 for j in range(12 + 5 * i)] for i in range(2)]
SAMPLING = {"temperature": 1.0, "top_k": 0, "stop_token_ids": [], "max_new_tokens": 10, "return_routes": True}


@pytest.fixture(scope="module")
def worker():
    port = free_port()
    server = Worker("--model", "tiny-moe", "--http", f"127.0.0.1:{port}")
    server.url = f"http://127.0.0.1:{port}"
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


def test_the_http_api_returns_routed_experts(worker):
    """`return_routed_experts` (the official openai client's extra_body): each choice carries `routed_experts` and
    `prompt_routed_experts` as base64 .npy arrays (SGLang's and vLLM's field names), whole or per streamed chunk; a
    malformed value is refused by name (a dense model's refusal: tests/test_http.py)."""
    import base64
    import io

    import openai

    def decoded(text: str) -> np.ndarray:
        return np.load(io.BytesIO(base64.b64decode(text)))

    settings = dict(
        model="tiny-moe",
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=1.0,
        extra_body={"return_routed_experts": True, "return_token_ids": True, "ignore_eos": True},
    )
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60) as api:
        choice = api.completions.create(**settings).choices[0].model_extra
        expected = reference_routes(PROMPTS[0] + choice["token_ids"][:-1])
        assert np.array_equal(decoded(choice["prompt_routed_experts"]), expected[: len(PROMPTS[0]) - 1])
        assert np.array_equal(decoded(choice["routed_experts"]), expected[len(PROMPTS[0]) - 1 :])
        chunks = [c.choices[0].model_extra for c in api.completions.create(stream=True, **settings) if c.choices]
        tokens = [t for chunk in chunks for t in chunk.get("token_ids") or []]
        expected = reference_routes(PROMPTS[0] + tokens[:-1])
        streamed = np.concatenate([decoded(c["routed_experts"]) for c in chunks if c.get("token_ids")])
        assert np.array_equal(streamed, expected[len(PROMPTS[0]) - 1 :])
        with pytest.raises(openai.BadRequestError) as error:
            api.completions.create(**{**settings, "extra_body": {"return_routed_experts": 1}})
        assert error.value.body["param"] == "return_routed_experts"
        scored = api.completions.create(  # the prompt scored only: no token, routes of the model's shape still
            **{**settings, "max_tokens": 0, "extra_body": {**settings["extra_body"], "echo": True}}
        ).choices[0]
        assert decoded(scored.model_extra["routed_experts"]).shape == (0, *expected.shape[1:])


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"max_staleness": 2},  # rounds generated ahead: each round's own routes
        {"max_staleness": 2, "partial_rollouts": True},  # rounds of whole first-finished groups
        {"rollout_mode": "colocate"},  # the engine on the trainer's own model
    ],
)
def test_trl_grpo_replays_the_rollouts_routes(tmp_path, worker, monkeypatch, mode):
    """RolloutGRPOTrainer(routing_replay=True): TRL's log-prob forwards (the loss forward, its recomputation by
    gradient checkpointing in backward and, with steps_per_generation 2, the old policy's) route by the rollout's
    routes, covering every prompt and completion token; TRL's importance ratio stays 1 (fp32); the hooks are gone
    after train(); a dense model is refused by name."""
    from rollout.presets import tiny_model, tiny_tokenizer
    from trainer_bridge.route_replay import RouteReplay
    from trainer_bridge.trl import RolloutGRPOTrainer
    from trl_helpers import dataset, grpo_config, id_reward

    replayed = []  # the routes each router call of the trainer's forwards was given
    check = RouteReplay.check

    def spy(self, routes):
        replayed.append(routes.detach().clone())
        return check(self, routes)

    monkeypatch.setattr(RouteReplay, "check", spy)
    config = grpo_config(tmp_path, max_steps=2, steps_per_generation=2, temperature=1.0)
    trainer = RolloutGRPOTrainer(
        model=tiny_moe_model(0),
        reward_funcs=id_reward,
        args=config,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        rollout_workers=None if mode.get("rollout_mode") == "colocate" else worker.address,
        routing_replay=True,
        **mode,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    ratios = [
        entry["sampling/importance_sampling_ratio/mean"]
        for entry in logs
        if "sampling/importance_sampling_ratio/mean" in entry
    ]
    assert ratios and all(abs(ratio - 1) < 1e-3 for ratio in ratios), logs
    assert replayed and all(routes.shape[2:] == (4, 2) for routes in replayed)
    assert trainer._replays is None  # the taps were detached when train() returned
    for routes in replayed:  # every row routes its prompt and completion tokens (not the padding)
        assert ((routes >= 0).all(-1).all(-1).sum(1) > 0).all()
    if mode:
        return
    with pytest.raises(ValueError, match="routing_replay"):
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=config,
            train_dataset=dataset(),
            processing_class=tiny_tokenizer(),
            rollout_workers=worker.address,
            routing_replay=True,
        )
