"""The hooks of LoRA layers served unmerged (see `lora.AdapterTable` for the layout): what the hooks of one table
share in a step (`LoraStepState`: whether they act, each token's slot, the slot mask, which tokens the output head's
rows are) and one LoRA Linear's stacked weights and hook (`LoraLayer`).

With `batch_invariant` the hook computes each served slot's tokens apart, as peft computes an adapter's rows under
`trainer_bridge.batch_invariant`: `A` and `B` of the adapter's own rank (a stacked product over every slot's columns
would add other slots' zeros into the sum, in another order), each product in `rollout.invariant`'s row-invariant
matmuls, then scaled and added to the base output in fp32 and rounded once, bit for bit the trainer's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.engine.lora.adapter_weights import LoraModule
from rollout.invariant.matmul import invariant_linear

# LoRA runs in fp32 whatever the model's dtype, as peft runs it by default (`autocast_adapter_dtype=True` keeps
# adapter weights in fp32 under a bf16 base); bf16 / fp16 adapters are widened losslessly.
LORA_DTYPE = torch.float32
ADAPTER_DTYPES = {"float32", "bfloat16", "float16"}


def layer_bytes(linear: torch.nn.Linear, num_slots: int, max_rank: int) -> int:
    """Bytes of one `LoraLayer`'s stacked weights over `linear`: A (slots * rank, in) and B (out, slots * rank)."""
    return num_slots * max_rank * (linear.in_features + linear.out_features) * LORA_DTYPE.itemsize


class LoraStepState:
    """What the hooks of one table share during a step: whether they act, and each token's slot."""

    def __init__(
        self, num_slots: int, max_rank: int, max_tokens: int, device: torch.device, batch_invariant: bool = False
    ):
        self.active = False
        self.num_slots = num_slots  # also the base model's slot
        self.batch_invariant = batch_invariant  # each slot's tokens computed apart, as the trainer (module docstring)
        self.linear = invariant_linear if batch_invariant else F.linear  # what saved Linear copies compute with
        self._rows: dict[int, torch.Tensor] | None = None  # batch_invariant: each served slot's token rows
        # Each token's slot: allocated at the first step that serves an adapter (an engine that never serves one holds
        # no per-token buffer), `max_tokens` long, grown past it if a step ever needs more.
        self.max_tokens = max_tokens
        self.token_slots = torch.empty(0, dtype=torch.long, device=device)
        # Column c of the stacked A belongs to slot c // max_rank.
        self.columns = torch.arange(num_slots * max_rank, device=device) // max_rank
        self._mask: torch.Tensor | None = None
        self._num_tokens: int | None = None  # rows of the forward's hooked modules (the first one sets it)
        # The packed token of each row the output head computes (None: its rows are the step's tokens): the forward
        # keeps only the rows it samples (`logits_to_keep`), and prompt scoring sends slices of rows through it.
        self.head_rows: torch.Tensor | None = None

    def new_forward(self, head_rows: torch.Tensor | None = None) -> None:
        """Forget the previous forward's mask and row count (the first hook of a forward sets them).

        Args:
            head_rows: the packed token of each row the forward's output head computes (None: every token).
        """
        self._mask = None
        self._rows = None
        self._num_tokens = None
        self.head_rows = head_rows

    def slots_for(self, num_tokens: int, module: str) -> torch.Tensor:
        """Each token's slot (T,) for a hooked module whose input or output has T rows, the step's tokens.

        Raises:
            RuntimeError: a module that sees another number of rows than the forward's other hooked modules (an MoE
                expert's share of the tokens).
        """
        if self._num_tokens is None:
            self._num_tokens = num_tokens
        elif num_tokens != self._num_tokens:
            raise RuntimeError(
                f"adapter on {module}: it sees {num_tokens} rows, the step {self._num_tokens} tokens (a module "
                "that sees part of the tokens, e.g. an MoE expert, cannot be served unmerged)"
            )
        return self.token_slots[:num_tokens]

    def head_slots(self, num_rows: int) -> torch.Tensor:
        """Each row's slot (R,) for the output head's R rows (`head_rows`, set by whoever calls the head).

        Raises:
            RuntimeError: R differs from the rows the head was said to compute.
        """
        rows = self.head_rows
        if rows is None:
            return self.slots_for(num_rows, "the output head")
        if rows.numel() != num_rows:
            raise RuntimeError(f"the output head computes {num_rows} rows, its caller announced {rows.numel()}")
        return self.token_slots.index_select(0, rows)

    def mask_for(self, x: torch.Tensor, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(boolean mask (T, slots * rank), token slots (T,)) for a LoRA layer's input of T tokens: True where a
        column belongs to the token's slot.

        Raises:
            RuntimeError: as `slots_for`.
        """
        slots = self.slots_for(x.shape[-2], module)
        if self._mask is None:
            self._mask = self.columns.unsqueeze(0) == slots.unsqueeze(1)
        return self._mask, slots

    def rows_by_slot(self, num_tokens: int, module: str) -> dict[int, torch.Tensor]:
        """The token rows (indices) of each adapter slot that has tokens in the forward, base tokens left out (read
        from the device once per forward: the batch-invariant path only, which captures no graphs).

        Raises:
            RuntimeError: as `slots_for`.
        """
        slots = self.slots_for(num_tokens, module)
        if self._rows is None:
            adapter_slots = [slot for slot in slots.unique().tolist() if slot != self.num_slots]  # not the base's
            self._rows = {slot: (slots == slot).nonzero().squeeze(1) for slot in adapter_slots}
        return self._rows


class LoraLayer:
    """The stacked LoRA weights of one base Linear and its forward hook."""

    def __init__(self, name: str, module: torch.nn.Linear, state: LoraStepState, num_slots: int, max_rank: int):
        device = module.weight.device
        columns = num_slots * max_rank
        self.name = name
        self.max_rank = max_rank
        self.lora_A = torch.zeros(columns, module.in_features, dtype=LORA_DTYPE, device=device)
        self.lora_B = torch.zeros(module.out_features, columns, dtype=LORA_DTYPE, device=device)
        self.scalings = torch.zeros(num_slots + 1, dtype=torch.float32, device=device)  # the last: base
        self.ranks = [0] * num_slots  # each slot's adapter's rank here (0: it does not target this layer)
        self.state = state
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        state = self.state
        if not state.active:
            return None
        x = args[0].to(LORA_DTYPE)
        if state.batch_invariant:
            return self._each_slot_apart(x, output)
        mask, slots = state.mask_for(x, self.name)
        # Other slots' columns are left out by selection, not multiplied by 0: an Inf or NaN one adapter's A makes of
        # an input never reaches another slot's tokens (0 * Inf = NaN); every served B is finite (lora_bounds.py).
        delta = F.linear(torch.where(mask, F.linear(x, self.lora_A), 0.0), self.lora_B)
        # As peft with fp32 adapter weights: the fp32 product times the scaling, added to the base output in fp32,
        # rounded once to the model's dtype.
        return (output + delta * self.scalings.index_select(0, slots).unsqueeze(-1)).to(output.dtype)

    def _each_slot_apart(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The batch-invariant forward (module docstring): each slot's rows as peft's
        `result + lora_B(lora_A(x)) * scaling`, rounded once to the output's dtype."""
        rows_of = self.state.rows_by_slot(x.shape[-2], self.name)
        if not rows_of:
            return output
        x = x.reshape(-1, x.shape[-1])
        flat = output.reshape(-1, output.shape[-1]).clone()
        for slot, rows in rows_of.items():
            rank = self.ranks[slot]
            if rank == 0:  # the adapter does not target this layer
                continue
            columns = slice(slot * self.max_rank, slot * self.max_rank + rank)
            a = invariant_linear(x.index_select(0, rows), self.lora_A[columns])
            delta = invariant_linear(a, self.lora_B[:, columns].contiguous())
            flat[rows] = (flat[rows] + delta * self.scalings[slot]).to(flat.dtype)
        return flat.view(output.shape)

    def write(self, slot: int, pair: LoraModule | None) -> None:
        """Put an adapter's pair (None: nothing) into `slot`, zeroing what it leaves."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.lora_A[rows].zero_()
        self.lora_B[:, rows].zero_()
        if pair is None:
            self.scalings[slot] = 0.0
            self.ranks[slot] = 0
            return
        rank = self.ranks[slot] = pair.rank
        self.lora_A[rows][:rank].copy_(pair.lora_A)
        self.lora_B[:, rows][:, :rank].copy_(pair.lora_B)
        self.scalings[slot] = pair.scaling
