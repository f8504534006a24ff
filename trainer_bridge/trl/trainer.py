"""TRL's GRPOTrainer generating through rollout workers (`RolloutGRPOTrainer`, whose docstring says how to use it).

Why a subclass: TRL 1.16 has no pluggable generation backend, but its vLLM code path is exactly what a rollout
service needs. Once per generation round, when the global step changed, it calls `vllm_generation.sync_weights()`
on every rank; it then calls `vllm_generation.generate(...)` for the rows; it feeds the returned per-token logprobs
to the importance-sampling correction (`importance_sampling_ratio`, `sampling/*` metrics). `RolloutGRPOTrainer`
builds the stock trainer with vLLM off (so vLLM need not be installed), then turns TRL's vLLM path on with
`RolloutGeneration` in place of TRL's vLLM backend: an object with the same two methods. `check_trl_internals()`
fails loudly when a TRL release moves what this relies on; the supported range is `SUPPORTED_TRL`.

What `RolloutGeneration` does:
- `generate`: each rank sends its own rows, with no collective (ranks cannot deadlock). Consecutive rows with the
  same prompt (TRL repeats a prompt `num_generations` times) become one group with `n`, so the prompt is prefilled
  once. Sampling settings come from GRPOConfig (`trainer_bridge.grpo_sampling`: temperature, top_p, top_k, min_p,
  repetition_penalty, max_completion_length, generation_kwargs with vLLM's spellings mapped; what cannot be
  honoured is refused at construction); the trainer's EOS tokens stop generation; logprobs are "temperature_scaled"
  (log_softmax(logits / temperature) of the unprocessed logits), exactly what TRL recomputes for its importance
  ratio, so the ratio measures only numerical train/inference differences, whatever top_p, top_k, min_p or
  repetition_penalty truncated or reshaped the sampled distribution. (`generation_kwargs={"logprob_mode":
  "processed"}` asks for the sampled distribution's logprobs instead; TRL's ratio then falls below 1 by the kept
  probability mass of every truncated position.) The policy lag of every token (trainer step - the step whose
  weights sampled it) is logged as `rollout/policy_lag_mean` and `rollout/policy_lag_max`.
- `sync_weights`: `push_weights` with version = (the workers' version when training started) + 1 + global step.
  Every rank takes part in gathering (ZeRO-3, FSDP2; a PEFT model's adapter alone, its base once); only the main
  process sends; then the
  ranks wait for each other (all of them call it at the same point), so none samples before the workers serve the
  new weights.

Colocated: `ColocatedGeneration.sync_weights` only sets the next round's policy version (the global step). Tool
loops: TRL's loop calls `generate` once per turn with the conversation so far (prompt + completion + tool result
tokens); every turn's tokens carry their logprobs and versions, and TRL masks the tool-result tokens itself.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import trl
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

from rollout.invariant.mode import batch_invariant as batch_invariant_forward
from trainer_bridge.client import RolloutClient
from trainer_bridge.partial_rounds import DEFAULT_MAX_PARTIAL_ROUNDS, DEFAULT_OVERPROVISION, check_partial
from trainer_bridge.trl.generation import RolloutGeneration, RolloutRows
from trainer_bridge.trl.invariant_logps import InvariantScoringMixin
from trainer_bridge.trl.old_logps import recorded_old_logps
from trainer_bridge.trl.routes import RoutingReplayMixin, check_routing_replay
from trainer_bridge.trl.server_mode import server_generation
from trainer_bridge.trl.settings import (
    check_batch_invariant,
    check_invariant_push,
    check_keywords,
    check_mode,
    check_off_policy,
    check_push,
    check_reference_model,
    check_staleness,
    check_temperature,
    check_tool_loop,
    check_vespo_mode,
    dtype_mismatch,
)

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_TRL", "RolloutGRPOTrainer", "RolloutGeneration", "RolloutRows", "check_trl_internals"]

SUPPORTED_TRL = (Version("1.16"), Version("1.17"))  # [low, high)


def check_trl_internals() -> None:
    """Raise RuntimeError unless the installed TRL has what the integration relies on: its version in
    `SUPPORTED_TRL`, and GRPOTrainer's vLLM path calling `vllm_generation.sync_weights()` and
    `vllm_generation.generate(...)` and reading the attributes set here."""
    version = Version(trl.__version__)
    if not SUPPORTED_TRL[0] <= version < SUPPORTED_TRL[1]:
        raise RuntimeError(
            f"trainer_bridge.trl supports trl>={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]}; trl {version} is installed"
        )
    single_turn = inspect.getsource(GRPOTrainer._generate_single_turn)
    generate = inspect.getsource(GRPOTrainer._generate)
    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    expected = [
        (single_turn, "self.vllm_generation.sync_weights()"),
        (single_turn, "self.vllm_generation.generate("),
        (single_turn, "self._last_loaded_step"),
        (single_turn, "logprobs = [[lp[0] for lp in seq] for seq in logprobs]"),
        (generate, "self.rollout_func(prompts, self)"),
        (scoring, "self.use_vllm and self.vllm_importance_sampling_correction"),
        (prepare, "self._generate_and_score_completions(generation_batch)"),
    ]
    for source, needle in expected:
        if needle not in source:
            raise RuntimeError(
                f"TRL {version}'s GRPOTrainer changed: {needle!r} is gone; trainer_bridge.trl needs an update"
            )


class RolloutGRPOTrainer(RoutingReplayMixin, InvariantScoringMixin, GRPOTrainer):
    """`trl.GRPOTrainer` whose generation goes through rollout: a one-line switch from `trl vllm-serve`.

    ```python
    # was: GRPOTrainer(..., use_vllm=True)
    trainer = RolloutGRPOTrainer(
        model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., rollout_workers="tcp://127.0.0.1:5555"
    )
    ```

    "server" mode (the default) samples on rollout workers and pushes the trained weights to them once per
    generation round. "colocate" mode (TRL's `vllm_mode="colocate"` without vLLM) builds a `ColocatedEngine` on
    the model each rank trains (unwrapped from DDP / accelerate) and samples the rank's rows in its own process: no
    worker, no push; the engine reads the parameters as the optimizer left them. In both, the sampled tokens'
    logprobs feed TRL's importance-sampling correction (`sampling/*` metrics) and every token's policy lag is logged
    (`rollout/policy_lag_mean`, `rollout/policy_lag_max`); rewards, advantages, loss, logging and checkpoints are
    TRL's own code.

    Tool-using, multi-turn rollouts: TRL's own `tools=` and `environment_factory=` work unchanged. With
    max_staleness the first turn of tool rows is sent ahead and later turns are generated when TRL asks; with
    environment_factory nothing is sent ahead. partial_rollouts and routing_replay refuse a tool loop. See
    `examples/agent_trl.py`. A loop of your own: pass TRL's `rollout_func=`; it gets the trainer, and
    `trainer.rollout.generate_rows(prompt_ids, **sampling)` samples through the workers (weights are synced before
    each call, as for vLLM). See `examples/multi_turn_rollout.py`.
    """

    def __init__(
        self,
        *args: Any,
        rollout_workers: str | list[str] | RolloutClient | Any = None,
        rollout_mode: str = "server",
        rollout_push_kwargs: dict[str, Any] | None = None,
        rollout_client_kwargs: dict[str, Any] | None = None,
        rollout_engine_config: Any = None,
        sleep_between_rounds: bool | None = None,
        max_staleness: int = 0,
        stale_policy: str = "regenerate",
        partial_rollouts: bool = False,
        max_partial_rounds: int | None = None,
        partial_overprovision: float | None = None,
        routing_replay: bool = False,
        batch_invariant: bool = False,
        **kwargs: Any,
    ):
        """
        Args:
            *args: GRPOTrainer's positional arguments (model, reward_funcs, args, train_dataset, ...).
            rollout_workers: "server" mode: worker address(es), a RolloutClient (then used on every rank of
                this process), or a `rollout.ray.RolloutFleet` (its `client()`, following the fleet's workers).
            rollout_mode: "server" (rollout workers, weights pushed each step) or "colocate" (each rank generates
                in its own process on the model it trains: nothing pushed). Mirrors TRL's `vllm_mode`.
            rollout_push_kwargs: "server": passed to `push_weights` (mode, transport, bucket_bytes, timeout, ...).
            rollout_client_kwargs: "server": passed to `RolloutClient` when addresses (or a fleet) are given.
            rollout_engine_config: "colocate": the engine's ContinuousBatchingConfig (rollout's or transformers');
                None: the defaults, with the KV cache at `GRPOConfig.vllm_gpu_memory_utilization` of free memory on
                CUDA (TRL's default 0.3; on CPU the engine's default).
            sleep_between_rounds: "colocate": free the KV cache after each generation round, so the training step
                has its memory; the next round allocates it again. None: `GRPOConfig.vllm_enable_sleep_mode`.
            max_staleness: "server": generate the next k rounds' rows (read ahead from this trainer's dataloader)
                while training on this one; a sample trained at step s comes from weights of step s - k or newer
                (`trainer_bridge.trl.async_mode`). 0 (default): synchronous, as without it.
            stale_policy: with max_staleness: "regenerate" a too stale group, or keep it ("is_correct": TRL's
                importance-sampling correction weighs it with the behaviour policy's logprobs).
            partial_rollouts: "server": a generation round trains the first complete groups; unfinished ones keep
                generating and join a later round (`trainer_bridge.trl.partial`). Needs max_staleness to cover
                max_partial_rounds - 1 rounds.
            max_partial_rounds: with partial_rollouts, most generation rounds one group may span (default 2).
            partial_overprovision: with partial_rollouts, extra groups in flight as a fraction of a round's, in
                (0, 1] (default 0.5).
            routing_replay: an MoE policy: the rollout records every token's experts and TRL's log-prob forwards
                (old policy, reference, loss) route each token as the rollout did (`trainer_bridge.trl.routes`).
            batch_invariant: the engine ("colocate") or every worker ("server", refused unless each was started with
                `--batch-invariant`) runs `batch_invariant=True`, and TRL's log-probs come from the same invariant
                forward (`trainer_bridge.trl.invariant_logps`), so rollout's and the trainer's log-probs
                agree bit for bit (TRL's importance ratio exactly 1 at the weights that sampled); training steps
                run under `trainer_bridge.batch_invariant`. Text models only.
            **kwargs: GRPOTrainer's keyword arguments (model, reward_funcs, args, train_dataset, processing_class,
                rollout_func, tools, environment_factory, ...). `args.use_vllm` must be False: rollout replaces vLLM.
        Raises:
            ValueError: a setting of the other mode, or a mode or `use_vllm` that cannot be honoured, named.
        """
        check_trl_internals()
        check_keywords(kwargs, RolloutGRPOTrainer.__init__)
        # GRPOTrainer's arguments by name, however they were passed (its `args`, a GRPOConfig, is the third)
        given = inspect.signature(GRPOTrainer.__init__).bind_partial(None, *args, **kwargs).arguments
        config = given.get("args")
        check_batch_invariant(batch_invariant, config)
        self.batch_invariant = batch_invariant
        if isinstance(config, GRPOConfig) and config.use_vllm:
            raise ValueError("RolloutGRPOTrainer replaces vLLM: set GRPOConfig(use_vllm=False)")
        check_temperature(config)
        check_vespo_mode(config)
        check_reference_model(given.get("model"), config, given.get("peft_config"))
        check_mode(
            rollout_mode,
            rollout_workers,
            rollout_push_kwargs,
            rollout_client_kwargs,
            rollout_engine_config,
            sleep_between_rounds,
        )
        check_staleness(max_staleness, stale_policy, rollout_mode, given.get("rollout_func"), rollout_push_kwargs)
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        steps_per_round = 1.0
        if isinstance(config, GRPOConfig):
            steps_per_round = config.steps_per_generation * config.num_iterations / config.gradient_accumulation_steps
        check_partial(partial_rollouts, max_partial_rounds, partial_overprovision, max_staleness, steps_per_round)
        check_off_policy(max_staleness, stale_policy, config, steps_per_round)  # (partial's bound covers a round)
        if partial_rollouts and (rollout_mode != "server" or given.get("rollout_func") is not None):
            raise ValueError("partial_rollouts needs rollout_mode='server' and no rollout_func")
        self.partial_rollouts = partial_rollouts
        self._partial_settings = (
            max_partial_rounds or DEFAULT_MAX_PARTIAL_ROUNDS,
            partial_overprovision or DEFAULT_OVERPROVISION,
        )
        super().__init__(*args, **kwargs)
        check_tool_loop(self, partial_rollouts, max_staleness)
        self.routing_replay = check_routing_replay(self, routing_replay)  # before a client connects
        self.rollout_mode = rollout_mode
        self.rollout_client: RolloutClient | None = None
        self._owns_rollout_client = False  # a client it connected itself (not one passed as rollout_workers)
        if rollout_mode == "colocate":
            from trainer_bridge.trl.colocated_mode import colocated_generation

            self.rollout: RolloutGeneration = colocated_generation(
                self, rollout_engine_config, sleep_between_rounds, batch_invariant
            )
        else:
            check_push(self.model, rollout_push_kwargs, self.accelerator)  # before a client connects
            if batch_invariant:
                check_invariant_push(self.model, rollout_push_kwargs, self.accelerator)
            try:
                self.rollout = server_generation(self, rollout_workers, rollout_push_kwargs, rollout_client_kwargs)
            except BaseException:  # a client the trainer made is the trainer's to close (its I/O thread, sockets)
                if self.rollout_client is not None and self.rollout_client is not rollout_workers:
                    self.rollout_client.close()
                raise
            self.rollout.devices, self.rollout.dtypes = (set(values) for values in self._worker_placement)
            mismatch = dtype_mismatch(self)
            if mismatch is not None and self.accelerator.is_main_process:
                logger.warning(mismatch)
        # Route TRL through its vLLM code path (its server-mode branch: each rank calls generate for its own rows),
        # with rollout as the backend.
        self.use_vllm = True
        self.vllm_mode = "server"
        self.vllm_generation = self.rollout
        self._last_loaded_step = -1
        if self.routing_replay:
            self.rollout.sampling["return_routes"] = True

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`GRPOTrainer.train`, syncing at its first generation round even when the step count starts where an
        earlier `train()` left off it (TRL syncs only when the step changed: a second run would sample, or push,
        nothing new). When it returns or raises, what was sent ahead (max_staleness) is cancelled, and a colocated
        engine's KV cache and graphs are freed (the next round allocates them again); when it raises, the metrics
        gathered for the step that failed are dropped (a next `train()` would average them into its first step's)."""
        if self.max_staleness and (kwargs.get("resume_from_checkpoint") or (args and args[0])):
            raise ValueError("resuming from a checkpoint with max_staleness > 0 is not supported yet")
        self._last_loaded_step = -1
        try:
            return super().train(*args, **kwargs)
        except BaseException:  # the step that failed logged nothing: its metrics must not reach the next train()'s
            for metrics in self._metrics.values():
                metrics.clear()
            raise
        finally:
            try:
                self.close_routing_replay()
            finally:  # what was sent ahead is cancelled, the colocated engine's memory freed, whatever happened
                if hasattr(self.rollout, "close"):
                    self.rollout.close()

    def close(self) -> None:
        """Release what the trainer made for generation, in any mode: the `RolloutClient` it connected (its I/O thread
        and sockets; a client passed in as `rollout_workers` stays its caller's to close), or its colocated engine
        (KV cache, graphs, for good). Call it when done with the trainer; calling it again does nothing."""
        if hasattr(self.rollout, "close"):
            self.rollout.close()
        engine = getattr(self.rollout, "engine", None)
        if engine is not None and not engine.closed:
            engine.close()
        if self.rollout_client is not None and self._owns_rollout_client:
            self.rollout_client.close()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's training step; with batch_invariant, under `trainer_bridge.batch_invariant`, so that gradient
        checkpointing's recompute in the backward runs the forward the loss saw."""
        if not self.batch_invariant:
            return super().training_step(*args, **kwargs)
        with batch_invariant_forward(self.accelerator.unwrap_model(self.model)):
            return super().training_step(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's; with batch_invariant, TRL's old-policy forward skipped where the sampled round's log-probs are its
        values (`old_logps`), and otherwise the engine's expression on an invariant forward (`invariant_logps`),
        routed as the rollout routed with routing_replay (`routes`)."""
        if self.batch_invariant:
            recorded = recorded_old_logps(self, *args, **kwargs)
            if recorded is not None:
                return recorded, None, None
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        """TRL's, on the rows the partial rollout round hands it when partial_rollouts is on (training only)."""
        if self.partial_rollouts and self.model.training:
            inputs = self.rollout.take_round(inputs)
        return super()._generate_and_score_completions(inputs)

    def get_train_dataloader(self) -> Any:
        """TRL's train dataloader; with max_staleness, read ahead by the generation (same batches, same order)."""
        loader = super().get_train_dataloader()
        if not self.max_staleness:
            return loader
        from trainer_bridge.trl.async_mode import LookaheadLoader

        return LookaheadLoader(loader, self.rollout.start_epoch)
