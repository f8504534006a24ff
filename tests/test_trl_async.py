"""`RolloutGRPOTrainer(..., max_staleness=k)`: TRL's GRPOTrainer with the next rounds generated ahead through a real
worker. Checked on what TRL's loss actually received: the rows of every round (their prompts, in the order TRL's own
dataloader gives them to a synchronous run) and the policy version of each of their tokens."""

from __future__ import annotations

import os
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
import trl_worker  # noqa: E402

from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from service_helpers import Worker  # noqa: E402
from trainer_bridge import PromptGroup, RolloutClient  # noqa: E402
from trainer_bridge.trl import RolloutGeneration, RolloutGRPOTrainer  # noqa: E402
from trainer_bridge.trl.async_mode import AsyncRolloutGeneration  # noqa: E402
from trl_helpers import dataset, grpo_config, id_reward, reward_failing_on_call  # noqa: E402

TOKENIZER = tiny_tokenizer()
STEPS = 4


worker, client = trl_worker.worker, trl_worker.client  # the shared worker fixtures


def train(tmp_path, client, max_staleness: int, reward=id_reward, config=None, **kwargs) -> tuple:
    """A short run; returns (trainer, rounds: (global step, row prompts, row policy versions) per round)."""
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=reward,
        args=grpo_config(tmp_path, max_steps=STEPS, **(config or {})),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=client,
        max_staleness=max_staleness,
        **kwargs,
    )
    rounds = []
    generate_rows = trainer.rollout.generate_rows

    def recorded(prompt_ids, **sampling):
        rows = generate_rows(prompt_ids, **sampling)
        rounds.append((trainer.state.global_step, [list(p) for p in prompt_ids], rows.policy_versions))
        return rows

    trainer.rollout.generate_rows = recorded
    trainer.train()
    return trainer, rounds


def wait_no_groups(worker) -> dict:
    deadline = time.monotonic() + 20
    while (stats := worker.stats())["groups_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return stats


def test_async_rounds_keep_the_bound_and_train_the_synchronous_prompts(tmp_path, client, worker):
    """The async run trains a LoRA adapter (`peft_config`): its syncs push the adapter alone (the base once) while
    rounds are sent ahead."""
    from peft import LoraConfig

    sync_trainer, sync_rounds = train(tmp_path / "sync", client, 0)
    assert type(sync_trainer.rollout) is RolloutGeneration  # k=0: today's synchronous path, unchanged
    bytes_before = worker.stats()["weight_update_bytes"]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    trainer, rounds = train(tmp_path / "async", client, 2, peft_config=lora)
    assert isinstance(trainer.rollout, AsyncRolloutGeneration)
    # The same rows, round by round, as the synchronous run: the dataloader was read ahead, never reordered.
    assert [prompts for _, prompts, _ in rounds] == [prompts for _, prompts, _ in sync_rounds]
    assert len(rounds) == STEPS and all(len(prompts) == 8 for _, prompts, _ in rounds)
    # Only the first round was generated on demand: every later one had been sent ahead.
    assert trainer.rollout.num_unmatched_rounds == 1
    base = trainer.rollout.base_version
    for step, _, row_versions in rounds:
        for runs in row_versions:
            assert all(version - base >= step - 2 for version, _ in runs), (step, runs)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["rollout/policy_lag_max"] <= 2 for entry in logs)
    assert all("rollout/wait_s" in entry and "rollout/policy_lag_0" in entry for entry in logs)
    assert any(entry["rollout/policy_lag_max"] > 0 for entry in logs), "nothing was generated ahead under old weights"
    assert all(entry["rollout/worker_idle_s"] >= 0 for entry in logs[1:]) and worker.stats()["idle_s"] > 0
    stats = wait_no_groups(worker)
    assert stats["groups_in_flight"] == 0  # train() cancelled what was sent ahead
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "lora_" in n)
    base = sum(t.numel() * t.element_size() for t in tiny_model(0).parameters())
    assert stats["weight_update_bytes"] - bytes_before == base + STEPS * adapter  # the base once, then adapters
    assert stats["adapters"]["default"]["version"] == stats["policy_version"]


@pytest.mark.parametrize(
    "config, max_staleness",
    [
        (dict(gradient_accumulation_steps=2, steps_per_generation=2), 1),  # a round = 2 micro-steps = 1 step
        (dict(steps_per_generation=2), 2),  # a round spans 2 optimizer steps: 1 round ahead within k=2
        (dict(gradient_accumulation_steps=2, steps_per_generation=1), 1),  # 2 rounds per step: 2 ahead
    ],
)
def test_rounds_ahead_follow_the_steps_a_round_spans(tmp_path, client, config, max_staleness):
    _, sync_rounds = train(tmp_path / "sync", client, 0, config=config)
    trainer, rounds = train(tmp_path / "async", client, max_staleness, config=config)
    assert [prompts for _, prompts, _ in rounds] == [prompts for _, prompts, _ in sync_rounds]
    assert trainer.rollout.num_unmatched_rounds == 1  # every later round had been sent ahead, at the right batch
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert sum(entry.get("rollout/stale_regenerated", 0) for entry in logs) == 0  # none sent too far ahead
    base = trainer.rollout.base_version
    for step, _, row_versions in rounds:
        assert all(version - base >= step - max_staleness for runs in row_versions for version, _ in runs)


def test_upcoming_rounds_of_equal_rows_are_each_sent_ahead(tmp_path, client):
    """A dataset of one prompt: every round has the same rows. Each upcoming round is still sent ahead for its own
    batch (keyed by rows alone, the two rounds ahead were sent as one, the second a step late)."""
    from datasets import Dataset

    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, max_steps=STEPS),
        train_dataset=Dataset.from_dict({"prompt": ["q00 say: "] * 32}),
        processing_class=TOKENIZER,
        rollout_workers=client,
        max_staleness=2,
    )
    sent_at_step: list[int] = []
    send = trainer.rollout._send

    def recorded(group):
        sent_at_step.append(trainer.state.global_step)
        return send(group)

    trainer.rollout._send = recorded
    trainer.train()
    # Round 0 on demand and rounds 1, 2 ahead at step 0; round 3 at step 1 (a round is one group of 8 equal rows).
    assert sent_at_step == [0, 0, 0, 1]
    assert trainer.rollout.num_unmatched_rounds == 1


def test_a_failing_step_stops_the_prefetch_and_leaves_no_metric_to_the_next_run(tmp_path, client, worker):
    """The failed step's metrics (its policy lag among them) were never logged: a next `train()` must not average
    them into its first step's (a per-token lag max of 0.5 was logged)."""
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=reward_failing_on_call(2),
        args=grpo_config(tmp_path, max_steps=STEPS),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=client,
        max_staleness=2,
    )
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert wait_no_groups(worker)["groups_in_flight"] == 0
    assert not any(trainer._metrics["train"].values()), dict(trainer._metrics["train"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_staleness=-1), "max_staleness"),
        (dict(max_staleness=1, stale_policy="drop"), "stale_policy"),
        (dict(stale_policy="is_correct"), "stale_policy='is_correct' has no effect without max_staleness > 0"),
        (dict(max_staleness=1, rollout_mode="colocate", rollout_workers=None), "rollout_mode='server'"),
        (dict(max_staleness=1, rollout_push_kwargs={"mode": "abort"}), "push mode"),
        (dict(max_staleness=1, args_overrides={"steps_per_generation": 2}), "spans"),
        (dict(partial_rollouts=True), "max_partial_rounds=2 .* beyond max_staleness=0"),
        (
            dict(max_staleness=2, partial_rollouts=True, args_overrides={"steps_per_generation": 4}),
            "raise max_staleness",
        ),
        (dict(max_staleness=1, max_partial_rounds=2), "max_partial_rounds has no effect"),
        (dict(max_staleness=1, partial_rollouts=True, partial_overprovision=0), "partial_overprovision"),
        (dict(max_staleness=1, partial_rollouts=1), "partial_rollouts must be True or False"),
    ],
)
def test_bad_staleness_settings_are_refused(tmp_path, client, kwargs, message):
    settings = {"rollout_workers": client, **kwargs}
    config = grpo_config(tmp_path, **settings.pop("args_overrides", {}))
    with pytest.raises(ValueError, match=message):
        RolloutGRPOTrainer(
            tiny_model(0), id_reward, config, train_dataset=dataset(), processing_class=TOKENIZER, **settings
        )


def test_a_worker_killed_mid_run_leaves_training_on_the_survivor(tmp_path):
    """Two workers; one is SIGKILLed after step 1 while it holds groups sent ahead. Training goes on to the end on
    the survivor, every round with all its rows, in the order a synchronous run trains them."""
    import signal

    from transformers import TrainerCallback

    survivor, victim = Worker.several(2)
    try:
        with RolloutClient([survivor.address, victim.address], timeout=120, heartbeat_s=0.2, dead_after_s=1.5) as c:

            class KillAfterStep1(TrainerCallback):
                def on_step_end(self, args, state, control, **kwargs):
                    if state.global_step == 1:
                        victim.process.send_signal(signal.SIGKILL)

            _, sync_rounds = train(tmp_path / "sync", c, 0)
            trainer, rounds = train(tmp_path / "async", c, 1, callbacks=[KillAfterStep1()])
            assert victim.process.poll() is not None  # it was killed mid-run
            assert len(c.stats()) == 1
        assert trainer.state.global_step == STEPS
        assert [prompts for _, prompts, _ in rounds] == [prompts for _, prompts, _ in sync_rounds]
        base = trainer.rollout.base_version
        for step, _, row_versions in rounds:
            assert all(version - base >= step - 1 for runs in row_versions for version, _ in runs)
    finally:
        survivor.close()
        victim.close()


def test_groups_sent_ahead_that_grew_too_stale_are_generated_again(tmp_path, client):
    """After step 1 the versions jump by 3 (as when the workers served other weights meanwhile): the rows sent ahead
    under the old weights are now too old for their step and are generated again; the stale_policy "is_correct"
    keeps them instead."""
    from transformers import TrainerCallback

    class VersionJump(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                jumped.rollout.base_version += 3

    for policy in ("regenerate", "is_correct"):
        jumped = None
        trainer = RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path / policy, max_steps=STEPS),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_workers=client,
            max_staleness=1,
            stale_policy=policy,
            callbacks=[VersionJump()],
        )
        jumped = trainer
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        regenerated = [entry["rollout/stale_regenerated"] for entry in logs]
        if policy == "regenerate":
            assert regenerated[1] > 0 and all(entry["rollout/policy_lag_max"] <= 1 for entry in logs)
        else:
            assert sum(regenerated) == 0 and max(entry["rollout/policy_lag_max"] for entry in logs) > 1


def test_partial_rollouts_train_whole_first_complete_groups(tmp_path, client):
    """partial_rollouts=True, max_staleness=1 (2 rounds): one prompt in four straggles (32 tokens, EOS banned,
    against 2). Every round TRL's loss sees whole groups of 4 rows, each prompt once, with every token's version
    within one step; stragglers are carried into the next round; with the weights unchanged (learning rate 0, push
    mode "keep"), a carried group's tokens are exactly those of the same group generated at once."""
    from trainer_bridge.trl.partial import PartialRolloutGeneration

    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, max_steps=STEPS, learning_rate=0.0, max_completion_length=32),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=client,
        max_staleness=1,
        partial_rollouts=True,
    )
    generation = trainer.rollout
    assert isinstance(generation, PartialRolloutGeneration)
    stragglers = {row for row in dataset()["prompt"] if int(row[1:3]) % 4 == 0}
    generation._group_sampling = lambda rows: (  # noqa: SLF001 - the test's stragglers
        {**generation.sampling, "min_new_tokens": 32}
        if rows[0]["prompt"] in stragglers
        else {**generation.sampling, "max_new_tokens": 2}
    )
    sent, rounds = {}, []
    send_group, take_round = generation._send_group, generation.take_round  # noqa: SLF001

    def record_send(key, group):
        send_group(key, group)
        sent[tuple(group.prompt_ids)] = generation._sent[key]  # noqa: SLF001 - with the seed the client gave it

    def record_round(rows):
        taken = take_round(rows)
        rounds.append((trainer.state.global_step, [row["prompt"] for row in taken], generation._stash))  # noqa: SLF001
        return taken

    generation._send_group, generation.take_round = record_send, record_round  # noqa: SLF001
    trainer.train()
    assert trainer.state.global_step == STEPS and len(rounds) == STEPS
    base, trained = generation.base_version, []
    for step, prompts, (_, completions) in rounds:
        assert len(prompts) == 8 and all(len(set(prompts[i : i + 4])) == 1 for i in (0, 4))  # two whole groups
        trained += prompts[::4]
        for completion in completions:
            assert all(version - base >= step - 1 for version, _ in completion.policy_versions), step
    assert len(set(trained)) == len(trained)  # each prompt trained once
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert sum(entry["rollout/partial_carried_over"] for entry in logs) > 0
    assert set(trained) & stragglers and any(p not in stragglers for p in trained[:2])  # short ones went first
    checked = 0
    for _, prompts, (prompt_ids, completions) in rounds:
        for first in (0, 4):
            if prompts[first] in stragglers:
                group = sent[tuple(prompt_ids[first])]
                (again,) = client.generate_many([PromptGroup(list(group.prompt_ids), group.n, dict(group.sampling))])
                assert [c.token_ids for c in again.completions] == [c.token_ids for c in completions[first : first + 4]]
                checked += 1
    assert checked


def test_tokens_older_than_max_staleness_kept_by_is_correct_are_in_the_lag_buckets():
    """The policy "is_correct" keeps a group older than max_staleness: its tokens' lag is above it. The lag buckets
    once stopped at max_staleness, so those tokens were in none (the fractions summed below 1)."""
    from collections import defaultdict
    from types import SimpleNamespace

    rollout = object.__new__(AsyncRolloutGeneration)
    rollout.max_staleness, rollout.stale_policy = 1, "is_correct"
    rollout.trainer = SimpleNamespace(_metrics={"train": defaultdict(list)}, model=SimpleNamespace(training=True))
    rollout._log_lag([[0, 0, 1, 1], [3, 3, 3, 3, 9, 9]])
    logged = {name: values[-1] for name, values in rollout.trainer._metrics["train"].items()}
    assert logged["rollout/policy_lag_3"] == 0.4 and logged["rollout/policy_lag_8+"] == 0.2
    assert sum(value for name, value in logged.items() if name[len("rollout/policy_lag_") :][0].isdigit()) == 1.0


def test_the_late_results_of_cancelled_rounds_are_not_kept():
    """A round sent ahead for a batch no step asks for is cancelled: its groups' results (finish_reason "abort")
    still arrive on the shared queue, later, while another round is waited for. They are dropped, not kept under
    ids nobody asks for again (one group's completions per cancelled group, for the trainer's life)."""
    import queue
    from types import SimpleNamespace

    from rollout.protocol.messages import GroupResult

    rollout = object.__new__(AsyncRolloutGeneration)
    rollout._sink, rollout._results, rollout._in_flight = queue.SimpleQueue(), {}, {"ahead", "now"}
    rollout._ahead = {(4, (((1, 2), 1),)): [SimpleNamespace(group_id="ahead")]}
    cancelled: list[str] = []
    rollout.client = SimpleNamespace(cancel=cancelled.append, timeout=5)
    rollout._cancel_ahead(lambda index: True)
    assert cancelled == ["ahead"] and not rollout._ahead
    rollout._sink.put(GroupResult("ahead", [1, 2], []))  # the cancelled group's abort, arriving late
    rollout._sink.put(GroupResult("now", [3], []))
    assert [result.group_id for result in rollout._wait(["now"])] == ["now"]
    assert rollout._results == {} and rollout._in_flight == set()
