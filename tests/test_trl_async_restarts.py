"""`RolloutGRPOTrainer(..., max_staleness=k)` (and partial rollouts) whose only worker restarts mid-round: the
restarted worker serves its starting weights, older than the step's push, so the client gives it none of the round's
groups, and the next push (which would bring it up to date) comes only after the round. The trainer pushes the
step's weights to it again, at the same version, and trains on (before: the round failed with "stale_workers" after
the client's connect_timeout)."""

from __future__ import annotations

import os
import signal

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402

from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from service_helpers import Worker  # noqa: E402
from trainer_bridge import RolloutClient  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402
from trl_helpers import dataset, grpo_config, id_reward  # noqa: E402

STEPS = 3


@pytest.mark.parametrize("partial", [False, True])
def test_a_worker_restarted_mid_round_gets_the_steps_weights_again(tmp_path, monkeypatch, partial):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    worker = Worker()
    restarted: list[Worker] = []
    try:
        with RolloutClient(worker.address, timeout=60, heartbeat_s=0.2, dead_after_s=1.5, connect_timeout=4) as client:
            trainer = RolloutGRPOTrainer(
                model=tiny_model(0),
                reward_funcs=id_reward,
                args=grpo_config(tmp_path, max_steps=STEPS, max_completion_length=16),
                train_dataset=dataset(),
                processing_class=tiny_tokenizer(),
                rollout_workers=client,
                max_staleness=1,
                partial_rollouts=partial,
            )
            push = trainer.rollout.sync_weights

            def push_then_restart(version=None):
                push(version)
                if not restarted:  # step 0's push landed; its round has not been sent: it waits for the worker
                    worker.process.send_signal(signal.SIGKILL)
                    worker.process.wait()
                    restarted.append(Worker(address=worker.address))

            trainer.rollout.sync_weights = push_then_restart
            rounds = []
            generate_rows = trainer.rollout.generate_rows

            def recorded(prompt_ids, **sampling):
                rows = generate_rows(prompt_ids, **sampling)
                rounds.append((trainer.state.global_step, rows.policy_versions))
                return rows

            trainer.rollout.generate_rows = recorded
            trainer.train()
            assert trainer.state.global_step == STEPS and restarted
            base = trainer.rollout.base_version
            stats = restarted[0].stats()
            # step 0's weights again (the restarted worker's first), then every later step's
            assert stats["weight_updates"] == STEPS and stats["policy_version"] == base + STEPS - 1
            assert len(rounds) == STEPS
            for step, row_versions in rounds:  # the bound holds: the restarted worker never sampled older weights
                assert all(step - 1 <= version - base <= step for runs in row_versions for version, _ in runs)
            trainer.close()
    finally:
        worker.close()
        for server in restarted:
            server.close()
