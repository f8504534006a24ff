"""RolloutGRPOTrainer(batch_invariant=True): bf16 GRPO runs on a model scaled to realistic entropy, colocated and
against a rollout-worker started with --batch-invariant, where TRL's own metrics say that the rollout's log-probs are
the trainer's, bit for bit (`sampling_logp_difference/max` exactly 0, `importance_sampling_ratio` exactly 1), with
gradient checkpointing on (TRL's default); the same colocated run without it differs. A worker that does not run
invariant, and settings it cannot honour, are refused by name."""

from __future__ import annotations

import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.presets import tiny_model
from service_helpers import Worker
from test_trl import IS_METRICS, TOKENIZER, train_logs
from trainer_bridge.trl import RolloutGRPOTrainer, invariant_logps, old_logps
from trainer_bridge.trl import trainer as trainer_module
from trl_helpers import dataset, grpo_config, id_reward

DIFFERENCE = "sampling/sampling_logp_difference/max"


def bf16_policy(preset=tiny_model) -> torch.nn.Module:
    """The tiny preset in bf16, as `rollout-worker --dtype bfloat16` builds it (built in bf16, its rotary
    frequencies kept in fp32: `.to(torch.bfloat16)` would round them), scaled to about 1.5 nats of entropy."""
    model = preset(0, dtype=torch.bfloat16)
    scale_to_entropy(model, [list(range(1, 11)), list(range(20, 80, 10))])
    return model


def run(tmp_path, batch_invariant: bool, preset=tiny_model, **mode) -> list[dict]:
    """Two GRPO steps (colocated unless `mode` names workers); TRL's logged steps."""
    trainer = RolloutGRPOTrainer(
        model=bf16_policy(preset),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, temperature=0.7, learning_rate=1e-4),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        batch_invariant=batch_invariant,
        **(mode or {"rollout_mode": "colocate"}),
    )
    assert trainer.args.gradient_checkpointing
    trainer.train()
    if trainer.rollout_mode == "colocate":
        assert trainer.rollout.engine.engine.config.batch_invariant is batch_invariant
    return train_logs(trainer)


def assert_bit_for_bit(logs: list[dict]) -> None:
    assert len(logs) == 2
    for entry in logs:
        assert entry[DIFFERENCE] == 0.0, entry
        assert all(entry[name] == 1.0 for name in IS_METRICS), entry
    assert logs[0]["entropy"] > 0.3, logs[0]  # a realistic policy (the toy reward may sharpen it by step 2)
    assert logs[0]["grad_norm"] > 0


SKIPPED = "rollout/old_logps_forward_skipped"


@pytest.mark.timeout(300)
def test_trls_importance_ratio_is_exactly_one_in_bf16(tmp_path, monkeypatch):
    """With TRL's old-policy forward run (the skip made unverifiable), TRL's own metrics say bit for bit. Skipped
    (the default): one invariant forward fewer per step, and what replaces it equals that forward, bit for bit."""
    forwards, replaced = [], []
    forward = invariant_logps.invariant_logps_and_entropies
    recorded = old_logps.recorded_old_logps

    def counted(*args, **kwargs):
        forwards.append(1)
        return forward(*args, **kwargs)

    def checked(trainer, *args, **kwargs):  # the recorded values against the forward they replace
        found = recorded(trainer, *args, **kwargs)
        if found is not None:
            replaced.append(torch.equal(found, forward(trainer, *args, **kwargs)[0]))
        return found

    monkeypatch.setattr(invariant_logps, "invariant_logps_and_entropies", counted)
    monkeypatch.setattr(trainer_module, "recorded_old_logps", checked)
    monkeypatch.setattr(old_logps, "BITWISE_DEVICES", ())
    with_forward = run(tmp_path / "forward", batch_invariant=True)
    assert_bit_for_bit(with_forward)
    assert all(entry[SKIPPED] == 0.0 for entry in with_forward) and not replaced
    forwards_with, forwards[:] = len(forwards), []
    monkeypatch.setattr(old_logps, "BITWISE_DEVICES", ("cpu",))
    skipped = run(tmp_path / "skipped", batch_invariant=True)
    assert_bit_for_bit(skipped)
    assert all(entry[SKIPPED] == 1.0 for entry in skipped)
    assert replaced == [True, True]  # one old-policy forward per step, two steps
    assert len(forwards) == forwards_with - 2
    ordinary = run(tmp_path / "ordinary", batch_invariant=False)
    # The ordinary engine and TRL's fused head differ, but which step shows it varies with the threads and the
    # process's history: [1.9e-6, 0.148] and [0.0019, 0.0] with one and two threads here, [0.0, 1.9e-6] once in CI.
    assert max(entry[DIFFERENCE] for entry in ordinary) > 0.0, ordinary


@pytest.mark.timeout(300)
def test_an_moe_policy_is_bit_for_bit_with_and_without_routing_replay(tmp_path, monkeypatch):
    """An MoE policy (experts run one F.linear each on both sides): with TRL's old-policy forward run and routed by
    the rollout's routes (routing_replay), TRL's metrics say bit for bit; without the replay, that forward is skipped
    for MoE models too, and TRL's load-balancing loss comes from the invariant forward."""
    from rollout.presets import tiny_moe_model
    from trainer_bridge.route_replay import RouteReplay

    replayed = []
    check = RouteReplay.check
    monkeypatch.setattr(RouteReplay, "check", lambda self, routes: replayed.append(1) or check(self, routes))
    monkeypatch.setattr(old_logps, "BITWISE_DEVICES", ())
    assert_bit_for_bit(run(tmp_path / "replayed", True, tiny_moe_model, rollout_mode="colocate", routing_replay=True))
    assert replayed, "the trainer's forwards should have been routed by the rollout's routes"
    monkeypatch.setattr(old_logps, "BITWISE_DEVICES", ("cpu",))
    skipped = run(tmp_path / "own", batch_invariant=True, preset=tiny_moe_model)
    assert_bit_for_bit(skipped)
    assert all(entry[SKIPPED] == 1.0 for entry in skipped)
    assert all(entry["aux_loss"] > 0 for entry in skipped)  # TRL's load-balancing loss, from the invariant forward


@pytest.mark.timeout(240)
def test_a_worker_started_with_batch_invariant_serves_the_trainers_bits(tmp_path):
    from peft import LoraConfig

    worker = Worker("--batch-invariant", "--dtype", "bfloat16")
    try:
        assert_bit_for_bit(run(tmp_path, batch_invariant=True, rollout_workers=worker.address))
        # A PEFT policy, its adapter pushed adapter-only (served unmerged) and random from the start (peft's own
        # init leaves B zero, an adapter that changes nothing at the first step).
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        push = {"adapters": "adapter"}
        peft_logs = run(
            tmp_path / "peft", True, rollout_workers=worker.address, peft_config=lora, rollout_push_kwargs=push
        )
        assert_bit_for_bit(peft_logs)
    finally:
        worker.close()
    plain = Worker("--dtype", "bfloat16")
    try:
        with pytest.raises(ValueError, match="1 of 1 workers do not run batch-invariant.*--batch-invariant"):
            run(tmp_path, batch_invariant=True, rollout_workers=plain.address)
    finally:
        plain.close()


@pytest.mark.timeout(240)
def test_an_fp32_worker_serves_the_bits_of_a_trainer_casting_its_head_to_fp32(tmp_path, monkeypatch):
    """--fp32-logits changes only a bf16/fp16 worker's head: an fp32 worker computes its head in fp32 either way, so a
    trainer under cast_lm_head_to_fp32 was refused ("workers compute their head without --fp32-logits") for bits it
    gets. TRL's own old-policy forward (run: the skip made unverifiable) equals the worker's log-probs bit for bit."""
    monkeypatch.setattr(old_logps, "BITWISE_DEVICES", ())
    worker = Worker("--batch-invariant")
    try:
        trainer = RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path, max_steps=1, temperature=0.7, cast_lm_head_to_fp32=True),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_workers=worker.address,
            batch_invariant=True,
        )
        trainer.train()
        trainer.close()
    finally:
        worker.close()
    (entry,) = train_logs(trainer)
    assert entry[SKIPPED] == 0.0 and entry[DIFFERENCE] == 0.0, entry
    assert all(entry[name] == 1.0 for name in IS_METRICS), entry


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rollout_mode": "colocate", "batch_invariant": 1}, "must be a bool"),
        (  # checked before connecting: the address is never dialled
            {
                "rollout_workers": "tcp://127.0.0.1:9",
                "peft_config": "lora",
                "rollout_push_kwargs": {"adapters": "merged"},
            },
            "pushed merged .rollout_push_kwargs adapters='merged'.",
        ),
        (
            {"rollout_mode": "colocate", "rollout_engine_config": ContinuousBatchingConfig(fp32_logits=True)},
            "fp32_logits .True. must equal GRPOConfig.cast_lm_head_to_fp32 .False.",
        ),
        (  # refused when built: the compiled graph would be refused at the first step's invariant forward
            {"rollout_mode": "colocate", "config": {"torch_compile": True}},
            "cannot run with GRPOConfig.torch_compile=True",
        ),
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(tmp_path, settings, message):
    settings = {"batch_invariant": True, **settings}
    config = settings.pop("config", {})
    if settings.get("peft_config") == "lora":
        from peft import LoraConfig

        settings["peft_config"] = LoraConfig(r=4, target_modules="all-linear")
    with pytest.raises(ValueError, match=message):
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path, **config),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            **settings,
        )


def test_merged_adapters_are_refused_by_name():
    from trainer_bridge.colocated import ColocatedEngine

    with pytest.raises(FieldError, match="peft_merge"):
        ColocatedEngine(tiny_model(0), ContinuousBatchingConfig(batch_invariant=True, num_blocks=16), peft_merge=True)


def test_the_grpo_toy_example_in_bf16_with_batch_invariant(tmp_path, capsys, monkeypatch):
    """`python examples/grpo_toy.py --colocate --bf16 --batch-invariant`: TRL's own figures, as the example prints
    them, say the rollout's log-probs are the trainer's (with TRL's old-policy forward run: skipped, it would compare
    the rollout's log-probs with themselves)."""
    monkeypatch.setattr(old_logps, "BITWISE_DEVICES", ())
    import importlib.util
    import re

    from test_trl import REPO

    spec = importlib.util.spec_from_file_location("grpo_toy_invariant", REPO / "examples" / "grpo_toy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--steps", "2", "--output-dir", str(tmp_path), "--colocate", "--bf16", "--batch-invariant"]
    assert module.main(argv) == 0  # too few steps to judge the reward's rise: the run itself succeeded
    line = re.search(r"log-prob difference: (\S+); importance ratio (\S+)\.\.(\S+)", capsys.readouterr().out)
    assert line is not None and [float(value) for value in line.groups()] == [0.0, 1.0, 1.0], line


def test_the_old_policy_forward_is_kept_for_rows_or_devices_it_cannot_vouch_for():
    """`recorded_old_logps` on TRL's layout: a lag-0 round gives each row's log-probs (0 past the completion); a row
    sampled with older weights, a row not in the round, a rollout on CUDA or in another dtype, a policy training with a
    dropout (a module, or a config's that its layers apply as a function: OPT's), a trainer under autocast, a reference that is the policy itself (PEFT, beta != 0), the loss's forward
    (with grad) or the reference model each keep the forward (None), and every decision on the policy is counted in
    TRL's metrics."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trainer_bridge.trl.generation import RolloutGeneration
    from trainer_bridge.trl.old_logps import SampledRound, recorded_old_logps

    policy, reference = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    prompts, completions = [[5, 6], [7]], [[1, 2, 3], [4]]
    rows = [SimpleNamespace(token_ids=c, logprobs=[-0.5 * (i + 1)] * len(c)) for i, c in enumerate(completions)]
    # TRL's layout: prompts left-padded to 2, completions right-padded to 3 (pad id 0).
    ids = torch.tensor([[5, 6, 1, 2, 3], [0, 7, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])

    def trainer(lags, devices=("cpu",), dtypes=("float32",), beta=0.0, mixed_precision="no"):
        rollout = SimpleNamespace(
            last_round=SampledRound.of(prompts, rows, lags), devices=set(devices), dtypes=set(dtypes)
        )
        accelerator = SimpleNamespace(num_processes=1, mixed_precision=mixed_precision)
        metrics = {"train": defaultdict(list)}
        return SimpleNamespace(
            rollout=rollout, model=policy, ref_model=None, beta=beta, accelerator=accelerator, _metrics=metrics
        )

    fresh = trainer([[0, 0, 0], [0]])
    with torch.no_grad():
        found = recorded_old_logps(fresh, policy, ids, mask, 3)
        assert torch.equal(found, torch.tensor([[-0.5, -0.5, -0.5], [-1.0, 0.0, 0.0]]))
        assert recorded_old_logps(fresh, reference, ids, mask, 3) is None
        assert recorded_old_logps(fresh, policy, ids, mask, 3, compute_entropy=True) is None
        stale, on_cuda = trainer([[0, 1, 1], [0]]), trainer([[0, 0, 0], [0]], devices=("cuda",))
        assert recorded_old_logps(stale, policy, ids, mask, 3) is None
        assert recorded_old_logps(on_cuda, policy, ids, mask, 3) is None
        for other in ({"dtypes": ("bfloat16",)}, {"mixed_precision": "bf16"}, {"beta": 0.1}):  # PEFT's reference
            assert recorded_old_logps(trainer([[0, 0, 0], [0]], **other), policy, ids, mask, 3) is None, other
        assert recorded_old_logps(fresh, policy, torch.tensor([[5, 6, 1, 2, 9], [0, 7, 4, 0, 0]]), mask, 3) is None
        dropping = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Dropout(0.05)).train()  # lora_dropout's kind
        metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        with_dropout = SimpleNamespace(**{**vars(fresh), "model": dropping, "_metrics": metrics})
        assert recorded_old_logps(with_dropout, dropping, ids, mask, 3) is None
        assert recorded_old_logps(with_dropout, dropping.eval(), ids, mask, 3) is not None  # no mask drawn in eval
        # Routers that draw at random in training mode, and dropouts layers apply as a function, with no dropout
        # module (transformers' own configs): kept.
        from transformers import MixtralConfig, OPTConfig, PhimoeConfig, Starcoder2Config

        drawing = (
            MixtralConfig(router_jitter_noise=0.1),
            PhimoeConfig(),
            OPTConfig(),
            Starcoder2Config(residual_dropout=0.1),
        )
        for config in drawing:
            routed = torch.nn.Linear(1, 1).train()
            routed.config = config
            random_router = SimpleNamespace(**{**vars(fresh), "model": routed, "_metrics": metrics})
            assert recorded_old_logps(random_router, routed, ids, mask, 3) is None, config.model_type
            assert recorded_old_logps(random_router, routed.eval(), ids, mask, 3) is not None  # none drawn in eval
        plain = torch.nn.Linear(1, 1).train()
        plain.config = MixtralConfig(router_jitter_noise=0.0)
        unjittered = SimpleNamespace(**{**vars(fresh), "model": plain, "_metrics": metrics})
        assert recorded_old_logps(unjittered, plain, ids, mask, 3) is not None
    assert recorded_old_logps(fresh, policy, ids, mask, 3) is None  # with grad: the loss's forward
    assert fresh._metrics["train"]["rollout/old_logps_forward_skipped"] == [1.0, 0.0]
    # A round sampled with generation_kwargs that change the log-probs (another mode or temperature) is not recorded.
    generation = SimpleNamespace(trainer=SimpleNamespace(temperature=0.7))
    assert RolloutGeneration.records_old_logps(generation, {"logprob_mode": "temperature_scaled", "temperature": 0.7})
    assert not RolloutGeneration.records_old_logps(generation, {"logprob_mode": "processed", "temperature": 0.7})
    assert not RolloutGeneration.records_old_logps(
        generation, {"logprob_mode": "temperature_scaled", "temperature": 1.3}
    )
    assert stale._metrics["train"]["rollout/old_logps_forward_skipped"] == [0.0]
    assert on_cuda._metrics["train"]["rollout/old_logps_forward_skipped"] == [0.0]


def test_a_setting_whose_bits_differ_is_a_warning_a_stale_row_is_not(caplog):
    """Why the old-policy forward runs: a dropout drawing masks in the trainer's forwards means the rollout's log-probs
    cannot be the trainer's, so the user hears it as a warning; rows sampled with older weights are ordinary (info)."""
    import logging
    from collections import defaultdict
    from types import SimpleNamespace

    from trainer_bridge.trl.old_logps import SampledRound, recorded_old_logps

    ids, mask = torch.tensor([[5, 6, 1, 2, 3]]), torch.ones(1, 5, dtype=torch.long)
    row = SimpleNamespace(token_ids=[1, 2, 3], logprobs=[-0.5] * 3)

    def decide(model: torch.nn.Module, lags: list[int]) -> list[logging.LogRecord]:
        rollout = SimpleNamespace(
            last_round=SampledRound.of([[5, 6]], [row], [lags]), devices={"cpu"}, dtypes={"float32"}
        )
        trainer = SimpleNamespace(
            rollout=rollout, model=model, ref_model=None, beta=0.0, _metrics={"train": defaultdict(list)},
            accelerator=SimpleNamespace(num_processes=1, mixed_precision="no"),
        )  # fmt: skip
        caplog.clear()
        with torch.no_grad(), caplog.at_level(logging.INFO, logger=old_logps.__name__):
            assert recorded_old_logps(trainer, model, ids, mask, 3) is None
        return [record for record in caplog.records if "old-policy forward is run" in record.getMessage()]

    dropping = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Dropout(0.05)).train()  # lora_dropout's kind
    (said,) = decide(dropping, [0, 0, 0])
    assert said.levelno == logging.WARNING and "dropout" in said.getMessage() and "bit for bit" in said.getMessage()
    (said,) = decide(torch.nn.Linear(1, 1), [0, 1, 1])
    assert said.levelno == logging.INFO and "not sampled with the current weights" in said.getMessage()
