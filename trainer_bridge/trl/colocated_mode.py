"""`RolloutGRPOTrainer(rollout_mode="colocate")`: TRL's generation backend replaced by a `ColocatedEngine` on each
rank's own model (see `trainer_bridge.trl` for the server mode this mirrors, and `trainer_bridge.colocated` for the
engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation

from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.engine.runner.model_context import model_context_of
from rollout.transformers_configs import engine_config as to_engine_config
from trainer_bridge.client import GroupResult, PromptGroup
from trainer_bridge.colocated import ColocatedEngine
from trainer_bridge.trl.generation import RolloutGeneration

__all__ = ["ColocatedGeneration", "colocated_generation"]


class ColocatedGeneration(RolloutGeneration):
    """The same backend, colocated: each rank samples its rows with a `ColocatedEngine` on the model it trains (the
    module inside the DDP / ZeRO-3 wrapper, not a copy): no worker, no push. The policy version of a round is the
    global step (shifted up when a new `train()` or a resumed checkpoint starts the count below it again)."""

    def __init__(self, trainer: GRPOTrainer, engine: ColocatedEngine, sleep_between_rounds: bool):
        """
        Args:
            trainer: the GRPOTrainer.
            engine: this rank's colocated engine.
            sleep_between_rounds: free the KV cache after each round, for the training step (the next round
                allocates it again).
        """
        super().__init__(trainer, None, 0)
        self.engine = engine
        self.devices = {engine.engine.kv_cache.kv.device.type}
        self.dtypes = {str(engine.engine.kv_cache.kv.dtype).removeprefix("torch.")}
        self.sleep_between_rounds = sleep_between_rounds
        cap = getattr(trainer.args, "vllm_max_model_length", None)  # TRL builds its colocated LLM's max_model_len of it
        context = engine.engine.max_model_len
        # The engine's context: the model's, unless rollout_engine_config.max_model_len set it.
        named = "rollout_engine_config.max_model_len" if engine.engine.config.max_model_len else "the model's context"
        if cap is None:
            self.context = (context, named)
        elif not isinstance(cap, int) or isinstance(cap, bool) or not 2 <= cap <= context:
            raise ValueError(
                f"GRPOConfig.vllm_max_model_length must be an integer from 2 to {named} ({context} tokens), got {cap!r}"
            )
        else:
            self.context = (cap, "GRPOConfig.vllm_max_model_length")

    def sync_weights(self) -> None:
        """Nothing to send: the engine samples with the trainer's parameters; the next round is tagged with the
        global step."""
        self.engine.set_policy_version(self._next_version())

    def close(self) -> None:
        """The end of a `train()` (returned or raised): free the engine's KV cache and decode graphs, whatever
        `sleep_between_rounds` says, so that their memory does not stay held until the trainer is garbage
        collected (the trainer and its backend refer to each other: only the cycle collector frees them). The next
        round (another `train()`, `evaluate()`) allocates them again; `engine.close()` frees the engine for good."""
        if not self.engine.closed:
            self.engine.sleep(graphs=True)

    def _generate_groups(self, groups: list[PromptGroup]) -> Iterable[GroupResult]:
        try:
            return self.engine.generate(groups)
        finally:
            if self.sleep_between_rounds:
                self.engine.sleep()


def check_same_head(fp32_logits: bool, args: Any) -> None:
    """With batch_invariant, the rollout's head computes in fp32 exactly when the trainer's does (TRL's
    `cast_lm_head_to_fp32`): a head in another dtype gives other bits."""
    if bool(fp32_logits) != bool(getattr(args, "cast_lm_head_to_fp32", False)):
        raise ValueError(
            f"batch_invariant=True: the rollout's fp32_logits ({bool(fp32_logits)}) must equal GRPOConfig."
            f"cast_lm_head_to_fp32 ({bool(getattr(args, 'cast_lm_head_to_fp32', False))})"
        )


def colocated_generation(
    trainer: GRPOTrainer, engine_config: Any, sleep: bool | None, batch_invariant: bool = False
) -> ColocatedGeneration:
    """The backend of "colocate" mode: an engine on this rank's model; each round runs inside TRL's own
    `unwrap_model_for_generation` (ZeRO-3 gathered once, DeepSpeed's hooks lifted, as TRL generates)."""
    if sleep is not None and not isinstance(sleep, bool):  # a string such as "false" would be taken as True
        raise ValueError(f"sleep_between_rounds must be None or a bool, got {sleep!r}")
    fsdp_plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if trainer.is_fsdp_enabled and getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        raise ValueError("rollout_mode='colocate' supports FSDP2, not FSDP1 (flat parameters): set fsdp_version 2")
    model = trainer.accelerator.unwrap_model(trainer.model)
    args = trainer.args
    tool_loop = getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None
    if args.vllm_max_model_length is not None and tool_loop:  # TRL's loop would read the model's context instead
        raise ValueError(
            "GRPOConfig.vllm_max_model_length with tools or environment_factory is not supported in "
            "rollout_mode='colocate': TRL's tool loop drops a turn past the model's context, not past this cap; "
            "leave it None (completions then end at max_completion_length, within the model's context)"
        )
    if engine_config is not None:  # checked here, so that a bad one is named as the trainer's argument
        try:
            engine_config = to_engine_config(engine_config)
        except FieldError as error:
            field = "rollout_engine_config" if error.field == "continuous_batching_config" else error.field
            raise FieldError(field, error.reason) from None
    ceiling = model_context_of(model, rope_scaled=True)
    asked = getattr(engine_config, "max_model_len", None)
    if asked is not None and ceiling is not None and asked > ceiling:  # as vLLM (and rollout-worker) refuse it
        raise ValueError(
            f"rollout_engine_config.max_model_len={asked} is above the model's context of {ceiling} tokens: "
            "completions would run past the positions it was trained for (or fail there)"
        )
    if engine_config is None and next(model.parameters()).device.type == "cuda":
        engine_config = ContinuousBatchingConfig(max_memory_percent=args.vllm_gpu_memory_utilization)
    if getattr(args, "cast_lm_head_to_fp32", False) and not getattr(engine_config, "fp32_logits", False):
        # TRL scores with its head in fp32, outside the mixed precision's autocast: the rounds' head too
        engine_config = dataclasses.replace(engine_config or ContinuousBatchingConfig(), fp32_logits=True)
    if batch_invariant:  # (transformers' config was converted to rollout's above)
        engine_config = dataclasses.replace(engine_config or ContinuousBatchingConfig(), batch_invariant=True)
        check_same_head(engine_config.fp32_logits, args)

    def round_context() -> Any:
        return unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
        )

    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # a processor's tokenizer
    engine = ColocatedEngine(model, engine_config, round_context=round_context, tokenizer=tokenizer)
    try:
        if tool_loop:  # TRL's tool loop drops a turn past the model's context (`_tool_call_loop`), not the engine's
            text_config = model.config.get_text_config()
            ceiling = getattr(text_config, "max_position_embeddings", None)
            if ceiling is not None and engine.engine.max_model_len < ceiling:
                raise ValueError(
                    f"rollout_engine_config.max_model_len={engine.engine.max_model_len} below the model's context "
                    f"({ceiling}) with tools or environment_factory is not supported in rollout_mode='colocate': "
                    "TRL's tool loop drops a turn past the model's context, not past this cap; leave it None"
                )
        return ColocatedGeneration(trainer, engine, args.vllm_enable_sleep_mode if sleep is None else sleep)
    except BaseException:  # a setting refused against the engine: its KV cache is freed now, not at a collection
        engine.close()
        raise
