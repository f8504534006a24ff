"""What a caller may give as one prompt's token ids, made a fresh list of ints (`as_prompt`)."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from rollout.config import FieldError
from rollout.validation import all_plain_ints


def as_prompt(prompt_ids: Any) -> list[int]:
    """One prompt as a fresh list of ints: from a list/tuple, or a 1-D or (1, L) tensor or numpy array.

    Raises:
        ValueError: anything else, naming prompt_ids.
    """
    if isinstance(prompt_ids, torch.Tensor) or type(prompt_ids).__module__ == "numpy":
        array = torch.as_tensor(prompt_ids)
        if array.dim() == 2 and array.shape[0] == 1:
            array = array[0]
        if array.dim() != 1 or array.is_floating_point():
            raise FieldError(
                "prompt_ids",
                f"expected one prompt of integer ids (1-D or (1, L)), got {array.dtype} of shape {tuple(array.shape)}",
            )
        return array.tolist()
    if not isinstance(prompt_ids, (list, tuple)):
        hint = ": tokenize it first, e.g. tokenizer(texts)['input_ids']" if isinstance(prompt_ids, str) else ""
        raise FieldError("prompt_ids", f"expected a list of token ids, got {type(prompt_ids).__name__}{hint}")
    if all_plain_ints(prompt_ids):  # the common case, at C speed
        return list(prompt_ids)
    # numpy / torch integer scalars become plain ints; anything else is left for validate() to name.
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt_ids]
