"""Colocated rollouts: `ColocatedEngine`, the continuous-batching engine inside the trainer's process, on the
trainer's own model."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from rollout.config import FieldError
from rollout.engine.engine import Engine
from rollout.engine.progress import SampleProgress
from rollout.protocol.group_folding import GroupInFlight
from rollout.protocol.reply_frames import unpack_message
from trainer_bridge.client.calls import GroupResult, PromptGroup, as_integer
from trainer_bridge.colocated_groups import prepare_requests
from trainer_bridge.colocated_model import fsdp2_unsharded, parameter_storage, peft_merged
from trainer_bridge.gathering import gathered

__all__ = ["ColocatedEngine"]


class ColocatedEngine:
    """The continuous-batching engine inside the trainer's process, on the trainer's own model.

    ```python
    config = ContinuousBatchingConfig(max_batch_tokens=2048)
    engine = ColocatedEngine(model, continuous_batching_config=config)
    for step in range(num_steps):
        results = engine.generate(groups, policy_version=step)  # sampled with the weights as they are now
        engine.sleep()  # the KV cache's memory is the optimizer's during the training step
        loss(results).backward(); optimizer.step(); optimizer.zero_grad()
    engine.close()
    ```

    The engine shares the model's parameters: nothing is copied and nothing is pushed, so an optimizer step (in place,
    as torch's optimizers do it) is what the next round samples with. A round is one `generate` call: the model is the
    engine's for its length (eval mode, rollout's paged attention, inference mode) and exactly what the trainer had is
    back afterwards (training mode and attention implementation; gradient checkpointing and `use_cache` are never
    touched). Under DeepSpeed ZeRO-3 and FSDP2 the parameters are gathered once for the whole round, not once per decode
    step (every rank must run its rounds at the same points, as it runs its training steps); a PEFT model samples with
    its adapters active, its weights untouched.

    `generate` takes and returns what `RolloutClient.generate_many` does (`PromptGroup`s in, `GroupResult`s out, every
    completion with its logprobs and per-token policy versions), assembled by the worker's own code, so the same trainer
    code runs against a worker fleet or colocated. `sleep()` frees the KV cache (the decode CUDA graphs are kept, and
    captured again only if the cache or the parameters moved; `sleep(graphs=True)` frees them too); the next
    `generate` wakes it (`wake()` does it ahead of time).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        continuous_batching_config: Any = None,
        generation_config: Any = None,
        *,
        policy_version: int = 0,
        round_context: Callable[[], AbstractContextManager] | None = None,
        peft_merge: bool = False,
        tokenizer: Any = None,
    ):
        """
        Args:
            model: the trainer's causal LM (or PEFT model), unwrapped (not the DDP / accelerate wrapper); its
                parameters are used where they are, never copied.
            continuous_batching_config: engine settings (rollout's or transformers' ContinuousBatchingConfig, see
                `rollout.Engine`); None: the defaults, whose KV cache takes 90% of free GPU memory: on the
                trainer's GPU, set `max_memory_percent` or `num_blocks` to leave the training step its memory.
            generation_config: default sampling settings (a `transformers.GenerationConfig`), as for `Engine`.
            policy_version: the version of the weights now (e.g. the trainer's global step).
            round_context: makes a context manager entered around each round, in place of the default (ZeRO-3
                parameters gathered for the round): the TRL integration passes TRL's own
                `unwrap_model_for_generation`, which also lifts DeepSpeed's per-module hooks for the round.
            peft_merge: a PEFT model's adapters merged into its base weights for each round (faster decoding), the
                base weights copied back bit for bit afterwards (merge/unmerge arithmetic alone is not exact); costs
                a copy of the adapted base weights during the round. False: the adapters run as they are.
            tokenizer: the model's tokenizer, for stop strings (`SamplingParams.stop`); None refuses them.
        Raises:
            FieldError: a model the engine cannot serve or a config it cannot honour, named (the KV cache that
                does not fit memory too), peft_merge with batch_invariant, a peft_merge that is not a bool or a
                round_context that is not callable, before any training step.
        """
        self.model = model
        # Held by the thread whose round (or sleep, wake, close) uses the engine: one thread at a time, the others are
        # refused by name (an engine is single-threaded: two rounds stepping it at once mix their requests' outputs).
        self._busy = threading.RLock()
        self._round_context = round_context
        self._peft_merge = peft_merge
        # Checked now: a bad one would otherwise fail (or be taken as truthy) only at the first round, after setup.
        if round_context is not None and not callable(round_context):
            raise FieldError("round_context", f"must be None or a callable, got {type(round_context).__name__}")
        if not isinstance(peft_merge, bool):
            raise FieldError("peft_merge", f"must be a bool, got {peft_merge!r}")
        if peft_merge and getattr(continuous_batching_config, "batch_invariant", False):
            raise FieldError(
                "peft_merge",
                "cannot be True with batch_invariant: merged weights compute other bits than the trainer's",
            )
        self.engine = Engine(model, continuous_batching_config, generation_config, tokenizer)
        self.engine.runner.suspend()  # between rounds the model is the trainer's
        self._closed = False
        self._storage = parameter_storage(model)
        self._cache_address = self.engine.kv_cache.kv.data_ptr()  # where the graphs read the cache
        self.graph_releases = 0  # times captured graphs were dropped (parameters or cache moved)
        self._group_ids = itertools.count()
        self.num_rounds = 0
        try:
            self.set_policy_version(policy_version)
        except BaseException:
            self.close()  # nothing of a failed construction stays on the trainer's model (hooks, the fp32 copy)
            raise

    # ---- state ------------------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The version that tags the tokens of the next round."""
        return self.engine.policy_version

    def set_policy_version(self, version: int) -> None:
        """Tag what is sampled from now on with `version` (the weights changed in place: e.g. the global step).

        Raises:
            FieldError: ("policy_version") not an integer, or below the current version (versions never go back),
                or past int64.
        """
        self._check_open()
        if as_integer(version) is None:  # numpy / torch integers too; never a bool
            raise FieldError("policy_version", f"must be an integer, got {version!r}")
        version = as_integer(version)
        if version == self.policy_version:
            return
        current = self.policy_version
        with self._exclusive("set_policy_version"):
            try:
                self.engine.update_weights({}, version=version, mode="keep", partial=True)
            except FieldError as error:  # the same version is kept: what is refused is one below it
                reason = error.reason.replace(f"above the current {current}", f"at least the current {current}")
                raise FieldError("policy_version", reason) from None

    @property
    def is_sleeping(self) -> bool:
        """True between `sleep()` and the next `wake()` (or `generate`)."""
        return self.engine.kv_cache.is_released

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds on its device now (0 while sleeping)."""
        return self.engine.kv_cache.nbytes

    def sleep(self, graphs: bool = False) -> None:
        """Free the KV cache and the sampler's graphs until the next round (their memory goes back to torch's
        allocator, for the training step to use). The decode CUDA graphs are kept (they read the cache and the
        parameters where they were: if either moved by the next round, they are captured again then). Idempotent.

        Args:
            graphs: free the decode CUDA graphs (and speculative decoding's verify graphs) and their memory pools
                too (each is captured again when its batch size next comes): for a long pause, such as the end of a
                training run.
        """
        self._check_open()
        with self._exclusive("sleep"):
            self.engine.block_manager.reset_prefix_cache()  # cached prefixes point into the cache being freed
            if not self.engine.kv_cache.is_released:
                self._cache_address = self.engine.kv_cache.kv.data_ptr()
            self.engine.kv_cache.release()
            self.engine.sampler.release_graphs()  # captured again when sampling resumes: cheap, and memory for training
            if graphs:
                self._release_graphs()

    def wake(self) -> None:
        """Allocate the KV cache again (zeroed); when it lands elsewhere than before, the graphs are captured again
        as their batch sizes come. Idempotent."""
        self._check_open()
        with self._exclusive("wake"):
            if self.engine.kv_cache.is_released:
                self.engine.kv_cache.restore()
                if self.engine.kv_cache.kv.data_ptr() != self._cache_address:
                    self._release_graphs()

    def _release_graphs(self) -> None:
        # Every graph of the runner: speculative decoding's verify graphs read the cache and the parameters too.
        graphs = self.engine.runner.graphs.every()
        if any(each.captured for each in graphs):
            self.graph_releases += 1
        for each in graphs:
            each.release()

    @property
    def graph_capture_s(self) -> float:
        """Seconds spent capturing decode CUDA graphs so far (each round's share is what keeping them saves)."""
        graphs = self.engine.runner.decode_graphs
        return 0.0 if graphs is None else graphs.capture_s

    @property
    def closed(self) -> bool:
        """True once `close()` ran."""
        return self._closed

    def close(self) -> None:
        """Free the engine (KV cache, graphs, the fp32 projection hook). The model stays the caller's. Idempotent."""
        if not self._closed:
            with self._exclusive("close"):
                self._closed = True
                self.engine.close()

    def __enter__(self) -> ColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- a round ----------------------------------------------------------------------------------------------
    def generate(
        self,
        groups: Iterable[PromptGroup],
        *,
        policy_version: int | None = None,
        progress_bar: bool = False,
    ) -> list[GroupResult]:
        """Sample every group with the model's weights as they are now; one round.

        Args:
            groups: `PromptGroup`s (prompt ids, `n`, a `SamplingParams` or a dict of its fields, optional group id).
            policy_version: set the version first (`set_policy_version`); None keeps the current one.
            progress_bar: show a tqdm bar of finished samples, with the tokens generated so far and their rate.
        Returns:
            One `GroupResult` per group, in order; completions in sample order, each with its logprobs and
                run-length encoded policy versions. A completion the engine ended with an error says so in its
                `finish_reason` and `error`, as from a worker.
        Raises:
            FieldError: a bad group (named, with its position); nothing was generated. What a worker refuses is
                refused here by the worker's field names: e.g. "groups[i].sampling.top_p", an `adapter` this engine
                does not serve ("groups[i].adapter").
            RuntimeError: the engine is closed, or another thread's round uses it now (one thread at a time).
        """
        self._check_open()
        if isinstance(groups, PromptGroup):
            raise FieldError("groups", "expected a list of PromptGroup, got one PromptGroup (wrap it in a list)")
        with self._exclusive("generate"):
            return self._generate(list(groups), policy_version, progress_bar)

    def _generate(self, groups: list[PromptGroup], policy_version: int | None, progress_bar: bool) -> list[GroupResult]:
        """`generate`'s round, on the thread that holds the engine."""
        requests = prepare_requests(self.engine, self.model, groups, self._group_ids)  # nothing queued yet
        if policy_version is not None:
            self.set_policy_version(policy_version)
        if self.is_sleeping:
            self.wake()
        in_flight = {r.group_id: GroupInFlight(b"", r.group_id, r.prompt_ids, r.num_forks + 1, False) for r in requests}
        samples = sum(r.num_forks + 1 for r in requests)
        results: dict[str, GroupResult] = {}
        with self._round(), SampleProgress(self.engine.counters, samples, progress_bar) as progress:
            for request in requests:
                self.engine.submit(request)
            while self.engine.has_unfinished():
                outputs = self.engine.step()
                for output in outputs:
                    _, result = in_flight[output.group_id].absorb(output, self.engine.policy_version)
                    if result is not None:
                        unpack_message(result, result.data_frames)  # MoE routes: arrays, as a client gets them
                        results[result.group_id] = GroupResult(result.group_id, result.prompt_ids, result.completions)
                progress.after_step(sum(output.is_finished for output in outputs))
        self.num_rounds += 1
        return [results[request.group_id] for request in requests]

    @contextlib.contextmanager
    def _round(self) -> Iterator[None]:
        """The model is the engine's for a round: parameters gathered (ZeRO-3) once, paged attention, eval mode;
        afterwards everything is the trainer's again, even when the round failed."""
        context = self._round_context() if self._round_context else gathered(list(self.model.parameters()))
        merged = peft_merged(self.model) if self._peft_merge else contextlib.nullcontext()
        with context, fsdp2_unsharded(self.model), merged:
            storage = parameter_storage(self.model)
            if storage != self._storage:  # parameters moved (a gather, a reload): graphs read the old ones
                self._storage = storage
                self._release_graphs()
            self.engine.block_manager.reset_prefix_cache()  # the weights changed in place since the last round
            self.engine.runner.resume()
            try:
                yield
            finally:
                try:
                    self.engine.flush()
                    for group_id in self.engine.open_group_ids():
                        self.engine.cancel(group_id)  # a round that failed leaves nothing queued
                finally:
                    self.engine.runner.suspend()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ColocatedEngine is closed")

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """The engine is this thread's for the block (re-entrant: a round sets the version and wakes the cache).

        Raises:
            RuntimeError: another thread's round (or sleep, wake, close) uses the engine now.
        """
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"ColocatedEngine.{what}: another thread's round (generate, sleep, wake or close) uses the engine now; "
                "a ColocatedEngine serves one thread at a time"
            )
        try:
            self._check_open()
            yield
        finally:
            self._busy.release()
