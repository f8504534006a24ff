"""RolloutGRPOTrainer's colocated and asynchronous modes at their edges: what a run leaves behind when `train()`
returns or raises (the colocated KV cache, a client the trainer made), the settings refused by name before anything
connects, and what max_staleness sends ahead (never past max_steps, never an evaluation round's samples). Checked
against torch's own tensor lifetimes (weak references, no garbage collection), the threads Python runs, the groups
the client was handed and the metrics TRL logged."""

from __future__ import annotations

import os
import threading
import weakref

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
import trl_worker  # noqa: E402
from datasets import Dataset  # noqa: E402

from rollout.config import ContinuousBatchingConfig  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402
from trl_helpers import dataset, grpo_config, id_reward, reward_failing_on_call  # noqa: E402

TOKENIZER = tiny_tokenizer()
NOWHERE = "tcp://127.0.0.1:9"  # nothing listens: a trainer refused before connecting never notices

worker, client = trl_worker.worker, trl_worker.client  # the shared worker fixtures


def client_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "rollout-client")


def trainer_for(tmp_path, config=None, **kwargs) -> RolloutGRPOTrainer:
    settings = dict(train_dataset=dataset(), processing_class=TOKENIZER)
    settings.update(kwargs)
    return RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=settings.pop("reward", id_reward),
        args=grpo_config(tmp_path, **(config or {})),
        **settings,
    )


def test_colocated_train_frees_the_kv_cache_when_it_returns_or_raises(tmp_path):
    """sleep_between_rounds=False keeps the cache across rounds, not past train(): when the reward function raises
    at the second round, the cache tensor the rounds used is freed at once (no garbage collection: the trainer and
    its backend refer to each other), and a second train() samples again on a fresh one."""
    failing_reward = reward_failing_on_call(2)
    trainer = trainer_for(
        tmp_path,
        reward=failing_reward,
        rollout_mode="colocate",
        sleep_between_rounds=False,
        rollout_engine_config=ContinuousBatchingConfig(num_blocks=64, block_size=16),
    )
    engine = trainer.rollout.engine
    cache = weakref.ref(engine.engine.kv_cache.kv)
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert engine.num_rounds == 2 and engine.is_sleeping and engine.kv_cache_bytes == 0
    assert cache() is None  # freed, not waiting for the cycle collector
    trainer.train()  # the failing call is spent: this run trains its 2 steps
    assert engine.num_rounds == 4 and engine.kv_cache_bytes == 0
    assert [e["rollout/policy_lag_max"] for e in trainer.state.log_history if "loss" in e] == [0.0, 0.0]


def test_a_refused_server_trainer_closes_the_client_it_made(tmp_path, worker):
    """A refusal that needs the workers' answer comes after the trainer made its client: that client is closed (no
    I/O thread left per retry). One passed in stays the caller's, open."""
    before = client_threads()
    with pytest.raises(ValueError, match="do not run batch-invariant"):
        trainer_for(tmp_path, rollout_workers=worker.address, max_staleness=1, batch_invariant=True)
    assert client_threads() == before


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        # below one round: refused before any client is made
        (dict(steps_per_generation=2), dict(max_staleness=1), "max_staleness=1 is less than .* spans"),
        # the stale groups "is_correct" keeps would be trained with no correction at all
        (
            dict(vllm_importance_sampling_correction=False),
            dict(max_staleness=1, stale_policy="is_correct"),
            "vllm_importance_sampling_correction=False",
        ),
        (dict(), dict(max_staleness=1.0), "max_staleness must be an integer"),
        (dict(), dict(max_staleness=True), "max_staleness must be an integer"),
    ],
)
def test_off_policy_settings_are_refused_before_connecting(tmp_path, config, kwargs, message):
    before = client_threads()
    with pytest.raises(ValueError, match=message):
        trainer_for(tmp_path, config, rollout_workers=NOWHERE, **kwargs)
    assert client_threads() == before


def test_a_large_max_staleness_sends_no_round_past_max_steps(tmp_path, client):
    """max_staleness=10 on a 3-step run: the rounds of steps 1 and 2 are sent ahead at step 0, and nothing that no
    step trains; the lag metrics stop at LAG_BUCKETS, older tokens counted together."""
    from trainer_bridge.trl.async_mode import LAG_BUCKETS

    trainer = trainer_for(tmp_path, dict(max_steps=3), rollout_workers=client, max_staleness=10)
    sent, trained = [], []
    submit, generate_rows = client._submit, trainer.rollout.generate_rows  # noqa: SLF001

    def record_submit(group, **kwargs):
        sent.append((trainer.state.global_step, tuple(group.prompt_ids)))
        return submit(group, **kwargs)

    def record_rows(prompt_ids, **sampling):
        trained.extend(tuple(p) for p in prompt_ids[::4])
        return generate_rows(prompt_ids, **sampling)

    client._submit, trainer.rollout.generate_rows = record_submit, record_rows  # noqa: SLF001
    trainer.train()
    assert trainer.state.global_step == 3 and len(trained) == 6  # 2 groups a round
    assert trainer.rollout.num_unmatched_rounds == 1
    assert sorted(prompt for _, prompt in sent) == sorted(trained)  # no group sent that no step trained
    assert [step for step, _ in sent] == [0] * 6  # all of it sent at step 0 (k=10 allows it)
    logged = {name for entry in trainer.state.log_history for name in entry if name.startswith("rollout/policy_lag_")}
    buckets = {f"rollout/policy_lag_{i}" for i in range(LAG_BUCKETS)} | {f"rollout/policy_lag_{LAG_BUCKETS}+"}
    assert logged - {"rollout/policy_lag_mean", "rollout/policy_lag_max"} == buckets


def test_an_evaluation_round_is_not_served_a_training_round_sent_ahead(tmp_path, client):
    """Every round has the same rows (one prompt): after step 1's push, evaluation samples with that step's weights
    (policy lag 0), not with the training round that step 0 sent ahead; that one is still there for its step."""
    same = Dataset.from_dict({"prompt": ["same prompt: "] * 4})
    trainer = trainer_for(
        tmp_path,
        dict(
            max_steps=2,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            eval_strategy="steps",
            eval_steps=1,
        ),
        train_dataset=same,
        eval_dataset=Dataset.from_dict({"prompt": ["same prompt: "]}),
        rollout_workers=client,
        max_staleness=1,
    )
    trainer.train()
    evals = [entry for entry in trainer.state.log_history if "eval_rollout/policy_lag_max" in entry]
    assert len(evals) == 2 and all(entry["eval_rollout/policy_lag_max"] == 0.0 for entry in evals)
    assert trainer.rollout.num_unmatched_rounds == 1  # training round 1 took what step 0 sent ahead for it


def test_close_releases_what_the_trainer_made_in_every_mode(tmp_path, worker, client):
    """trainer.close(): the client it connected is closed (its I/O thread gone), one passed in stays open and
    serving; a colocated engine is closed for good. Twice is the same as once."""
    before = client_threads()
    made = trainer_for(tmp_path, rollout_workers=worker.address)
    assert client_threads() == before + 1
    made.close()
    made.close()
    assert client_threads() == before
    passed = trainer_for(tmp_path, rollout_workers=client)
    passed.close()
    assert client.stats()  # still the caller's, still connected
    colocated = trainer_for(
        tmp_path, rollout_mode="colocate", rollout_engine_config=ContinuousBatchingConfig(num_blocks=64, block_size=16)
    )
    colocated.close()
    colocated.close()
    assert colocated.rollout.engine.closed
