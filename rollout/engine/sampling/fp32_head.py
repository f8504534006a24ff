"""`fp32_logits`: the output projection computed in fp32 inside the engine's steps, for a bf16/fp16 model (what TRL's
`cast_lm_head_to_fp32` does in the trainer), through a forward hook on the model's output head; and for an fp32 head
under a trainer's mixed-precision autocast (a colocated round), outside the autocast, as TRL scores it.

The head's weight is converted to fp32 once and kept: converting it at every step writes the whole fp32
weight each time (622 MB for Qwen3-0.6B's head), more than a decode step's own reads. The copy is refreshed in place
(so CUDA graphs captured against it stay valid) at every point where the engine knows the weights may have changed:
a weight update, a colocated round, a kept engine's next call, the end of a manager's pause, `Engine.weights_changed()`,
and a change that torch's version counter or the weight's storage shows. Writes neither shows (a fused optimizer's
step, `param.data.copy_`) on a model an `Engine` is serving directly need `engine.weights_changed()`.
"""

from __future__ import annotations

import torch

from rollout.invariant.matmul import invariant_linear


def projection_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose product the fp32 head computes: the model's output embeddings, or where peft wraps them (a
    LoRA on the head, its layer's `get_base_layer()`) the base layer inside, so that peft adds the adapter's delta
    over the fp32 product as it adds it over the base's. (Hooked on the wrapper, the product would replace the whole
    output: the adapter would be left out.)

    Args:
        model: the served model.
    """
    head = model.get_output_embeddings()
    base_layer = getattr(head, "get_base_layer", None)
    return base_layer() if callable(base_layer) else head


def fp32_projection(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on the output projection: the same product in fp32, converting the weight now (what follows,
    e.g. Gemma 2's final logit soft-capping, then runs in fp32 too): the trainer's side, as references compute it
    (`rollout.benchmarks.throughput.fidelity`)."""
    bias = None if module.bias is None else module.bias.float()
    return torch.nn.functional.linear(inputs[0].float(), module.weight.float(), bias)


class Fp32Head:
    """The fp32 projection hook of one engine: active only inside the engine's own forwards (other users of the
    model, a trainer's forward say, are left alone)."""

    def __init__(self, head: torch.nn.Module, batch_invariant: bool = False):
        """
        Args:
            head: the model's output embeddings (a Linear-like module with `weight` and `bias`).
            batch_invariant: compute the product as `invariant_linear`, as a trainer's fp32 head (an `F.linear`)
                computes under `trainer_bridge.batch_invariant`: the engine's forward runs no `InvariantLinearMode`
                once its first forward found every `nn.Linear` swapped, so a plain `F.linear` here would not be.
        """
        self.active = False
        self.linear = invariant_linear if batch_invariant else torch.nn.functional.linear
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._seen: tuple[int, int] | None = None  # (storage address, version) of the weight last copied
        self.refresh(head)
        # The hook holds this object, not the engine's runner: no cycle through the runner, the cache or the graphs.
        self._hook = head.register_forward_hook(self._project)

    def refresh(self, head: torch.nn.Module) -> None:
        """Copy the head's current weight (and bias) into the fp32 copy, in place when the shape still fits; an fp32
        head is read as it is (no copy)."""
        if head.weight.dtype == torch.float32:
            self.weight = self.bias = None
            self._seen = (head.weight.data_ptr(), head.weight._version)
            return
        # Inference mode both times: a copy made under it (an engine built inside a trainer's inference_mode) is an
        # inference tensor, which only inference mode may update in place; the hook reads it inside a step.
        with torch.inference_mode():
            weight = head.weight.detach()
            if self.weight is None or self.weight.shape != weight.shape or self.weight.device != weight.device:
                self.weight = weight.float()  # a new tensor: only at construction or after the head was replaced
            else:
                self.weight.copy_(weight)
            bias = getattr(head, "bias", None)
            if bias is None or self.bias is None or self.bias.shape != bias.shape or self.bias.device != bias.device:
                self.bias = None if bias is None else bias.detach().float()
            else:
                self.bias.copy_(bias.detach())
        self._seen = (weight.data_ptr(), weight._version)

    def refresh_if_changed(self, head: torch.nn.Module) -> None:
        """Refresh when the weight's storage or torch's version counter moved since the last copy (host-only
        checks: nothing waits for the device)."""
        if self._seen != (head.weight.data_ptr(), head.weight._version):
            self.refresh(head)

    def _project(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not self.active:
            return None
        device, weight, bias = inputs[0].device.type, self.weight, self.bias
        if weight is None:  # an fp32 head: its own product is fp32 unless a trainer's autocast lowered it
            if not torch.is_autocast_enabled(device):
                return None
            weight, bias = module.weight, module.bias
        with torch.autocast(device, enabled=False):  # a trainer's mixed precision would compute it in bf16
            return self.linear(inputs[0].float(), weight, bias)

    def close(self) -> None:
        """Remove the hook and free the fp32 copy. Idempotent."""
        self._hook.remove()
        self.weight = self.bias = None
