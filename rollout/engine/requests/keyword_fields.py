"""A request's sampling settings given as keywords, as transformers' `add_request(..., eos_token_id=...,
temperature=0.7)` takes them: merged over the request's SamplingParams (or the generation config's defaults), each
refused under the name the caller wrote."""

from __future__ import annotations

import reprlib
from typing import Any

from rollout.config import FieldError, SamplingParams
from rollout.generation_config import eos_ids
from rollout.sampling_params import SAMPLING_FIELDS
from rollout.sampling_spellings import unknown_field_reason
from rollout.sampling_warping import warping_fields


def is_token(value: object, vocab_size: int) -> bool:
    """True for a plain int token id of a vocabulary of `vocab_size`.

    Args:
        value: what was given as a token id.
        vocab_size: the model's vocabulary size.
    """
    return type(value) is int and 0 <= value < vocab_size


def sampling_with_fields(
    defaults: SamplingParams,
    vocab_size: int,
    sampling: SamplingParams | None,
    eos_token_id: Any,
    fields: dict[str, Any],
) -> SamplingParams | None:
    """`sampling` (or `defaults`) with per-request keyword fields applied; `sampling` itself when none are given.

    Args:
        defaults: the generation config's sampling defaults (used when `sampling` is None).
        vocab_size: the model's vocabulary size (`eos_token_id` must name its tokens).
        sampling: the request's SamplingParams, a dict of its fields (applied as keywords are), or None.
        eos_token_id: the request's stop token(s), or None; negative ids stand for none (transformers' -1).
        fields: SamplingParams fields by name.
    Raises:
        FieldError: `sampling` is no SamplingParams, a keyword is no SamplingParams field, `eos_token_id` is no
            token ids of this model or comes with `stop_token_ids`, or a field that shapes the sampled distribution
            (temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff) is given where do_sample is
            False.
    """
    if isinstance(sampling, dict):  # SamplingParams fields by name (as a RolloutClient takes them): keywords
        fields, sampling = {**sampling, **fields}, None
    if eos_token_id is None and not fields:
        return sampling
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise FieldError("sampling", f"expected SamplingParams or a dict of its fields, got {type(sampling).__name__}")
    unknown = sorted(set(fields) - SAMPLING_FIELDS, key=repr)  # (a dict's keys may be of any type)
    if unknown:
        raise FieldError(str(unknown[0]), unknown_field_reason(unknown[0], SAMPLING_FIELDS))
    if eos_token_id is not None:  # transformers' stop token(s): negative ids mean none, as there
        fields["stop_token_ids"] = _eos_stops(eos_token_id, fields, vocab_size)
    merged = (sampling if sampling is not None else defaults).merged(**fields)
    # transformers only warns; a keyword asked for here that would shape a greedy pick does nothing: refused.
    warping = warping_fields(fields, merged.logprob_mode)
    if warping and not merged.do_sample:
        origin = "asked for here" if "do_sample" in fields else "sampling's" if sampling else "the generation config's"
        raise FieldError(warping[0], f"has no effect while do_sample is False ({origin}): pass do_sample=True too")
    return merged


def _eos_stops(eos_token_id: Any, fields: dict[str, Any], vocab_size: int) -> list[int]:
    """`add_request`'s `eos_token_id` as stop token ids, checked under the name the caller gave.

    Raises:
        FieldError: (eos_token_id) not token ids of this model, or given with `stop_token_ids`, which would
            silently replace one another.
    """
    if "stop_token_ids" in fields:
        raise FieldError("eos_token_id", "and stop_token_ids both set this request's stop tokens: pass one")
    stops = eos_ids(eos_token_id)
    if not all(is_token(token, vocab_size) for token in stops):
        reason = f"a token id in [0, {vocab_size}) or a list of them (negative ids: no EOS)"
        raise FieldError("eos_token_id", f"{reprlib.repr(eos_token_id)} is invalid: must be {reason}")
    return stops
