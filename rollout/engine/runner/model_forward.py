"""The model call of one step (`ModelForward`): packed input ids and positions with the paged attention metadata in,
logits of the kept rows out. The model runner calls it eagerly, and the decode graphs capture it."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

from rollout.engine.attention.paged import engine_forward
from rollout.engine.attention.paged_metadata import PagedAttentionMetadata
from rollout.engine.lora.adapter_table import AdapterTable
from rollout.invariant.mode import InvariantLinearMode
from rollout.invariant.swaps import mode_need_of, swapped_forwards


class ModelForward:
    """The model call of a step: packed input ids and positions, the paged metadata, the rows to keep -> logits
    (in the model's dtype) at the packed positions `keep`."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        adapters: AdapterTable | None = None,
        batch_invariant: bool = False,
    ):
        """
        Args:
            model: the transformers causal LM, already switched to paged attention by its runner.
            device: where its parameters live.
            adapters: the runner's LoRA adapters (told when a forward begins, also inside a graph capture).
            batch_invariant: run every linear as `rollout.invariant`'s row-invariant matmuls (the attention's half
                is the metadata's `batch_invariant`): `nn.Linear` modules swapped, and the `InvariantLinearMode`
                for what a swap cannot see, while the first forward shows it is needed (`swaps.py`).
        """
        self.model = model
        self.batch_invariant = batch_invariant
        self.mode_need = mode_need_of(model)
        self.adapters = adapters
        self.logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # A ready-made 4D mask makes transformers' mask builders return at once: the paged path builds its own.
        self.no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata, keep: torch.Tensor
    ) -> torch.Tensor:
        kwargs = {"logits_to_keep": keep} if self.logits_to_keep else {}
        if self.adapters is not None:  # the head computes the rows kept, or every token's
            self.adapters.new_forward(keep if self.logits_to_keep else None)
        with engine_forward(), self._invariance():
            logits = self.model(
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=self.no_mask,
                use_cache=False,
                rollout_metadata=metadata,
                **kwargs,
            ).logits[0]
        return logits if self.logits_to_keep else logits[keep]

    @contextlib.contextmanager
    def _invariance(self) -> Iterator[None]:
        """The batch-invariant linears around one forward (nothing when the mode is off)."""
        if not self.batch_invariant:
            yield
            return
        with swapped_forwards(self.model):
            if self.mode_need.needed(self.model) is False:
                yield
                return
            with InvariantLinearMode() as mode:
                yield
            self.mode_need.learn(mode, self.model)  # not reached by a forward that raised
