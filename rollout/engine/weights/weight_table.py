"""The model's weights as a weight update sees them: every state_dict name it may target (parameters, tied aliases,
persistent buffers), checked by name, dtype and shape before any byte is applied, and copied in place, so the
model's tensors (and CUDA graphs captured against them) stay valid."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.config import MAX_POLICY_VERSION, WEIGHT_UPDATE_MODES, FieldError, _is_int, dtype_name
from rollout.engine.requests.outputs import GenerationOutput


@dataclass
class WeightUpdateResult:
    """What `Engine.update_weights` did.

    Attributes:
        version: the policy version now served.
        mode: the commit mode used.
        pause_ms: how long the engine stood still (validation, copy and mode handling).
        copy_ms: of which copying the tensors into the model.
        drain_ms: for mode "wait", how long in-flight samples ran before the update (admission was paused).
        aborted: samples ended with finish_reason "abort" (mode "abort").
        recomputed: samples whose KV is recomputed under the new weights.
        base_unchanged: an adapter update's base weights were those served, bit for bit (not copied: another trainer
            of the same checkpoint, say); the adapters served beside it are untouched.
        outputs: the outputs of the step that was in flight, then the final outputs of the aborted samples (the
            caller delivers them).
    """

    version: int
    mode: str
    pause_ms: float
    copy_ms: float
    drain_ms: float = 0.0
    aborted: int = 0
    recomputed: int = 0
    base_unchanged: bool = False
    outputs: list[GenerationOutput] = field(default_factory=list, repr=False)


# An integer dtype of each float width: a float tensor viewed as one compares bit for bit.
_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class WeightTable:
    """Every name of one model's state_dict a weight update may target."""

    def __init__(self, model: torch.nn.Module):
        # Every name a weight update may target (state_dict names: parameters, tied aliases, persistent buffers).
        self._weights: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        # Names that must be covered by a whole update: one per distinct parameter (tied weights count once).
        self._parameter_names = {id(p): name for name, p in model.named_parameters()}

    def specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every name a weight update may target, with its dtype name and shape (state_dict names)."""
        return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in self._weights.items()}

    def check_specs(self, specs: dict[str, tuple[str, tuple[int, ...]]], partial: bool = False) -> None:
        """Check an update's names, dtypes and shapes against the model before any byte of it is applied.

        Args:
            specs: name -> (dtype name, shape) of every tensor the update brings.
            partial: allow an update that leaves some parameters out (else every parameter must be covered).
        Raises:
            FieldError: whose `field` is the culprit tensor's name (unknown, wrong dtype or shape, or missing).
        """
        for name, (dtype, shape) in specs.items():
            target = self._weights.get(name)
            if target is None:
                raise FieldError(name, "unknown tensor: the model has no parameter or buffer of this name")
            if dtype != dtype_name(target.dtype):
                raise FieldError(name, f"dtype {dtype} does not match the model's {dtype_name(target.dtype)}")
            if tuple(shape) != tuple(target.shape):
                raise FieldError(name, f"shape {list(shape)} does not match the model's {list(target.shape)}")
        if not partial:
            covered = {id(self._weights[name]) for name in specs}
            for parameter_name in self._parameter_names.values():
                if id(self._weights[parameter_name]) not in covered:
                    raise FieldError(
                        parameter_name, "missing: a whole update must cover every parameter (or pass partial=True)"
                    )

    def check_tied_values(self, tensors: dict[str, torch.Tensor]) -> None:
        """Two names of one tied parameter (e.g. embed_tokens and lm_head) must bring the same values."""
        first_name: dict[int, str] = {}
        for name, tensor in tensors.items():
            other = first_name.setdefault(id(self._weights[name]), name)
            if other != name and not torch.equal(tensors[other], tensor):
                raise FieldError(name, f"is tied to {other} in the model but the update gives them different values")

    def check_update(
        self, tensors: dict[str, torch.Tensor], version: int | None, mode: str, partial: bool, current: int
    ) -> int:
        """Check a whole update before anything changes (arguments as for `Engine.update_weights`); return the
        version it sets.

        Args:
            current: the policy version served now.
        Raises:
            FieldError: a bad mode, version or tensor, named.
        """
        new_version = self.check_version(version, mode, current)
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise FieldError("tensors", "expected a dict of name -> torch.Tensor")
        self.check_specs({n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}, partial)
        self.check_tied_values(tensors)
        return new_version

    @staticmethod
    def check_version(version: int | None, mode: str, current: int) -> int:
        """The version an update sets (None: one above `current`), after checking it and the commit mode.

        Raises:
            FieldError: ("mode" or "version") a bad one.
        """
        if mode not in WEIGHT_UPDATE_MODES:
            raise FieldError("mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}")
        new_version = current + 1 if version is None else version
        if not _is_int(new_version) or not current < new_version <= MAX_POLICY_VERSION:
            raise FieldError(
                "version",
                f"must be an integer above the current {current} and at most {MAX_POLICY_VERSION} (int64), "
                f"got {version!r}",
            )
        return new_version

    def holds(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether the model's own tensors equal `tensors` (checked ones), bit for bit: one tensor at a time is
        brought to the model's device to be compared (a GPU's memory holds one more of them at most)."""
        with torch.no_grad():
            for name, tensor in tensors.items():
                target, arrived = self._weights[name], tensor.to(self._weights[name].device, non_blocking=True)
                if target.dtype == arrived.dtype and target.is_floating_point():  # bits: -0.0 is not 0.0, NaN is NaN
                    bits = _SAME_WIDTH_INTS[target.element_size()]
                    target, arrived = target.view(bits), arrived.view(bits)
                if not torch.equal(target, arrived):
                    return False
        return True

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors into the model's own, in place (non-blocking from pinned memory; waited for)."""
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._weights[name].copy_(tensor, non_blocking=True)
            devices = {target.device for target in self._weights.values() if target.device.type == "cuda"}
            for device in devices:  # non-blocking copies from pinned staging must land first
                torch.cuda.synchronize(device)
