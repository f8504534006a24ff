"""The models an HTTP worker serves, as the OpenAI API names them: the worker's model and each LoRA adapter it
serves (listed by /v1/models with the model as their parent, and chosen by a request's `model`, as vLLM does)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rollout.engine.requests.adapter_ref import AdapterRef
from rollout.service.http.errors import APIError


def requested_adapter(
    model: Any, model_name: str, adapters: Mapping[str, AdapterRef], retired: Mapping[str, str] | None = None
) -> str | None:
    """The adapter a request's `model` field names: None for the worker's model (or no `model`).

    Args:
        model: the request's `model` field.
        model_name: the worker's model's name.
        adapters: the adapters served, by name.
        retired: adapters no longer served, with the reason a request naming one is told (`AdapterTable.retired`).
    Raises:
        APIError: 404 model_not_found for anything else, listing what is served (and why, for a retired adapter).
    """
    if model is None or model == model_name:
        return None
    if isinstance(model, str) and model in adapters:
        return model
    raise _not_found(model, model_name, adapters, retired or {})


def _not_found(model: Any, model_name: str, adapters: Mapping[str, Any], retired: Mapping[str, str]) -> APIError:
    """404 model_not_found, listing what is served."""
    served = ", ".join(f"`{name}`" for name in [model_name, *sorted(adapters)])
    why = f"{retired[model]}; " if isinstance(model, str) and model in retired else ""
    return APIError(
        404,
        f"the model `{model}` does not exist: {why}this worker serves {served}",
        "model",
        "not_found_error",
        "model_not_found",
    )


def model_list(
    model_name: str,
    max_model_len: int,
    policy_version: int,
    adapters: Mapping[str, AdapterRef],
    roots: Mapping[str, str] | None = None,
) -> dict:
    """/v1/models: the worker's model, then its adapters (each with its parent and policy version; its `root` the
    directory it was loaded from by /v1/load_lora_adapter, in `roots`, else its name)."""
    listed = {"object": "model", "created": int(time.time()), "owned_by": "rollout", "max_model_len": max_model_len}
    data = [{**listed, "id": model_name, "root": model_name, "parent": None, "policy_version": policy_version}]
    for name, ref in sorted(adapters.items()):
        root = (roots or {}).get(name, name)
        data.append({**listed, "id": name, "root": root, "parent": model_name, "policy_version": ref.version})
    return {"object": "list", "data": data}


def model_entry(model_id: str, listed: dict) -> dict:
    """/v1/models/{model_id} (OpenAI's retrieve): the entry of `model_list`'s answer with that id.

    Args:
        model_id: the model (or adapter) asked for.
        listed: `model_list`'s answer.
    Raises:
        APIError: 404 model_not_found, listing what is served.
    """
    for entry in listed["data"]:
        if entry["id"] == model_id:
            return entry
    names = [entry["id"] for entry in listed["data"]]
    raise _not_found(model_id, names[0], dict.fromkeys(names[1:]), {})
