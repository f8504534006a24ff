"""A weight update read from a checkpoint directory on a shared filesystem (`POST /update_weights {"weight_dir"}`):
its `*.safetensors` files (`save_pretrained`'s, whole or sharded), read with safetensors' own reader, every tensor
checked against the served model before any is committed. The commit itself is an ordinary weight update (one
transaction, between two steps, with a new policy version)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rollout.config import FieldError, dtype_name
from rollout.protocol.staging import all_finite
from rollout.service.http.errors import APIError

# Most safetensors files one checkpoint may hold (sharded checkpoints of very large models have a few hundred).
MAX_CHECKPOINT_FILES = 4096


def read_checkpoint(
    directory: Path, served: dict[str, tuple[str, tuple[int, ...]]], check_finite: bool = False
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `directory`, on the CPU, floating ones cast to the served parameter's dtype
    (as a copy into the model would: a float32 checkpoint serves a bfloat16 model).

    Args:
        directory: a checked directory (`AllowedDirs.directory`).
        served: the served model's weights, name -> (dtype name, shape) (`WeightTable.specs`).
        check_finite: refuse a floating tensor holding NaN or Inf (the worker's `--check-finite`), as cast.
    Raises:
        APIError: 400 naming the file at fault (unreadable, not safetensors, a tensor name found in two files, a
            tensor not finite under check_finite, finite values the cast turns into Inf) or a directory that holds no
            safetensors file.
    """
    from safetensors import safe_open

    files = sorted(path for path in directory.glob("*.safetensors") if path.is_file())
    if not files:
        raise APIError(400, f"weight_dir: no *.safetensors file in {str(directory)!r}", "weight_dir")
    if len(files) > MAX_CHECKPOINT_FILES:
        raise APIError(
            400, f"weight_dir: {len(files)} safetensors files (at most {MAX_CHECKPOINT_FILES})", "weight_dir"
        )
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in files:
        if Path(os.path.realpath(path)).parent != directory:  # a link put in its place since the directory's check
            reason = f"{path.name} in {str(directory)!r} is now a link to a file outside it"
            raise APIError(403, f"weight_dir: {reason}", "weight_dir", "permission_error")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if name in tensors:
                        reason = f"tensor {name!r} is in both {origin[name]} and {path.name}"
                        raise APIError(400, f"weight_dir: {reason}", "weight_dir")
                    read = reader.get_tensor(name)
                    tensors[name], origin[name] = _as_served(read, served.get(name)), path.name
                    overflow = _overflow(read, tensors[name])
                    if overflow is not None:
                        raise APIError(400, f"weight_dir: {path.name}: tensor {name!r} {overflow}", "weight_dir")
                    if check_finite and not _finite(tensors[name]):
                        reason = (
                            f"{path.name}: tensor {name!r} holds NaN or Inf values (the worker checks: --check-finite)"
                        )
                        raise APIError(400, f"weight_dir: {reason}", "weight_dir")
        except APIError:
            raise
        except Exception as error:  # noqa: BLE001 - a truncated or foreign file, named
            raise APIError(400, f"weight_dir: cannot read {path.name}: {error}", "weight_dir") from None
    return tensors


def _finite(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf (other tensors always do)."""
    return not tensor.is_floating_point() or not tensor.numel() or all_finite(tensor)


def _overflow(read: torch.Tensor, cast: torch.Tensor) -> str | None:
    """Why a floating tensor cast to the served dtype cannot be served: the cast turned finite values into Inf (1e6
    for a float16 model; every sample would end in non-finite logits), as `push_weights` refuses such a cast. None
    when it turned none (a cast to a wider range, to a saturating float8, or no cast)."""
    if cast.dtype == read.dtype or not cast.numel() or torch.finfo(cast.dtype).max >= torch.finfo(read.dtype).max:
        return None
    lost = int((torch.isinf(cast.float()) & torch.isfinite(read)).sum())
    if not lost:
        return None
    largest = float(read[torch.isfinite(read)].abs().max())
    return (
        f"holds {lost} finite value(s) (largest magnitude {largest:.4g}) beyond the served dtype "
        f"{dtype_name(cast.dtype)} (largest finite {torch.finfo(cast.dtype).max:.4g}), which would be served as Inf"
    )


def _as_served(tensor: torch.Tensor, spec: tuple[str, tuple[int, ...]] | None) -> torch.Tensor:
    """`tensor` in the served parameter's dtype when both are floating (else as it is: the checks name it)."""
    if spec is None or dtype_name(tensor.dtype) == spec[0] or not tensor.is_floating_point():
        return tensor
    dtype = getattr(torch, spec[0], None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return tensor
    return tensor.to(dtype)


def refused_update(error: FieldError, directory: Path) -> APIError:
    """A 400 for a checkpoint the engine refused (a tensor unknown to the model, of another shape, one missing)."""
    return APIError(400, f"weight_dir: {str(directory)!r}: {error.field}: {error.reason}", "weight_dir")
