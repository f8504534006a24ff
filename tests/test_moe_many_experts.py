"""Routes of models with many experts: above 256 the wire carries int16 frames, and the routes still equal the router
choices transformers reports and replay to the rollout's log-probs; above int16's 32768 expert ids, `return_routes`
is refused by name (the ids wrapped to negative ones: expert 34765 came back as -30771, and expert 65535 as -1,
which replay reads as "the router decides").

References: transformers' own router logits (`output_router_logits=True`, top-k) for a teacher-forced forward of the
same tokens, and the rollout's own fp32 log-probs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from conftest import make_engine, reference_copy, run_to_completion
from rollout.config import FieldError, SamplingParams
from rollout.protocol import messages as p
from rollout.protocol.reply_frames import pack_routes, unpack_message
from trainer_bridge.route_replay import routes_for, routing_replay

ROUTED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), return_routes=True)


def moe_with(experts: int, top_k: int, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=8, num_experts=experts, num_experts_per_tok=top_k,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def test_three_hundred_experts_travel_as_int16_and_replay_to_the_rollouts_logprobs():
    model = moe_with(300, 4)
    reference = reference_copy(model)
    engine = make_engine(reference_copy(model), max_batch_tokens=16)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, ROUTED.merged(seed=index), max_new_tokens=8)
    outputs = run_to_completion(engine)
    engine.close()
    completions = [outputs["r0"], outputs["r1"]]
    for completion in completions:
        tokens = completion.prompt_ids + completion.generated_tokens
        with torch.inference_mode():
            logits = reference(input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True).router_logits
        expected = torch.stack([layer.topk(4, -1).indices for layer in logits], 1).numpy()
        assert np.array_equal(np.concatenate([completion.prompt_routes, completion.routes]), expected)
        frames: list[bytes] = []
        sent = p.Completion(0, completion.generated_tokens, completion.logprobs, "length")
        sent.routes = pack_routes(completion.routes, frames)
        sent.prompt_routes = pack_routes(completion.prompt_routes, frames)
        assert sent.routes.dtype == "int16"
        unpack_message(p.GroupResult("g", completion.prompt_ids, [sent]), frames)
        assert np.array_equal(sent.routes, completion.routes)
        assert np.array_equal(sent.prompt_routes, completion.prompt_routes)
    assert max(int(c.routes.max()) for c in completions) >= 256, "no id above 255: int16 frames were not exercised"

    routes = routes_for(completions)
    ids = torch.zeros(routes.shape[:2], dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, completion in enumerate(completions):
        tokens = completion.prompt_ids + completion.generated_tokens
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    with routing_replay(reference, routes), torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask).logits.float()
    for row, completion in enumerate(completions):
        start = len(completion.prompt_ids) - 1
        log_probs = torch.log_softmax(logits[row, start : start + len(completion.generated_tokens)], -1)
        replayed = log_probs.gather(1, torch.tensor(completion.generated_tokens)[:, None])[:, 0]
        assert torch.allclose(replayed, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)


def test_more_experts_than_int16_ids_hold_are_refused_by_name():
    model = moe_with(40000, 2, hidden=16)
    engine = make_engine(model)
    with pytest.raises(FieldError, match="40000 experts") as error:
        engine.add_request("routed", [5, 6, 7, 8], ROUTED, max_new_tokens=4)
    assert error.value.field == "return_routes"
    engine.add_request("plain", [5, 6, 7, 8], ROUTED.merged(return_routes=False), max_new_tokens=4)
    assert len(run_to_completion(engine)["plain"].generated_tokens) == 4
    engine.close()
