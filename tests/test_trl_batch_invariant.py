"""RolloutGRPOTrainer(batch_invariant=True): a bf16 colocated GRPO run on a model scaled to realistic entropy, where
TRL's own metrics say that the rollout's log-probs are the trainer's, bit for bit (`sampling_logp_difference/max`
exactly 0, `importance_sampling_ratio` exactly 1), with gradient checkpointing on (TRL's default); the same run
without it differs. Settings it cannot honour are refused by name."""

from __future__ import annotations

import pytest
import torch

from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.presets import tiny_model
from test_trl import IS_METRICS, TOKENIZER, train_logs
from trainer_bridge.trl import RolloutGRPOTrainer
from trl_helpers import dataset, grpo_config, id_reward

DIFFERENCE = "sampling/sampling_logp_difference/max"


def bf16_policy() -> torch.nn.Module:
    """The tiny preset scaled to about 1.5 nats of entropy, in bf16."""
    model = tiny_model(0)
    scale_to_entropy(model, [list(range(1, 11)), list(range(20, 80, 10))])
    return model.to(torch.bfloat16)


def run(tmp_path, batch_invariant: bool) -> list[dict]:
    trainer = RolloutGRPOTrainer(
        model=bf16_policy(),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, temperature=0.7, learning_rate=1e-4),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        batch_invariant=batch_invariant,
    )
    assert trainer.args.gradient_checkpointing
    trainer.train()
    assert trainer.rollout.engine.engine.config.batch_invariant is batch_invariant
    return train_logs(trainer)


@pytest.mark.timeout(240)
def test_trls_importance_ratio_is_exactly_one_in_bf16(tmp_path):
    logs = run(tmp_path / "invariant", batch_invariant=True)
    assert len(logs) == 2
    for entry in logs:
        assert entry[DIFFERENCE] == 0.0, entry
        assert all(entry[name] == 1.0 for name in IS_METRICS), entry
        assert entry["entropy"] > 0.3, entry  # a realistic policy, not a collapsed one
    assert all(entry["grad_norm"] > 0 for entry in logs)
    ordinary = run(tmp_path / "ordinary", batch_invariant=False)
    assert max(entry[DIFFERENCE] for entry in ordinary) > 0.0


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rollout_mode": "server", "rollout_workers": "tcp://127.0.0.1:1"}, "rollout_mode='colocate'"),
        ({"rollout_mode": "colocate", "routing_replay": True}, "routing_replay"),
        ({"rollout_mode": "colocate", "batch_invariant": 1}, "must be a bool"),
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(tmp_path, settings, message):
    settings = {"batch_invariant": True, **settings}
    with pytest.raises(ValueError, match=message):
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            **settings,
        )
