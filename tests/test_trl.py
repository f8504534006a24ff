"""trainer_bridge.trl: TRL's GRPOTrainer generating through rollout workers (`RolloutGRPOTrainer`).

References are never the bridge's own output: TRL's own teacher-forced logprobs (its `sampling/*` metrics), TRL's own
`_generate_single_turn`, transformers' greedy `generate` of the trained model, the tokenizer's EOS id, the
GRPOConfig values, and the worker's own counters (`policy_version`, `weight_updates`)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import re
import textwrap
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
import trl_worker  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollout.config import SamplingParams  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from service_helpers import run_ranks  # noqa: E402
from trainer_bridge import Completion, GroupResult, PromptGroup, RolloutClient, RolloutError, grpo_sampling  # noqa: E402
from trainer_bridge.trl import SUPPORTED_TRL, RolloutGeneration, RolloutGRPOTrainer, check_trl_internals  # noqa: E402
from trl_helpers import PROMPTS, dataset, grpo_config, id_reward  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
GREEDY = dict(do_sample=False, max_new_tokens=8, stop_token_ids=[])
IS_METRICS = [f"sampling/importance_sampling_ratio/{stat}" for stat in ("min", "mean", "max")]


worker, client = trl_worker.worker, trl_worker.client  # the shared worker fixtures


def versions(client: RolloutClient) -> tuple[int, int]:
    (stats,) = client.stats()
    return stats["policy_version"], stats["weight_updates"]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 8) -> list[list[int]]:
    """transformers' own greedy generate of `model`'s weights; no EOS (like the worker's stop_token_ids=[]).

    The weights go into a fresh tiny model: the trainer's model after train() is in train mode with gradient
    checkpointing on, and there transformers' generate() drops its KV cache ("Caching is incompatible with gradient
    checkpointing") and decodes from the last token alone."""
    reference = tiny_model(0)
    reference.load_state_dict(model.state_dict())
    reference.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = reference.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
            )
            out.append(generated[0, len(prompt) :].tolist())
    return out


def worker_greedy(client: RolloutClient, prompts: list[list[int]]) -> list[list[int]]:
    results = []
    for prompt in prompts:
        (completion,) = client.generate(PromptGroup(prompt, 1, dict(GREEDY))).completions
        assert completion.finish_reason == "length"
        results.append(completion.token_ids)
    return results


GREEDY_PROMPTS = [TOKENIZER(text, add_special_tokens=False)["input_ids"] for text in PROMPTS[:3]] + [
    [5, 900, 17, 333, 64, 1000, 2]
]


def train_logs(trainer: GRPOTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


# ---- 1. check_trl_internals -----------------------------------------------------------------------------------------
def test_check_trl_internals_passes_on_installed_trl():
    from packaging.version import Version

    assert SUPPORTED_TRL[0] <= Version(trl.__version__) < SUPPORTED_TRL[1]
    check_trl_internals()


def test_check_trl_internals_notices_a_moved_sync_call(monkeypatch):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:
            if self.state.global_step != self._last_loaded_step:
                self.vllm_generation.load_weights()  # renamed: the bridge's sync would never run
                self._last_loaded_step = self.state.global_step
            _, completion_ids, logprobs, _ = self.vllm_generation.generate(
                prompts=prompt_ids, images=images, num_generations=num_generations
            )
            logprobs = [[lp[0] for lp in seq] for seq in logprobs]
        return completion_ids, logprobs

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", _generate_single_turn)
    with pytest.raises(RuntimeError, match=re.escape("self.vllm_generation.sync_weights()")):
        check_trl_internals()
    with pytest.raises(RuntimeError, match="changed"):
        RolloutGRPOTrainer(model=None, reward_funcs=id_reward, args=None, rollout_workers="tcp://127.0.0.1:1")


@pytest.mark.parametrize("version", ["1.15.9", "1.17.0", "2.0.0"])
def test_check_trl_internals_refuses_unsupported_versions(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(RuntimeError, match=re.escape(version)) as raised:
        check_trl_internals()
    assert str(SUPPORTED_TRL[0]) in str(raised.value) and str(SUPPORTED_TRL[1]) in str(raised.value)


# ---- 2. GRPO through a real worker ----------------------------------------------------------------------------------
class WeightsAtStepBegin(TrainerCallback):
    """The model's weights at the start of every step: what that step's generation round pushes."""

    def __init__(self):
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_rollout_grpo_trainer_refuses_use_vllm(tmp_path):
    config = grpo_config(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="use_vllm"):
        RolloutGRPOTrainer(model=tiny_model(0), reward_funcs=id_reward, args=config, rollout_workers="tcp://x:1")
    with pytest.raises(ValueError, match="use_vllm"):  # GRPOConfig as GRPOTrainer's third positional argument
        RolloutGRPOTrainer(tiny_model(0), id_reward, config, rollout_workers="tcp://x:1")


def test_a_kl_term_on_a_model_built_in_code_is_refused_naming_beta(tmp_path):
    """With beta > 0, TRL loads its reference model from the policy's path, which a model built in code lacks: TRL's
    own GRPOTrainer fails in the hub client on the empty path; RolloutGRPOTrainer refuses it first, naming beta and
    both ways out. A model loaded from a directory has that path, and a PEFT policy its own reference."""
    from trainer_bridge.trl.settings import check_reference_model

    config = grpo_config(tmp_path, beta=0.04)
    with pytest.raises(OSError, match="Repo id"):  # TRL's own trainer, on the same model and config
        GRPOTrainer(model=tiny_model(0), reward_funcs=id_reward, args=config, train_dataset=dataset())
    with pytest.raises(ValueError, match=r"beta=0.04\) needs a reference model.*save_pretrained.*beta=0.0"):
        RolloutGRPOTrainer(model=tiny_model(0), reward_funcs=id_reward, args=config, rollout_workers="tcp://x:1")
    from peft import LoraConfig

    import trainer_bridge.trl.trainer as trainer_module

    class PastTheCheck(Exception):
        pass

    def past_the_check(*_args, **_kwargs):
        raise PastTheCheck

    with pytest.MonkeyPatch.context() as patch:  # the check after it: the refusal did not come
        patch.setattr(trainer_module, "check_mode", past_the_check)
        lora = LoraConfig(r=4, target_modules=["q_proj"])
        positional = (None,) * 7 + (lora,)  # GRPOTrainer's peft_config, its 11th argument, given positionally
        with pytest.raises(PastTheCheck):
            RolloutGRPOTrainer(tiny_model(0), id_reward, config, *positional, rollout_workers="tcp://x:1")
    saved = tiny_model(0)
    saved.save_pretrained(tmp_path / "policy")
    check_reference_model(AutoModelForCausalLM.from_pretrained(tmp_path / "policy"), config, None)
    check_reference_model(str(tmp_path / "policy"), config, None)
    check_reference_model(tiny_model(0), grpo_config(tmp_path), None)  # beta 0: no reference model


def test_workers_computing_in_another_dtype_than_the_trainer_are_said():
    """A bf16 worker under an fp32 trainer (no autocast) samples log-probs that TRL's correction reads as off-policy:
    the trainer says so, naming the flag; under bf16 autocast (GRPOConfig(bf16=True)) the dtypes agree."""
    from types import SimpleNamespace

    from trainer_bridge.trl.settings import dtype_mismatch

    def trainer(mixed: str, dtypes: set[str]) -> SimpleNamespace:
        return SimpleNamespace(
            accelerator=SimpleNamespace(mixed_precision=mixed),
            model=tiny_model(0),
            rollout=SimpleNamespace(dtypes=dtypes),
        )

    said = dtype_mismatch(trainer("no", {"bfloat16"}))
    assert said.startswith("the rollout workers compute in bfloat16, the trainer in float32")
    assert said.endswith("rollout-worker --dtype float32 for log-probs that match")
    assert dtype_mismatch(trainer("no", {"float32"})) is None
    assert dtype_mismatch(trainer("bf16", {"bfloat16"})) is None
    assert "the trainer in bfloat16" in dtype_mismatch(trainer("bf16", {"float32"}))


@pytest.mark.timeout(120)
def test_bf16_workers_without_an_fp32_head_under_cast_lm_head_to_fp32_are_said(tmp_path, caplog):
    """TRL scores the completions with its head in fp32 (cast_lm_head_to_fp32, outside the autocast); a bf16 worker
    samples with its head in bf16 unless started with --fp32-logits: the trainer says so, naming the flag."""
    from service_helpers import Worker

    for flags, said in [((), True), (("--fp32-logits",), False)]:
        worker = Worker("--dtype", "bfloat16", *flags)
        try:
            caplog.clear()
            with caplog.at_level("WARNING", logger="trainer_bridge.trl"):
                trainer = RolloutGRPOTrainer(
                    model=tiny_model(0),
                    reward_funcs=id_reward,
                    args=grpo_config(tmp_path, bf16=True, cast_lm_head_to_fp32=True),
                    train_dataset=dataset(),
                    processing_class=TOKENIZER,
                    rollout_workers=worker.address,
                )
            trainer.close()
        finally:
            worker.close()
        warned = [r.getMessage() for r in caplog.records if "cast_lm_head_to_fp32" in r.getMessage()]
        assert bool(warned) == said, warned
        if said:
            assert "compute theirs in bfloat16" in warned[0] and "rollout-worker --fp32-logits" in warned[0]


def test_a_policy_the_workers_could_not_take_is_refused_when_the_trainer_is_built(tmp_path):
    """A trained module tied to another (LoRA on the input embedding of a model whose head is that embedding, or a
    merged push of modules_to_save=["lm_head"] there) is refused before a client connects, naming the modules as the
    user named them: it had been refused at the first push, inside train(), with peft's internal parameter name.
    (modules_to_save pushed adapter-only, the default, is served: test_lora_saved_push.py.)"""
    from peft import LoraConfig
    from transformers import Qwen3Config

    from rollout.presets.models import TINY_MODEL_CONFIG, random_model

    config = Qwen3Config(**{**TINY_MODEL_CONFIG, "tie_word_embeddings": True})
    cases = [
        (LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]), {}, r"model.embed_tokens is trained \(LoRA\)"),
        (
            LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
            {"adapters": "merged"},
            r"lm_head is trained \(modules_to_save\) .* tied to model.embed_tokens",
        ),
    ]
    for peft_config, push_kwargs, message in cases:
        with pytest.raises(ValueError, match=f"model: {message}"):
            RolloutGRPOTrainer(
                model=random_model(config, 0, torch.float32),  # (peft wraps a model in place: one per case)
                reward_funcs=id_reward,
                args=grpo_config(tmp_path),
                train_dataset=dataset(),
                processing_class=TOKENIZER,
                peft_config=peft_config,
                rollout_workers="tcp://127.0.0.1:1",  # never reached
                rollout_push_kwargs=push_kwargs,
            )


@pytest.mark.timeout(180)
def test_grpo_steps_through_a_worker(tmp_path, client):
    start_version, start_updates = versions(client)
    untrained = tiny_model(0)
    initial = {name: value.clone() for name, value in untrained.state_dict().items()}
    probe = WeightsAtStepBegin()
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, temperature=0.7),  # the logprobs must then include the temperature
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=client,
        callbacks=[probe],
    )
    assert trainer.rollout_client is client and trainer.vllm_generation is trainer.rollout
    # Default GRPOConfig sampling reaches the worker as valid SamplingParams, stopping at the tokenizer's EOS.
    assert trainer.rollout.sampling["stop_token_ids"] == [EOS]
    assert trainer.rollout.sampling["temperature"] == 0.7 and trainer.rollout.sampling["max_new_tokens"] == 8

    syncs = []
    sync = trainer.rollout.sync_weights
    trainer.rollout.sync_weights = lambda: (syncs.append(trainer.state.global_step), sync())[-1]
    trainer.train()
    assert trainer.state.global_step == 2
    assert syncs == [0, 1]  # TRL synced before each generation round

    logs = train_logs(trainer)
    assert len(logs) == 2
    for entry in logs:
        for name in IS_METRICS:
            assert name in entry and math.isfinite(entry[name]), (name, entry)
        assert abs(entry["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
        # fp32 on both sides: the worker's sampling logprobs are TRL's own teacher-forced ones.
        assert entry["sampling/sampling_logp_difference/mean"] < 1e-4, entry
        assert entry["sampling/sampling_logp_difference/max"] < 1e-3, entry
        assert entry["rollout/policy_lag_mean"] == 0.0 and entry["rollout/policy_lag_max"] == 0.0
        assert entry["completions/mean_length"] > 0
    assert any(entry["grad_norm"] > 0 for entry in logs)

    # One weight update per sync, versions counting on from where the worker was.
    assert versions(client) == (start_version + len(syncs), start_updates + len(syncs))
    # The worker serves the weights the last round pushed (those at the start of step 1) ...
    served = worker_greedy(client, GREEDY_PROMPTS)
    pushed = tiny_model(0)
    pushed.load_state_dict(probe.weights[1])
    assert served == hf_greedy(pushed, GREEDY_PROMPTS)

    # ... and, synced once more, the trained model: transformers' greedy generate of trainer.model.
    trainer.rollout.sync_weights()
    assert versions(client) == (start_version + 3, start_updates + 3)
    trained = trainer.accelerator.unwrap_model(trainer.model)
    assert any(not torch.equal(value, initial[name]) for name, value in trained.state_dict().items())
    served = worker_greedy(client, GREEDY_PROMPTS)
    assert served == hf_greedy(trained, GREEDY_PROMPTS)
    assert served != hf_greedy(untrained, GREEDY_PROMPTS), "training did not change greedy outputs"


@pytest.mark.timeout(180)
def test_importance_ratio_is_one_whatever_truncates_the_sampling(tmp_path, client):
    """TRL's own step-1 `importance_sampling_ratio/mean` is 1 within fp32 noise under top_p=0.9, top_k=20, min_p and
    repetition_penalty: the workers return the logprobs TRL recomputes (log_softmax(logits / T)). Asking for
    "processed" logprobs (the truncated distribution actually sampled from) in the same run makes TRL's ratio
    collapse by the kept mass of every position: the mismatch the default avoids."""
    truncating = dict(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_completion_length=16, max_steps=1
    )
    entries = {}
    for mode in ("temperature_scaled", "processed"):
        extra = {} if mode == "temperature_scaled" else {"generation_kwargs": {"logprob_mode": mode}}
        trainer = RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path / mode, **truncating, **extra),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_workers=client,
        )
        assert trainer.rollout.sampling["logprob_mode"] == mode
        trainer.train()
        (entries[mode],) = train_logs(trainer)
    scaled = entries["temperature_scaled"]
    for name in IS_METRICS:
        assert abs(scaled[name] - 1) < 1e-3, (name, scaled)
    assert scaled["sampling/sampling_logp_difference/max"] < 1e-3, scaled
    assert entries["processed"]["sampling/importance_sampling_ratio/mean"] < 0.5, entries["processed"]


# ---- 3. RolloutGeneration with a fake client ------------------------------------------------------------------------
class FakeClient(RolloutClient):
    """No sockets: records the groups and answers them (results in reverse order, as generate_many may)."""

    def __init__(self, version: int = 41):
        self.version = version
        self.submitted: list[list[PromptGroup]] = []
        self.finish: dict[tuple[int, int], tuple[str, str | None]] = {}  # (group, sample) -> (reason, error)
        self.policy_versions: list[list[int]] | None = None

    def stats(self, timeout=None):
        return [{"address": "fake", "policy_version": self.version, "weight_updates": 0}]

    def generate_many(self, groups, timeout=None):
        groups = list(groups)
        self.submitted.append(groups)
        call = len(self.submitted) - 1
        results = []
        for g, group in enumerate(groups):
            completions = []
            for s in range(group.n):
                length = 1 + (g + s) % 3
                reason, error = self.finish.get((g, s), ("length", None))
                completions.append(
                    Completion(
                        sample_index=s,
                        token_ids=[100 * call + 10 * g + s] * length,
                        logprobs=[-(g + 1) - s / 10] * length,
                        finish_reason=reason,
                        error=error,
                        policy_versions=[
                            run for run in self.policy_versions or [[self.version + 1, 0]] if run[1] < length
                        ],
                    )
                )
            results.append(GroupResult(group.group_id, group.prompt_ids, completions))
        yield from reversed(results)

    def close(self):
        pass


@pytest.fixture
def fake_trainer(tmp_path):
    fake = FakeClient()
    config = grpo_config(
        tmp_path, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, max_completion_length=6
    )
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=config,
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=fake,
    )
    trainer.rollout.sync_weights = lambda version=None: None  # no worker to push to
    return trainer, fake


def resumed_trainer(tmp_path) -> RolloutGRPOTrainer:
    """The trainer of a run resumed from a checkpoint (the fake_trainer's settings, its own output folder)."""
    return RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path / "resumed", temperature=0.7, max_completion_length=6),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=FakeClient(),
    )


def test_a_steps_group_seeds_do_not_depend_on_the_steps_before(fake_trainer, tmp_path):
    """A run resumed at step 5 seeds its groups as the uninterrupted run did at step 5 (the seed is drawn from
    GRPOConfig.seed, the rank, the step and the group's place in it), not from how many groups came before."""
    trainer, _ = fake_trainer
    rollout = trainer.rollout
    trainer.state.global_step = 0
    [rollout.seeded({})["seed"] for _ in range(3)]  # the uninterrupted run's first step
    trainer.state.global_step = 5
    uninterrupted = [rollout.seeded({})["seed"] for _ in range(2)]
    resumed = resumed_trainer(tmp_path)
    resumed.state.global_step = 5
    assert [resumed.rollout.seeded({})["seed"] for _ in range(2)] == uninterrupted
    assert len(set(uninterrupted)) == 2 and rollout.seeded({"seed": 7})["seed"] == 7


def test_an_evaluation_round_does_not_move_the_training_rounds_seeds(fake_trainer, tmp_path):
    """The Trainer evaluates (eval_steps) before it saves a checkpoint at a step: a run resumed from that checkpoint
    evaluates nothing at its first step, so its training round must be seeded as the uninterrupted run's training
    round was after its evaluation (the evaluation's groups had taken the step's first seeds)."""
    trainer, _ = fake_trainer
    rollout = trainer.rollout
    trainer.state.global_step = 5
    trainer.model.eval()
    [rollout.seeded({})["seed"] for _ in range(2)]  # the uninterrupted run's evaluation at step 5
    trainer.model.train()
    uninterrupted = [rollout.seeded({})["seed"] for _ in range(2)]
    resumed = resumed_trainer(tmp_path)
    resumed.state.global_step = 5
    resumed.model.train()
    assert [resumed.rollout.seeded({})["seed"] for _ in range(2)] == uninterrupted


def test_a_round_on_stale_workers_says_what_a_trl_user_can_do(fake_trainer, monkeypatch):
    """Workers still stale after the step's weights were pushed again (once, at the same version): the client's own
    advice (push again) is not a TRL user's to follow mid-train(), so the error says what is (resume, or
    max_staleness >= 1), keeping the client's account of the workers' versions."""
    trainer, fake = fake_trainer
    reason = "every live rollout worker serves weights older than version 43: fake (version 41). push again."
    pushes = []
    trainer.rollout._last_version = 43
    monkeypatch.setattr(trainer.rollout, "sync_weights", lambda version=None: pushes.append(version))

    def stale(groups, timeout=None):
        raise RolloutError("stale_workers", reason)
        yield  # a generator, as the client's

    monkeypatch.setattr(fake, "generate_many", stale)
    with pytest.raises(RolloutError, match="max_staleness >= 1") as failed:
        trainer._generate_single_turn([[11, 12, 13]] * 4, None, {}, 4)
    assert failed.value.code == "stale_workers" and "fake (version 41)" in str(failed.value)
    assert pushes[-1] == 43 and pushes.count(43) == 1  # (None: the round's own push, as TRL asks for it)
    assert "pushed again once, in vain" in str(failed.value)


def test_rows_become_groups_with_the_grpo_sampling(fake_trainer):
    trainer, fake = fake_trainer
    assert trainer.rollout.base_version == fake.version + 1
    a, b = [11, 12, 13], [21, 22]
    rows = [a, a, a, a, b, b, b, b]
    # TRL's own vLLM code path, with the rollout backend behind it.
    completion_ids, logprobs = trainer._generate_single_turn(rows, None, {}, 4)

    (groups,) = fake.submitted
    assert [(group.prompt_ids, group.n) for group in groups] == [(a, 4), (b, 4)]
    assert len({group.group_id for group in groups}) == 2
    expected_sampling = dict(
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        max_new_tokens=6,
        stop_token_ids=[EOS],
        logprob_mode="temperature_scaled",
    )
    assert len({group.sampling.pop("seed") for group in groups}) == 2  # each group seeded (test_trl_runs.py)
    assert [group.sampling for group in groups] == [expected_sampling] * 2
    SamplingParams(**{k: v for k, v in groups[0].sampling.items() if k != "stop_token_ids"})

    # Row order, though the results came back in reverse: rows 0-3 are group 0's samples 0-3, rows 4-7 group 1's.
    expected_ids = [[10 * g + s] * (1 + (g + s) % 3) for g in range(2) for s in range(4)]
    expected_logprobs = [[-(g + 1) - s / 10] * (1 + (g + s) % 3) for g in range(2) for s in range(4)]
    assert completion_ids == expected_ids
    assert logprobs == expected_logprobs

    # Distinct prompts stay distinct groups; a prompt repeated non-consecutively is two groups.
    rows = [a, b, a]
    rows_out = trainer.rollout.generate_rows(rows)
    assert [(group.prompt_ids, group.n) for group in fake.submitted[-1]] == [(a, 1), (b, 1), (a, 1)]
    assert rows_out.completion_ids == [[100], [110, 110], [120, 120, 120]]
    assert not {g.group_id for g in fake.submitted[-1]} & {g.group_id for g in fake.submitted[0]}

    # generate_rows overrides win over the GRPOConfig-derived settings.
    trainer.rollout.generate_rows([a], max_new_tokens=3, temperature=1.0)
    fake.submitted[-1][0].sampling.pop("seed")
    assert fake.submitted[-1][0].sampling == {**expected_sampling, "max_new_tokens": 3, "temperature": 1.0}


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_failed_completions_raise(fake_trainer, reason):
    trainer, fake = fake_trainer
    fake.finish[(1, 2)] = (reason, "worker exploded" if reason == "error" else None)
    rows = [[1, 2]] * 4 + [[3]] * 4
    with pytest.raises(RolloutError) as raised:
        trainer._generate_single_turn(rows, None, {}, 4)
    assert raised.value.code == reason
    if reason == "error":
        assert "worker exploded" in str(raised.value)


def test_policy_lag_metrics(fake_trainer):
    trainer, fake = fake_trainer
    base = fake.version + 1  # version base + s is the trainer's weights at step s
    trainer.model.train()
    trainer.state.global_step = 3
    # Tokens 0-1 sampled by step 1's weights (lag 2), tokens 2+ by step 3's (lag 0).
    fake.policy_versions = [[base + 1, 0], [base + 3, 2]]
    rows = trainer.rollout.generate_rows([[7, 8]] * 4)  # lengths 1, 2, 3, 1
    assert [len(ids) for ids in rows.completion_ids] == [1, 2, 3, 1]
    lags = [2] * 6 + [0]  # every token at lag 2 but the third of sample 2
    assert trainer._metrics["train"]["rollout/policy_lag_mean"][-1] == pytest.approx(sum(lags) / len(lags))
    assert trainer._metrics["train"]["rollout/policy_lag_max"][-1] == 2.0


def test_bad_generation_kwargs_and_images(tmp_path, fake_trainer):
    trainer, _ = fake_trainer
    with pytest.raises(NotImplementedError, match="images"):
        trainer.rollout.generate([[1, 2]], images=[object()], num_generations=1)
    bad = grpo_config(tmp_path, generation_kwargs={"bogus_knob": 1})
    trainer.args = bad
    with pytest.raises(ValueError, match="bogus_knob"):
        RolloutGeneration(trainer, FakeClient(), 1)


def _vllm_backend_fields() -> set[str]:
    """The GRPOConfig fields TRL's own GRPOTrainer hands its vLLM generation backend (read from TRL's source)."""
    import ast

    source = textwrap.dedent(inspect.getsource(GRPOTrainer.__init__))
    call = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VLLMGeneration"
    )
    names = set()
    for keyword in call.keywords:
        for node in ast.walk(keyword.value):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("args", "self")
            ):
                names.add(node.attr)
    return names & {f.name for f in dataclasses.fields(GRPOConfig)}


# A value other than the default for each honoured field, and how the worker's request must change.
HONOURED_CHANGES = {
    "temperature": (0.5, {"temperature": 0.5}),
    "top_p": (0.8, {"top_p": 0.8}),
    "top_k": (7, {"top_k": 7}),
    "min_p": (0.1, {"min_p": 0.1}),
    "repetition_penalty": (1.3, {"repetition_penalty": 1.3}),
    "max_completion_length": (3, {"max_new_tokens": 3}),
    "generation_kwargs": ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
    "vllm_structured_outputs_regex": ("[a-z]+", {"regex": "[a-z]+"}),
}


def test_every_generation_field_trl_hands_vllm_is_honoured_or_refused(fake_trainer):
    """Each GRPOConfig field TRL passes its vLLM backend is classified; an honoured one changes the group the worker
    gets, a refused one fails by name, and the rest configure the vLLM engine the workers replace."""
    trainer, fake = fake_trainer
    backend_fields = _vllm_backend_fields()
    assert {"temperature", "generation_kwargs", "vllm_structured_outputs_regex"} <= backend_fields  # parsed for real
    assert backend_fields <= {*grpo_sampling.HONOURED, *grpo_sampling.NO_EFFECT, *grpo_sampling.REFUSED}
    assert set(HONOURED_CHANGES) == set(grpo_sampling.HONOURED)
    base_args = trainer.args

    def submitted(**changes) -> dict:
        trainer.args = copy.copy(base_args)
        for name, value in changes.items():
            setattr(trainer.args, name, value)
        RolloutGeneration(trainer, fake, 1).generate_rows([[1, 2]])
        return fake.submitted[-1][0].sampling

    baseline = submitted()
    for name, (value, expected) in HONOURED_CHANGES.items():
        request = submitted(**{name: value})
        assert request == {**baseline, **expected}, name
    for name in grpo_sampling.REFUSED:
        with pytest.raises(ValueError, match=f"GRPOConfig.{name}="):
            submitted(**{name: "a+" if name.startswith("vllm") else True})


def test_vllm_spellings_in_generation_kwargs_are_mapped(fake_trainer):
    trainer, fake = fake_trainer
    base_args = trainer.args

    def sampling(generation_kwargs: dict) -> dict:
        trainer.args = copy.copy(base_args)
        trainer.args.generation_kwargs = generation_kwargs
        return RolloutGeneration(trainer, fake, 1).sampling

    mapped = sampling({"max_tokens": 5, "min_tokens": 2, "stop_token_ids": [7, EOS], "detokenize": True})
    assert (mapped["max_new_tokens"], mapped["min_new_tokens"], mapped["stop_token_ids"]) == (5, 2, [EOS, 7])
    assert "detokenize" not in mapped  # no effect: the workers return token ids
    stops = sampling({"stop": ["\n"], "include_stop_str_in_output": True, "skip_special_tokens": False})
    assert (stops["stop"], stops["skip_special_tokens"]) == (["\n"], False)
    assert "include_stop_str_in_output" not in stops  # no effect: a stop string ends the token ids alike either way
    assert sampling({"ignore_eos": True})["stop_token_ids"] == []
    assert sampling({"ignore_eos": True, "stop_token_ids": [9]})["stop_token_ids"] == [9]
    for bad, match in [
        ({"stop": [5]}, "stop"),
        ({"structured_outputs": {"regex": "a"}}, "'structured_outputs'"),
        ({"max_tokens": 4, "max_new_tokens": 4}, "both 'max_tokens' and 'max_new_tokens'"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"min_tokens": -1}, "min_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampling(bad)


def test_a_completion_of_no_tokens_is_refused_at_construction(tmp_path):
    """vLLM refuses max_tokens=0 ("must be at least 1"); rollout takes max_new_tokens=0 beside prompt_logprobs (the
    prompt scored only), whose empty completions TRL cannot score (an IndexError in its first training step).
    (generation_kwargs max_new_tokens=0 is refused by TRL's own GenerationConfig.)"""
    with pytest.raises(ValueError, match=r"generation_kwargs\['max_tokens'\].*at least 1"):
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path, generation_kwargs={"max_tokens": 0, "prompt_logprobs": 0}),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_workers=FakeClient(),
        )


def test_refused_fields_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="use_transformers_"):
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path, use_transformers_paged=True),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_workers=FakeClient(),
        )


# ---- 4. rollout_func ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_rollout_func_generates_through_the_worker(tmp_path, client):
    start_version, start_updates = versions(client)
    calls = []

    def rollout_func(prompts, trainer):
        prompt_ids = [trainer.processing_class(text, add_special_tokens=False)["input_ids"] for text in prompts]
        # The weights were synced before this call: the worker serves this step's version.
        calls.append((trainer.state.global_step, len(prompts), versions(trainer.rollout_client)[0]))
        rows = trainer.rollout.generate_rows(prompt_ids)
        return {"prompt_ids": prompt_ids, "completion_ids": rows.completion_ids, "logprobs": rows.logprobs}

    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_func=rollout_func,
        rollout_workers=client,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert calls == [(0, 8, start_version + 1), (1, 8, start_version + 2)]
    assert versions(client) == (start_version + 2, start_updates + 2)
    logs = train_logs(trainer)
    assert len(logs) == 2
    for entry in logs:
        for name in IS_METRICS:
            assert math.isfinite(entry[name]), (name, entry)
        assert entry["sampling/sampling_logp_difference/mean"] < 1e-4
        assert entry["rollout/policy_lag_mean"] == 0.0


# ---- 5. the main job ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_grpo_toy_main_job(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("grpo_toy_under_test", REPO / "examples" / "grpo_toy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker subprocess it starts: one thread each on 2 cores
    # 30 steps of the default 100 (the suite's time): the reward climbs from about 0.03 (the main job's plot)
    assert module.main(["--steps", "30", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out

    png = tmp_path / "reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (600, 840)  # 7x5 inches at 120 dpi

    steps = re.findall(r"step\s+(\d+)\s+reward ([\d.]+)\s+policy lag ([\d.]+)", out)
    assert [int(step) for step, _, _ in steps] == list(range(1, 31))
    (first, last) = re.search(r"mean reward, first 5 steps: ([\d.]+); last 5 steps: ([\d.]+)", out).groups()
    rewards = [float(reward) for _, reward, _ in steps]
    assert float(first) == pytest.approx(sum(rewards[:5]) / 5, abs=2e-3)
    assert float(last) == pytest.approx(sum(rewards[-5:]) / 5, abs=2e-3)
    # Server-mode samples are not seeded (the worker draws its own seeds), so runs differ: the last five steps' mean
    # reward came out 0.27, 0.54, 0.88 and 0.99 in four runs on the 2-core machine (2026-11-30), from about 0.03.
    assert float(last) - float(first) > 0.15, out[-2000:]


# ---- 6. two processes (gloo), one worker ----------------------------------------------------------------------------
CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl_helpers import dataset, grpo_config, id_reward

    import trainer_bridge.trl.generation as bridge
    from rollout.presets import tiny_model, tiny_tokenizer
    from trainer_bridge.trl import RolloutGRPOTrainer

    address, out = sys.argv[1], sys.argv[2]
    pushes = []
    original_push = bridge.push_weights

    def recording_push(client, *args, **kwargs):
        result = original_push(client, *args, **kwargs)
        pushes.append({"client": client is not None, "result": result is not None, "version": kwargs.get("version")})
        return result

    bridge.push_weights = recording_push

    trainer = RolloutGRPOTrainer(
        model=tiny_model(0), reward_funcs=id_reward, args=grpo_config(out), train_dataset=dataset(),
        processing_class=tiny_tokenizer(), rollout_workers=address,
    )
    rows = []
    generate_rows = trainer.rollout.generate_rows

    def recording_rows(prompt_ids, **sampling):
        result = generate_rows(prompt_ids, **sampling)
        rows.append({"step": trainer.state.global_step, "prompts": prompt_ids,
                     "lengths": [len(ids) for ids in result.completion_ids]})
        return result

    trainer.rollout.generate_rows = recording_rows
    trainer.train()
    rank = trainer.accelerator.process_index
    weights = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    checksum = float(sum(value.double().abs().sum() for value in weights.values()))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "pushes": pushes, "rows": rows,
                   "base": trainer.rollout.base_version, "checksum": checksum,
                   "logs": [e for e in trainer.state.log_history if "loss" in e]}, file)
    trainer.rollout_client.close()
    """
)


@pytest.fixture(scope="module")
def two_ranks(worker, tmp_path_factory):
    """RolloutGRPOTrainer on 2 CPU processes (gloo, as torchrun would start them), each rank with its own client of
    the one worker; 2 steps. Returns (per-rank results, worker (version, updates) before, after)."""
    out = tmp_path_factory.mktemp("two_ranks")
    script = out / "child.py"
    script.write_text(CHILD)
    with RolloutClient(worker.address, timeout=60) as client:
        before = versions(client)
        run_ranks(script, [worker.address, str(out)])
        after = versions(client)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)], before, after


@pytest.mark.timeout(240)
def test_two_ranks_generate_their_own_rows_and_only_the_main_one_pushes(two_ranks):
    results, (start_version, start_updates), after = two_ranks
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    assert results[0]["base"] == results[1]["base"] == start_version + 1  # broadcast from the main process
    # Both ranks took part in every sync; only the main one had a client and sent.
    assert [(p["client"], p["result"]) for p in results[0]["pushes"]] == [(True, True)] * 2
    assert [(p["client"], p["result"]) for p in results[1]["pushes"]] == [(False, False)] * 2
    assert after == (start_version + 2, start_updates + 2)  # 2 syncs, not 4

    for r in results:
        assert [call["step"] for call in r["rows"]] == [0, 1]
        for call in r["rows"]:
            prompts = call["prompts"]
            assert len(prompts) == 8 and all(prompts[i] == prompts[i - i % 4] for i in range(8))  # 2 groups of 4
            assert all(1 <= length <= 8 for length in call["lengths"])
    for step in range(2):  # each rank generated its own share of the batch
        assert results[0]["rows"][step]["prompts"] != results[1]["rows"][step]["prompts"]
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-9)  # DDP kept them in step


@pytest.mark.timeout(240)
def test_two_ranks_sample_with_the_weights_of_their_step(two_ranks):
    results, _, _ = two_ranks
    for r in results:
        for entry in r["logs"]:
            lag = (r["rank"], entry["rollout/policy_lag_mean"], entry["rollout/policy_lag_max"])
            assert lag == (r["rank"], 0.0, 0.0), lag
            assert entry["sampling/sampling_logp_difference/mean"] < 1e-4, (r["rank"], entry)
