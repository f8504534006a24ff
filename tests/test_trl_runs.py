"""trainer_bridge.trl: what a TRL user meets across runs: the seed reproduces the sampling (as TRL's own generation
does), a temperature TRL's loss cannot divide by is refused by name, a push waits for a restarted worker, a worker
restarted between a push and its round gets the step's weights again (in one process and in two: every rank learns
the pushed version).

References: TRL's own GRPOTrainer (use_vllm=False) on the same tiny model and seed, and the worker's own counters."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
import trl_worker  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from rollout import protocol as p  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from service_helpers import Client, Worker, run_ranks  # noqa: E402
from trainer_bridge import PromptGroup, RolloutClient, RolloutError, push_weights  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402
from trainer_bridge.trl.restarted_workers import learn_pushed_version  # noqa: E402
from trl_helpers import dataset, grpo_config  # noqa: E402

worker, client = trl_worker.worker, trl_worker.client  # the shared worker fixtures


class Recorder:
    """A reward function that keeps every completion it scores (the rows TRL trained on, in its order)."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.completions: list[list[int]] = []

    def __call__(self, completion_ids: list[list[int]], **_: object) -> list[float]:
        self.completions += [list(ids) for ids in completion_ids]
        return [sum(ids) / (1024 * max(len(ids), 1)) for ids in completion_ids]


def sampled(trainer_class: type, tmp_path, seed: int, **kwargs) -> list[list[int]]:
    """The completions of one step of `trainer_class` with GRPOConfig.seed = seed."""
    reward = Recorder()
    trainer = trainer_class(
        model=tiny_model(0),
        reward_funcs=reward,
        args=grpo_config(tmp_path / f"seed{seed}", max_steps=1, seed=seed, **kwargs.pop("config", {})),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        **kwargs,
    )
    trainer.train()
    assert len(reward.completions) == 8
    return reward.completions


def test_the_seed_reproduces_the_sampling_as_trls_own_generation(tmp_path, client):
    """TRL's GRPOTrainer samples the same completions twice with one seed, other ones with another; so do the
    worker and the colocated engine (each rank's groups seeded from GRPOConfig.seed; the client drew random seeds).
    A seed given in generation_kwargs is kept (vLLM's per-request seed)."""
    reference = sampled(GRPOTrainer, tmp_path, 0)
    assert sampled(GRPOTrainer, tmp_path, 0) == reference
    assert sampled(GRPOTrainer, tmp_path, 1) != reference

    for mode in ({"rollout_workers": client}, {"rollout_mode": "colocate"}):
        first = sampled(RolloutGRPOTrainer, tmp_path, 0, **mode)
        assert sampled(RolloutGRPOTrainer, tmp_path, 0, **mode) == first
        assert sampled(RolloutGRPOTrainer, tmp_path, 1, **mode) != first
    given = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=Recorder(),
        args=grpo_config(tmp_path / "given", generation_kwargs={"seed": 7}),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        rollout_workers=client,
    )
    assert given.rollout.seeded(given.rollout.sampling)["seed"] == 7


def test_a_temperature_trls_loss_cannot_divide_by_is_refused_by_name(tmp_path, client):
    """TRL's own trainer refuses temperature 0 (its generate); RolloutGRPOTrainer generated a round, then TRL's loss
    raised ZeroDivisionError. It is refused at construction, naming the field."""
    trl_trainer = GRPOTrainer(
        model=tiny_model(0),
        reward_funcs=Recorder(),
        args=grpo_config(tmp_path / "trl", max_steps=1, temperature=0.0),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
    )
    with pytest.raises(ValueError, match="temperature"):
        trl_trainer.train()
    for temperature in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"GRPOConfig.temperature must be a finite number > 0"):
            RolloutGRPOTrainer(
                model=tiny_model(0),
                reward_funcs=Recorder(),
                args=grpo_config(tmp_path / "ours", temperature=temperature),
                train_dataset=dataset(),
                processing_class=tiny_tokenizer(),
                rollout_workers=client,
            )


def test_a_push_waits_for_a_restarted_worker_and_names_one_that_never_comes_back(tmp_path):
    """The only worker is SIGKILLed after step 1 and restarted at its address: the next push waits for it (as its
    groups would) and training ends, the restarted worker holding every later step's weights. A worker that does not
    come back fails the push after the client's timeout, naming it and how it was lost (the push failed at once,
    "no live rollout worker to push weights to", before)."""
    worker = Worker()
    restarted: list[Worker] = []

    class RestartAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                worker.process.send_signal(signal.SIGKILL)
                worker.process.wait()
                restarted.append(Worker(address=worker.address, wait=False))  # comes up while the trainer waits

    def trainer(client: RolloutClient, callback: TrainerCallback, steps: int) -> RolloutGRPOTrainer:
        return RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=Recorder(),
            args=grpo_config(tmp_path, max_steps=steps),
            train_dataset=dataset(),
            processing_class=tiny_tokenizer(),
            rollout_workers=client,
            callbacks=[callback],
        )

    try:
        with RolloutClient(worker.address, timeout=90, heartbeat_s=0.2, dead_after_s=1.5) as client:
            run = trainer(client, RestartAfterStep1(), 3)
            run.train()
            assert run.state.global_step == 3
            stats = restarted[0].stats()
            assert stats["weight_updates"] == 2  # the pushes of steps 1 and 2, into the restarted process
            assert stats["policy_version"] == run.rollout.base_version + 2

        class KillAfterStep1(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 1:
                    restarted[0].process.send_signal(signal.SIGKILL)

        with RolloutClient(worker.address, timeout=3, heartbeat_s=0.2, dead_after_s=1.5) as client:
            started = time.monotonic()
            with pytest.raises(RolloutError, match=f"within the client's timeout.*{worker.address}: lost") as lost:
                trainer(client, KillAfterStep1(), 3).train()
            assert lost.value.code == "no_workers"
            assert time.monotonic() - started >= 3
    finally:
        worker.close()
        for server in restarted:
            server.close()


def test_a_worker_restarted_between_the_push_and_the_round_gets_the_steps_weights_again(tmp_path):
    """max_staleness=0: the only worker is SIGKILLed right after step 1's push and restarted at its address, with
    the base weights; the round may not use them. The trainer pushes step 1's weights again, at the same version,
    sends the round again and trains on (the round failed with "stale_workers" before)."""
    worker = Worker()
    restarted: list[Worker] = []
    try:
        with RolloutClient(worker.address, timeout=90, heartbeat_s=0.2, dead_after_s=1.5, connect_timeout=2) as client:
            run = RolloutGRPOTrainer(
                model=tiny_model(0),
                reward_funcs=Recorder(),
                args=grpo_config(tmp_path, max_steps=3),
                train_dataset=dataset(),
                processing_class=tiny_tokenizer(),
                rollout_workers=client,
            )
            push = run.rollout.sync_weights

            def push_then_restart(version=None):
                push(version)
                if run.state.global_step == 1 and not restarted:
                    worker.process.send_signal(signal.SIGKILL)
                    worker.process.wait()
                    restarted.append(Worker(address=worker.address))

            run.rollout.sync_weights = push_then_restart
            run.train()
            assert run.state.global_step == 3 and restarted
            stats = restarted[0].stats()
            assert stats["weight_updates"] == 2  # step 1's weights again, then step 2's
            assert stats["policy_version"] == run.rollout.base_version + 2
    finally:
        worker.close()
        for server in restarted:
            server.close()


RESTARTED_BETWEEN_RANKS = textwrap.dedent(
    """
    import json, os, sys, time
    from trl_helpers import dataset, grpo_config, id_reward
    import trainer_bridge.trl.generation as bridge
    import trainer_bridge.trl.restarted_workers as again
    from rollout.presets import tiny_model, tiny_tokenizer
    from trainer_bridge.trl import RolloutGRPOTrainer

    address, out, rank = sys.argv[1], sys.argv[2], int(os.environ["RANK"])
    rows, original_push = [], bridge.push_weights

    def push(client, *args, **kwargs):  # after step 1's sync, the restart; after a rank's push alone, a file
        try:
            return original_push(client, *args, **kwargs)
        finally:
            if "accelerator" not in kwargs:  # restarted_workers: this rank pushed alone
                open(os.path.join(out, f"tried{rank}"), "w").close()
            elif client is not None and trainer.state.global_step == 1:  # the main process: the worker restarts
                open(os.path.join(out, "pushed"), "w").close()  # now, while the other rank waits for this sync
                while not os.path.exists(os.path.join(out, "restarted")):
                    time.sleep(0.05)

    bridge.push_weights = again.push_weights = push
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0), reward_funcs=id_reward, args=grpo_config(out, max_steps=3), train_dataset=dataset(),
        processing_class=tiny_tokenizer(), rollout_workers=address,
        rollout_client_kwargs={"connect_timeout": 2, "heartbeat_s": 0.2, "dead_after_s": 1.5},
    )
    generate_rows = trainer.rollout.generate_rows

    def recording_rows(prompt_ids, **sampling):
        result = generate_rows(prompt_ids, **sampling)
        rows.append({"step": trainer.state.global_step, "versions": result.policy_versions})
        return result

    trainer.rollout.generate_rows = recording_rows
    trainer.train()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"rows": rows, "base": trainer.rollout.base_version, "steps": trainer.state.global_step}, file)
    trainer.rollout_client.close()
    """
)


@pytest.mark.timeout(300)
def test_two_ranks_push_again_after_a_restart_between_the_push_and_the_round(tmp_path):
    """Two processes (gloo), max_staleness=0: the only worker is SIGKILLed right after step 1's push and restarted
    with its starting weights. Each rank's round finds no worker at step 1's version and pushes the weights again
    alone (DDP: every rank holds them whole), finding another update in the worker's slot (as two ranks' pushes that
    each hold some workers' slots and fail; the round failed, "in vain", before), which is then aborted: one rank's
    push lands, the other finds it made. Every token of every rank's rows was sampled with its step's weights (the
    other rank's client did not know step 1's version and sampled the restarted worker's starting weights before)."""
    worker = Worker()
    restarted: list[Worker] = []
    (script := tmp_path / "child.py").write_text(RESTARTED_BETWEEN_RANKS)
    deadline = time.monotonic() + 240

    def wait_for(*names: str) -> None:
        while not all((tmp_path / name).exists() for name in names) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart_once_pushed() -> None:
        wait_for("pushed")
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        restarted.append(Worker(address=worker.address))
        holder, spec = Client(worker.address), [p.TensorSpec("model.norm.weight", "float32", [256])]
        assert isinstance(holder.ask(p.WeightsBegin("held", spec, partial=True, timeout_s=25)), p.WeightsReady)
        (tmp_path / "restarted").touch()
        wait_for("tried0", "tried1")
        holder.ask(p.WeightsAbort("held"))
        holder.close()

    (restarter := threading.Thread(target=restart_once_pushed, daemon=True)).start()
    try:
        run_ranks(script, [worker.address, str(tmp_path)], timeout=240)
        restarter.join(timeout=60)
        results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
        base = results[0]["base"]
        for result in results:
            assert result["steps"] == 3 and [call["step"] for call in result["rows"]] == [0, 1, 2]
            for call in result["rows"]:
                assert all(versions == [[base + call["step"], 0]] for versions in call["versions"]), call
        stats = restarted[0].stats()  # step 1's weights again (once: the other rank found them), then step 2's
        assert (stats["weight_updates"], stats["policy_version"]) == (2, base + 2)
    finally:
        worker.close()
        for server in restarted:
            server.close()


def test_a_rank_learns_the_pushed_version_at_once(worker):
    """A rank other than the main one learns the version the main process pushed (`learn_pushed_version`): its next
    round goes to the worker at once, at that version (before, it waited for its client's next heartbeat)."""
    with RolloutClient(worker.address) as main, RolloutClient(worker.address, heartbeat_s=60) as rank:
        rank.wait_connected()
        learn_pushed_version(rank, push_weights(main, tiny_model(0)).version)  # the same weights, a new version
        result = rank.generate(PromptGroup([1, 2, 3], 1, {"max_new_tokens": 2}), timeout=5)
        assert result.completions[0].policy_versions == [[rank.min_policy_version, 0]]
