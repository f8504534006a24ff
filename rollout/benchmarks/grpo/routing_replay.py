"""`rollout-bench grpo-step --routing-replay`: how far a bf16 MoE policy's trainer forward routes tokens away from
the rollout, and what routing replay changes, measured in TRL's own step 1.

Per MoE family (a tiny Qwen3-MoE and a tiny Mixtral, each with 64 experts of which 8 per token, the head scaled to
a mean next-token entropy of 1.5 nats, bf16 parameters), one `RolloutGRPOTrainer` step in colocated mode (the
engine generates on the trainer's own model; the main job's task: 16 rows of 8 samples, 16 new tokens) with
`routing_replay=True`. TRL's recompute of the old policy's log-probs (the no-grad forward TRL makes for its
importance-sampling correction, before any optimizer step, so both sides hold the same weights) runs twice on the
same rows: without replay (the routers deciding) and with it. Measured on each:

- `routes_differ`: the fraction of (token, MoE layer) decisions where the experts the trainer's forward ran (what
  transformers' experts module received) differ from the rollout's, over the rows' prompt and completion tokens;
- `logp_delta_mean` / `logp_delta_p99`: |trainer log-prob - rollout log-prob| over completion tokens;
- `is_ratio_mean`: exp(trainer log-prob - rollout log-prob) over completion tokens (TRL's importance ratio, before
  its truncation); beside the replayed one, TRL's own logged `sampling/importance_sampling_ratio/mean`.

Without replay `routes_differ` is above 0 where bf16 rounding moves a decision (the mismatch replay fixes; a run
where it is 0 says so: nothing was there to fix). With replay it must be 0: otherwise the run fails (exit 1).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

FAMILIES = ("qwen3_moe", "mixtral")
EXPERTS, TOP_K = 64, 8


def moe_policy(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny bf16 MoE policy of `family` on the tiny tokenizer's vocabulary, its head scaled to 1.5 nats."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from rollout.benchmarks.throughput.fidelity import scale_to_entropy
    from rollout.presets.models import random_model, tiny_tokenizer

    shape = dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        num_experts_per_tok=TOP_K,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**shape, head_dim=32, moe_intermediate_size=64, num_experts=EXPERTS)
    elif family == "mixtral":
        config = MixtralConfig(**{**shape, "intermediate_size": 64}, num_local_experts=EXPERTS)
    else:
        raise ValueError(f"unknown MoE family {family!r}: one of {FAMILIES}")
    model = random_model(config, seed, torch.float32)
    tokenizer = tiny_tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in _prompts()[:8]]
    scale_to_entropy(model, prompts)
    return model.to(torch.bfloat16)


def _prompts() -> list[str]:
    from rollout.presets.toy_grpo import toy_prompts

    return toy_prompts(64)


def measure(family: str) -> list[dict[str, Any]]:
    """One TRL step of `family`'s policy with routing replay on; TRL's old-policy forward is also run without it on
    the same rows, before any optimizer step. The measurements above, without and with replay."""
    from datasets import Dataset

    from rollout.presets.models import tiny_tokenizer
    from rollout.presets.toy_grpo import letter_reward, toy_grpo_config
    from trainer_bridge.route_replay import routes_for
    from trainer_bridge.trl import RolloutGRPOTrainer

    model = moe_policy(family)
    experts_used: list[torch.Tensor] = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda module, args: experts_used.append(args[1].detach()))
        for layer in model.model.layers
    ]
    scored: dict[bool, Any] = {}
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = RolloutGRPOTrainer(
            model=model,
            reward_funcs=letter_reward,
            args=toy_grpo_config(output_dir, max_steps=1, gradient_checkpointing=False),
            train_dataset=Dataset.from_dict({"prompt": _prompts()}),
            processing_class=tiny_tokenizer(),
            rollout_mode="colocate",
            routing_replay=True,
        )
        replayed = trainer._get_per_token_logps_and_entropies

        def old_policy_forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            if scored or torch.is_grad_enabled():  # only TRL's first no-grad scoring: the old policy's
                return replayed(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            trainer.routing_replay = False  # the same forward, the routers deciding
            try:
                experts_used.clear()
                plain = super(type(trainer), trainer)._get_per_token_logps_and_entropies
                result = plain(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
                scored[False] = (result[0].detach().float(), list(experts_used))
            finally:
                trainer.routing_replay = True
            experts_used.clear()
            result = replayed(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            scored[True] = (result[0].detach().float(), list(experts_used))
            scored["shape"] = (tuple(input_ids.shape), logits_to_keep)
            return result

        trainer._get_per_token_logps_and_entropies = old_policy_forward
        trainer.train()
        rows = trainer.rollout.last_routed
        logged = [entry for entry in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in entry]
    for hook in hooks:
        hook.remove()
    (batch, width), completion_width = scored["shape"]
    routes = routes_for(rows, pad_to=completion_width, prompt_pad_to=width - completion_width)
    known = routes[..., 0, 0] >= 0
    rollout = [torch.tensor(completion.logprobs) for completion in rows]
    results = []
    for replay in (False, True):
        logps, used = scored[replay]
        ran = torch.stack([u.view(batch, width, TOP_K) for u in used[: len(model.model.layers)]], 2)
        differ = (ran.sort(-1).values != routes.sort(-1).values).any(-1)[known]
        delta = torch.cat([logps[row, : len(lp)] - lp for row, lp in enumerate(rollout)])
        result = {
            "family": family,
            "replay": replay,
            "routes_differ": float(differ.float().mean()),
            "logp_delta_mean": float(delta.abs().mean()),
            "logp_delta_p99": float(delta.abs().quantile(0.99)),
            "is_ratio_mean": float(delta.exp().mean()),  # TRL's ratio: exp(old policy - sampling), untruncated
        }
        if replay and logged:
            result["trl_is_ratio_mean"] = logged[0]["sampling/importance_sampling_ratio/mean"]
        results.append(result)
    return results


def run(families: tuple[str, ...] = FAMILIES) -> dict[str, Any]:
    """Every family; prints a line per measurement as it finishes. Returns the JSON summary."""
    results = []
    for family in families:
        for result in measure(family):
            print(
                f"{family:10s} replay={'on ' if result['replay'] else 'off'}  routes differ "
                f"{result['routes_differ']:.4f}  |dlogp| mean {result['logp_delta_mean']:.3e} p99 "
                f"{result['logp_delta_p99']:.3e}  IS ratio mean {result['is_ratio_mean']:.4f}",
                flush=True,
            )
            results.append(result)
            if not result["replay"] and result["routes_differ"] == 0:
                print(f"{family:10s} no decision differed without replay: nothing for replay to fix here", flush=True)
    failed = [result["family"] for result in results if result["replay"] and result["routes_differ"] != 0]
    if failed:
        raise SystemExit(f"rollout-bench grpo-step --routing-replay: replayed routes still differ for {failed}")
    return {"benchmark": "grpo-step", "routing_replay": results}
