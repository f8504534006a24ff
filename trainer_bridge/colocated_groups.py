"""A `ColocatedEngine` round's groups checked as a worker checks them and resolved into the engine's requests: the
same refusals under the same field names ("groups[i].<field>", a sampling setting as "sampling.<field>"), so that
trainer code meets the same errors colocated as against a worker fleet."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from rollout.config import FieldError, SamplingParams
from rollout.engine.engine import Engine
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.request import Request
from rollout.peft_adapters import BASE_NAME, is_peft_model
from rollout.sampling_params import SAMPLING_FIELDS, served_logprobs_refusal
from trainer_bridge.client.calls import PromptGroup, as_integer


def prepare_requests(
    engine: Engine, model: torch.nn.Module, groups: list[PromptGroup], ids: itertools.count
) -> list[Request]:
    """Each group checked and resolved into its leader request (nothing queued: a bad group loses nothing).

    Args:
        engine: the colocated engine.
        model: the trainer's model it runs (a PEFT model samples with its active adapters).
        groups: the round's groups.
        ids: numbers the ids of groups that have none.
    Raises:
        FieldError: the first bad group's field, as "groups[i].<field>" (the worker's field names).
    """
    requests: list[Request] = []
    seen: set[str] = set()
    for index, group in enumerate(groups):
        if not isinstance(group, PromptGroup):
            raise FieldError(f"groups[{index}]", f"expected a PromptGroup, got {type(group).__name__}")
        group_id = group.group_id if group.group_id is not None else f"colocated-{next(ids)}"
        if group_id in seen:
            raise FieldError(f"groups[{index}].group_id", f"{group_id!r} appears twice")
        seen.add(group_id)
        sampling = group.sampling
        try:
            if isinstance(sampling, dict):
                sampling = SamplingParams.from_fields(sampling)
            elif not isinstance(sampling, SamplingParams):
                kind = type(sampling).__name__
                raise FieldError("sampling", f"expected a SamplingParams or a dict of its fields, got {kind}")
            refusal = served_logprobs_refusal(sampling.top_logprobs)  # as a worker refuses it (in process: 100)
            if refusal is not None:
                raise FieldError("top_logprobs", refusal)
            if sampling.stop and engine.intake.tokenizer is None:  # the intake's own words name other APIs
                raise FieldError("stop", "stop strings need a tokenizer: pass ColocatedEngine(..., tokenizer=...)")
            n = as_integer(group.n)  # numpy / torch integers too; anything else is the intake's to name
            adapter = served_adapter(engine, model, group.adapter)
            spec = GroupSpec(group_id, group.prompt_ids, sampling, group.n if n is None else n, adapter=adapter)
            requests.append(engine.intake.prepare(spec))
        except FieldError as error:
            # The worker's names: a sampling setting is "sampling.<field>".
            field = f"sampling.{error.field}" if error.field in SAMPLING_FIELDS else error.field
            raise FieldError(f"groups[{index}].{field}", error.reason) from None
    return requests


def served_adapter(engine: Engine, model: torch.nn.Module, name: Any) -> str | None:
    """A group's `adapter` as the engine serves it, or refused as a worker refuses it: None, and "__base__" for a
    model that is not a PEFT model, are the model as it is; another name must be an adapter loaded into the engine
    (`Engine.load_adapter`).

    Args:
        engine: the colocated engine.
        model: the trainer's model.
        name: `PromptGroup.adapter`.
    Raises:
        FieldError: ("adapter") not a non-empty string, "__base__" on a PEFT model (its adapters run inside its
            forward: no round samples without them), or no adapter of that name in the engine.
    """
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise FieldError("adapter", f"must be a non-empty string, got {name!r}")
    peft = is_peft_model(model)
    if name == BASE_NAME and not peft:
        return None
    if name == BASE_NAME:
        raise FieldError("adapter", f"{BASE_NAME!r}: a colocated PEFT model samples with its active adapters")
    try:
        if engine.intake.adapter_ref is None:
            raise FieldError("adapter", "this engine serves no LoRA adapter")
        engine.intake.adapter_ref(name)  # the worker's own check, and its words
    except FieldError as error:
        hint = "; a colocated PEFT model samples with its active adapters: leave adapter None" if peft else ""
        raise FieldError("adapter", f"{error.reason}{hint}") from None
    return name
