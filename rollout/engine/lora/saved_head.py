"""The output head as a module an adapter trains whole (peft's `modules_to_save` on `lm_head`, whatever the model
names its output embeddings; with tied embeddings too): the tokens of an adapter that saves it get logits from the
adapter's copy of the head, the others from the base head, as peft's `ModulesToSaveWrapper` computes them in a mixed
batch.

The head differs from the other saved modules (`saved_modules.py`) in two ways:
- Its rows are not the step's tokens: the forward keeps only the rows it samples (`logits_to_keep`), and prompt
  log-probs send slices of rows through it. Whoever calls the head says which packed token each row is
  (`LoraStepState.head_rows`); each row takes its token's slot.
- With `fp32_logits` on a bf16/fp16 model the engine computes the base head in fp32 (`fp32_head.py`); an adapter's
  copy is then held in fp32 and its rows computed in fp32 the same way (`linear(x.float(), W, b)`), so a copy pushed
  in fp32 (a trainer that casts its head to fp32, as TRL's `cast_lm_head_to_fp32`) is served unrounded. Wherever
  the base rows are fp32 (an fp32 model's fp32 head under a trainer's bf16 autocast too), the copies' rows are
  computed in fp32 outside that autocast, as the fp32 head computes the base's.

Invariant: this hook runs after the fp32 head's (that one is registered when the model runner is built, this one at
the first load of an adapter saving the head), so the base rows it keeps are already the engine's fp32 logits.
"""

from __future__ import annotations

import contextlib

import torch

from rollout.engine.lora.layers import LoraStepState


class SavedHead:
    """The output head's hook and, per slot that saves the head, a shadow of the head's Linear holding the slot's
    copy (`saved_modules.SavedModules` allocates and writes the shadows)."""

    def __init__(self, name: str, head: torch.nn.Module, linear: torch.nn.Linear, state: LoraStepState, fp32: bool):
        """
        Args:
            name: the head's module name.
            head: the model's output embeddings (the module the engine's fp32 hook is on; a peft wrapper of the
                Linear in a peft-injected model).
            linear: the head's Linear (the module the shadows copy).
            state: the table's `LoraStepState` (whether the hook acts, each row's slot).
            fp32: the engine computes the head in fp32 (`fp32_logits` on a bf16/fp16 model).
        """
        self.name = name
        self.source = linear
        self.state = state
        self.fp32 = fp32
        # The shadows' dtype: fp32 where the engine computes the head in fp32, else the base head's (None).
        self.dtype = torch.float32 if fp32 else None
        self.shadows: dict[int, torch.nn.Module] = {}
        self.handle = head.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not self.state.active or not self.shadows:
            return None
        x = args[0]
        rows = output.numel() // output.shape[-1]  # (..., vocab): the head computed `rows` rows
        slots = self.state.head_slots(rows).view(*output.shape[:-1], 1)
        # An fp32 base product (the fp32 head's, outside a trainer's autocast too): the copies' rows are computed
        # in fp32 the same way, not lowered by that autocast.
        fp32 = self.fp32 or output.dtype == torch.float32
        for slot, shadow in self.shadows.items():
            # Every row, the same shapes at every step (decode graphs capture it); rows of other slots are left out
            # by selection, so a copy's Inf or NaN never reaches them.
            # The Linear's computation over the copy (row-invariant with batch_invariant), in fp32 or the model's
            # dtype (peft's).
            with torch.autocast(x.device.type, enabled=False) if fp32 else contextlib.nullcontext():
                theirs = self.state.linear(x.float() if fp32 else x, shadow.weight, shadow.bias)
            output = torch.where(slots == slot, theirs.to(output.dtype), output)
        return output
