"""The settings of `RolloutGRPOTrainer`, refused by name where they cannot be honoured: each belongs to one mode,
and the off-policy ones (max_staleness, partial rollouts) to the modes and push modes that can carry them."""

from __future__ import annotations

import math
import warnings
from typing import Any

from trainer_bridge.staleness import STALE_POLICIES
from trainer_bridge.weights.adapter_mode import push_mode

ROLLOUT_MODES = ("server", "colocate")


def check_staleness(max_staleness: Any, stale_policy: Any, mode: str, rollout_func: Any, push: Any) -> None:
    """max_staleness and stale_policy, refused by name where they cannot be honoured."""
    if max_staleness and (push or {}).get("mode", "keep") not in ("keep", "recompute"):
        raise ValueError("max_staleness > 0 needs push mode 'keep' or 'recompute' (rounds sent ahead are in flight)")
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
    if stale_policy not in STALE_POLICIES:
        raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
    if stale_policy != STALE_POLICIES[0] and not max_staleness:
        raise ValueError(f"stale_policy={stale_policy!r} has no effect without max_staleness > 0 (no round is stale)")
    if max_staleness and mode != "server":
        raise ValueError("max_staleness > 0 needs rollout_mode='server' (colocated generation shares the GPU)")
    if max_staleness and rollout_func is not None:
        raise ValueError("max_staleness > 0 does not apply to rollout_func (it generates its own rows)")


def check_off_policy(max_staleness: int, stale_policy: str, config: Any, steps_per_round: float) -> None:
    """max_staleness and stale_policy against the GRPOConfig, before the trainer connects to any worker.

    Args:
        max_staleness: the trainer's max_staleness (checked by `check_staleness`).
        stale_policy: the trainer's stale_policy.
        config: the GRPOConfig (None: nothing to check against).
        steps_per_round: optimizer steps one generation round spans.
    Raises:
        ValueError: a max_staleness below one round (no round could be sent ahead), or stale_policy="is_correct"
            without TRL's importance-sampling correction (the stale groups it keeps would be trained uncorrected).
    """
    if max_staleness and max_staleness < steps_per_round:
        raise ValueError(
            f"max_staleness={max_staleness} is less than the optimizer steps one generation round spans "
            f"(steps_per_generation * num_iterations / gradient_accumulation_steps = {steps_per_round:g}): raise it"
        )
    if stale_policy == "is_correct" and not getattr(config, "vllm_importance_sampling_correction", True):
        raise ValueError(
            "stale_policy='is_correct' keeps stale groups for TRL's importance-sampling correction to weigh, which "
            "GRPOConfig.vllm_importance_sampling_correction=False turns off: set it True, or use "
            "stale_policy='regenerate'"
        )


def check_mode(mode: str, workers: Any, push: Any, client: Any, engine_config: Any, sleep: bool | None) -> None:
    """Each setting belongs to one mode: a setting of the other mode would be silently ignored, so it is refused."""
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout_mode must be one of {list(ROLLOUT_MODES)}, got {mode!r}")
    if mode == "server" and workers is None:
        raise ValueError(
            'rollout_mode="server" (the default) needs rollout_workers: the address of a running rollout-worker, '
            'e.g. "tcp://127.0.0.1:5555", several, or a RolloutClient; or rollout_mode="colocate" to generate in the '
            "trainer, with no worker"
        )
    other_mode = {
        "server": {"rollout_engine_config": engine_config is not None, "sleep_between_rounds": sleep is not None},
        "colocate": {
            "rollout_workers": workers is not None,
            "rollout_push_kwargs": push is not None,
            "rollout_client_kwargs": client is not None,
        },
    }[mode]
    for name, given in other_mode.items():
        if given:
            raise ValueError(f"{name} has no effect with rollout_mode={mode!r}")
    if push is not None:
        check_push_kwargs(push)


# push_weights' arguments the trainer gives itself at every push, and what it gives.
PUSH_SET_BY_THE_TRAINER = {
    "client": "its workers' client",
    "model_or_named_tensors": "its model",
    "version": "its global step",
    "accelerator": "its accelerator",
}


def check_push_kwargs(push: Any) -> None:
    """Refuse, by name, a `rollout_push_kwargs` entry `push_weights` does not take (a typo would fail only at the
    first push, after the first round), one the trainer sets itself, or a bad value.

    Args:
        push: the trainer's `rollout_push_kwargs`.
    Raises:
        ValueError: "rollout_push_kwargs: ..." naming the entry.
    """
    from trainer_bridge.weights import weight_sync

    if not isinstance(push, dict):
        raise ValueError(f"rollout_push_kwargs must be a dict of push_weights arguments, got {type(push).__name__}")
    try:  # its values too: a bad one would fail only at the first push, after the first round
        weight_sync.check_push_kwargs(push, PUSH_SET_BY_THE_TRAINER, "the trainer")
    except (TypeError, ValueError) as error:
        raise ValueError(f"rollout_push_kwargs: {error}") from None


def check_keywords(kwargs: dict[str, Any], own: Any) -> None:
    """Refuse a keyword argument neither GRPOTrainer nor RolloutGRPOTrainer takes, naming it and the closest one (a
    typo such as `rollout_worker=` was answered "needs rollout_workers", the stray argument unnamed).

    Args:
        kwargs: the keyword arguments left for GRPOTrainer.
        own: RolloutGRPOTrainer's `__init__` (its own arguments).
    """
    import difflib
    import inspect

    from trl import GRPOTrainer

    parameters = [
        *inspect.signature(GRPOTrainer.__init__).parameters.values(),
        *inspect.signature(own).parameters.values(),
    ]
    if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(GRPOTrainer.__init__).parameters.values()):
        return  # a GRPOTrainer that takes any keyword: it judges them itself
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    known = [p.name for p in parameters if p.kind not in variadic and p.name != "self"]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"RolloutGRPOTrainer got an unexpected keyword argument {key!r}{hint}")


def check_tool_loop(trainer: Any, partial_rollouts: bool, max_staleness: int) -> None:
    """TRL's tool loop and environments (`tools=`, `environment_factory=`) with the rollout settings, after
    GRPOTrainer's init: refused where they cannot be honoured, warned where they change what a setting buys.

    Args:
        trainer: the GRPOTrainer, initialised (its `tools` and `environment_factories` set).
        partial_rollouts: the trainer's `partial_rollouts`.
        max_staleness: the trainer's `max_staleness`.
    Raises:
        ValueError: partial_rollouts with tools or environments (a later turn cannot join a later round, and an
            environment's reset() writes its prompt at the round).
    """
    environments = getattr(trainer, "environment_factories", None) is not None
    if not getattr(trainer, "tools", None) and not environments:
        return
    if partial_rollouts:
        raise ValueError(
            "partial_rollouts=True does not support tools or environment_factory (a group's later turns run inside "
            "TRL's tool loop of the round that took it, and an environment's reset() writes its prompt at that "
            "round; neither can carry over to a later round)"
        )
    if max_staleness and environments:
        warnings.warn(
            "max_staleness with environment_factory: each round is generated when TRL asks for it, because the "
            "environments' reset() writes the prompts at that moment; nothing is sent ahead (tools without "
            "environments are)",
            stacklevel=3,
        )


def check_temperature(config: Any) -> None:
    """`GRPOConfig.temperature` must be a positive number: TRL's loss scores `log_softmax(logits / temperature)`,
    so 0 failed with a ZeroDivisionError after the first round was generated (TRL's own generate refuses it too).

    Raises:
        ValueError: naming the field, and what to set for greedy rollouts.
    """
    temperature = getattr(config, "temperature", 1.0)
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and 0 < temperature < math.inf):
        raise ValueError(
            f"GRPOConfig.temperature must be a finite number > 0, got {temperature!r}: TRL's loss divides the logits "
            "by it (for greedy rollouts set generation_kwargs={'do_sample': False})"
        )


def check_vespo_mode(config: Any) -> None:
    """TRL's own check of VESPO's importance-sampling mode, which GRPOTrainer runs only on its vLLM path
    (`use_vllm=True`): RolloutGRPOTrainer builds it with `use_vllm=False` and turns the vLLM path on afterwards, so
    the check is repeated here, in TRL's words, before a round is generated.

    Raises:
        ValueError: `loss_type="vespo"` with the importance-sampling correction on and a mode other than
            "token_truncate" or "token_mask".
    """
    if getattr(config, "loss_type", None) != "vespo" or not getattr(config, "vllm_importance_sampling_correction", 0):
        return
    mode = getattr(config, "vllm_importance_sampling_mode", None)
    if mode not in ("token_truncate", "token_mask"):
        raise ValueError(
            "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
            f"Got: {mode}."
        )


def check_batch_invariant(batch_invariant: Any, config: Any) -> None:
    """`batch_invariant` is a bool, and not beside `GRPOConfig.torch_compile` (the compiled graph runs inductor's
    kernels, not the invariant operations: refused at the first step otherwise). Whether server-mode workers run
    invariant is checked when the trainer connects to them.

    Args:
        batch_invariant: the trainer's `batch_invariant`.
        config: the trainer's `args` (a GRPOConfig, or None).
    """
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    if batch_invariant and getattr(config, "torch_compile", False):
        raise ValueError(
            "batch_invariant=True cannot run with GRPOConfig.torch_compile=True: the compiled graph runs inductor's "
            "fused kernels, not the invariant operations; set torch_compile=False"
        )


def check_push(model: Any, push_kwargs: dict[str, Any] | None, accelerator: Any) -> None:
    """What the first push of `model` would refuse (a trained module tied to another, an adapter that can neither be
    served unmerged nor merged, an unknown `adapters` mode) is refused when the trainer is built, not at its first
    generation round.

    Args:
        model: the trainer's model (possibly wrapped).
        push_kwargs: `rollout_push_kwargs`.
        accelerator: the trainer's accelerator.
    Raises:
        ValueError: what `push_weights` would refuse, named.
    """
    push_mode(model, (push_kwargs or {}).get("adapters", "auto"), accelerator, warn=False)


def check_invariant_push(model: Any, push_kwargs: dict[str, Any] | None, accelerator: Any) -> None:
    """With batch_invariant in server mode, a PEFT policy's adapter must reach the workers adapter-only: merged
    weights (base + LoRA delta) compute other bits than the trainer's unmerged forward.

    Raises:
        ValueError: the push would send merged weights (`adapters="merged"`, or "auto" for an adapter the workers
            cannot serve unmerged), naming why.
    """
    adapters = (push_kwargs or {}).get("adapters", "auto")
    try:
        merged = push_mode(model, adapters, accelerator, warn=False) == "merged"
    except ValueError as refusal:  # "auto" that can neither serve it unmerged nor merge it: the push says so too
        raise ValueError(f"batch_invariant=True: {refusal}") from None
    if merged:
        why = ""
        if adapters == "auto":  # what keeps it from going adapter-only, in the user's terms
            try:
                push_mode(model, "adapter", accelerator, warn=False)
            except ValueError as refusal:
                why = f" ({refusal})"
        raise ValueError(
            f"batch_invariant=True: the PEFT policy would be pushed merged (rollout_push_kwargs adapters={adapters!r})"
            f"{why}, whose weights compute other bits than the trainer's unmerged forward; push it adapter-only"
        )


def check_reference_model(model: Any, config: Any, peft_config: Any) -> None:
    """A policy TRL could not load its reference model for is refused by name, before TRL tries.

    With `beta` > 0, TRL's GRPOTrainer loads the reference model of its KL term from the policy's path
    (`model.config._name_or_path`), unless the policy is a PEFT model (its adapter disabled is the reference). A
    model built in code has no path, which TRL fails on deep in the hub client ("Repo id must use alphanumeric
    chars ...: ''").

    Args:
        model: GRPOTrainer's `model` (a name or path, or a model).
        config: its `args` (a GRPOConfig, or None: TRL's defaults, beta 0).
        peft_config: its `peft_config` (a PEFT policy brings its own reference).
    Raises:
        ValueError: beta > 0 with a non-PEFT model that has no path, naming both ways out.
    """
    beta = getattr(config, "beta", 0.0)
    if not beta or model is None or isinstance(model, str) or peft_config is not None or hasattr(model, "peft_config"):
        return
    if not getattr(getattr(model, "config", None), "_name_or_path", ""):
        raise ValueError(
            f"GRPOConfig(beta={beta}) needs a reference model, which TRL loads from the policy's path "
            "(model.config._name_or_path), and this model was built in code: it has none. Save it first "
            "(model.save_pretrained(DIR), then pass model=DIR or a model loaded from DIR), or set beta=0.0 (TRL's "
            "default: no KL term, no reference model)"
        )


def dtype_mismatch(trainer: Any) -> str | None:
    """Why the workers' log-probs round otherwise than the trainer's: they compute in another dtype than the trainer
    does (its parameters', or its mixed-precision autocast's). None: the same dtype.

    Args:
        trainer: a RolloutGRPOTrainer in server mode, its workers' dtypes read (`rollout.dtypes`).
    """
    mixed = getattr(trainer.accelerator, "mixed_precision", "no")
    computes = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed)
    computes = computes or str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    others = sorted(set(trainer.rollout.dtypes) - {computes, "unknown"})
    if not others:
        return None
    return (
        f"the rollout workers compute in {', '.join(others)}, the trainer in {computes}: their log-probs differ by "
        "rounding, which TRL's importance-sampling correction takes for off-policy samples; start the workers with "
        f"rollout-worker --dtype {computes} for log-probs that match"
    )
