"""`generate_batch`: a whole list of prompts through the engine in the calling thread, outputs keyed by request id
(transformers' `generate_batch`, as a function of the model)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Any

import torch

from rollout.config import FieldError, SamplingParams
from rollout.engine.kept_engines import cached_engine, done_with, engine_for, release_cached_engine
from rollout.engine.lora.adapter_weights import from_peft_model
from rollout.engine.progress import SampleProgress
from rollout.engine.requests.intake import TRANSFORMERS_FIELD_NAMES, TorchSeeds
from rollout.engine.requests.outputs import GenerationOutput
from rollout.engine.runner.model_checks import refuse_model_name
from rollout.peft_adapters import is_peft_model
from rollout.sampling_spellings import spelling_hints


class SamplesFailedWarning(UserWarning):
    """`generate_batch` returned samples that ended with finish_reason "error" (their `error` says why)."""


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during `generate_batch` (a KeyboardInterrupt, so code that catches that still does): the engine is
    closed as on any error, and `outputs` holds the samples that had finished, keyed and ordered as
    `generate_batch`'s return value (those not finished are left out)."""

    def __init__(self, outputs: dict[str, GenerationOutput], total: int) -> None:
        """
        Args:
            outputs: the finished samples, request id -> output, in `generate_batch`'s order.
            total: the samples the call asked for.
        """
        super().__init__(
            f"generate_batch interrupted: {len(outputs)} of {total} samples had finished (in its .outputs)"
        )
        self.outputs = outputs
        self.total = total


# generate_batch's keyword arguments read from **kwargs (its signature names the others).
KEYWORDS = ("sampling", "max_new_tokens", "n", "adapter")


def _kwargs_hint(unexpected: dict[str, Any]) -> str:
    """How to pass those of `unexpected` that are `SamplingParams` fields, and the closest keyword or field to the
    others (a typo such as `max_new_token`); empty when there is nothing to say."""
    fields = {field.name for field in dataclasses.fields(SamplingParams)}
    named = {name: value for name, value in sorted(unexpected.items()) if name in fields}
    own = [name for name in inspect.signature(generate_batch).parameters if name not in ("model", "inputs", "kwargs")]
    hint = spelling_hints(set(unexpected) - fields, {*own, *KEYWORDS, *fields})
    if not named:
        return hint
    settings = ", ".join(f"{name}={value!r}" for name, value in named.items())
    return f" ({', '.join(named)}: SamplingParams settings, so pass sampling=SamplingParams({settings})){hint}"


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    record_timestamps: bool = False,
    progress_bar: bool = True,
    persistent_manager: bool = False,
    warmup: bool = True,
    tokenizer: Any = None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate completions for a list of prompts with continuous batching and return them all.

    Runs the engine loop in the calling thread (no background thread, no queue limit). The arguments after `model`
    come in the order of transformers' `model.generate_batch`, so positional calls carry over.

    Args:
        model: a transformers causal LM.
        inputs: prompts as lists of token ids, or what a tokenizer returns (its `input_ids`, padding removed by its
            `attention_mask`).
        generation_config: a `transformers.GenerationConfig` for default sampling settings (merged with the model's).
        continuous_batching_config: engine settings: rollout's or transformers' ContinuousBatchingConfig (see
            `Engine`), or None for the defaults.
        record_timestamps: outputs carry the time each token reached the host (`GenerationOutput.timestamps`).
        progress_bar: show a tqdm bar of finished samples, with the tokens generated so far and their rate
            (transformers' default is False).
        persistent_manager: keep the engine (its KV cache and CUDA graphs) on the model for the next call with the
            same configs (and the same model generation config and parameter storage) instead of building one per
            call; between calls the model is the caller's (its attention implementation and training mode back),
            and each call starts with an empty prefix cache, since weights may change in place in between.
            `release_cached_engine(model)` frees it at once; a model dropped with it is freed with its engine at
            the next garbage collection.
        warmup: capture the decode CUDA graphs and run a short request before the prompts (once per engine).
        tokenizer: the model's tokenizer, needed for stop strings (`SamplingParams.stop`, or a GenerationConfig's
            `stop_strings`), as `generate(..., stop_strings=..., tokenizer=...)` needs one.
        **kwargs: `sampling` (one SamplingParams or dict of its fields, or one per prompt; a sampled request
            without a `seed` takes one from torch's default generator unless the config has a `seed`, so
            `torch.manual_seed` repeats a call, as it repeats transformers' sampling), `max_new_tokens` (every prompt's
            length; refused for a prompt whose SamplingParams gives another), `n` (samples per prompt;
            default: the GenerationConfig's num_return_sequences, else 1), `adapter` (with a `peft.PeftModel`: the
            name of its LoRA adapter to sample with, or one name per prompt, None for the base model; the adapters
            are served unmerged, side by side in one batch, and the model is left as it was: adapters merged into its
            base weights, peft's `merge_adapter`, are unmerged for the call and merged again after it).
    Returns:
        Outputs keyed by sample request id (`"req_<i>"`, or `"req_<i>#<j>"` when n > 1), in input order.
    Raises:
        ValueError: bad input, naming the field (nothing is generated then); a model given by name says how to
            load it.
        GenerationInterrupted: Ctrl-C; its `outputs` are the samples finished by then.
    Warns:
        SamplesFailedWarning: some samples ended with finish_reason "error" (e.g. a prompt and length that can never
            fit the KV cache), naming how many and the first one's reason; they are returned with the others.
    """
    refuse_model_name(model)
    if not isinstance(model, torch.nn.Module):
        raise FieldError("model", f"expected a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")
    inputs = _prompts(inputs, _pad_to_drop(model, generation_config))
    sampling = kwargs.pop("sampling", None)
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    n = kwargs.pop("n", None)
    adapters = kwargs.pop("adapter", None)
    if kwargs:
        raise TypeError(f"generate_batch() got unexpected keyword arguments: {sorted(kwargs)}{_kwargs_hint(kwargs)}")
    per_prompt = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(inputs)
    if len(per_prompt) != len(inputs):
        raise FieldError("sampling", f"got {len(per_prompt)} SamplingParams for {len(inputs)} prompts")
    adapters = adapters if isinstance(adapters, (list, tuple)) else [adapters] * len(inputs)
    if len(adapters) != len(inputs):
        raise FieldError("adapter", f"got {len(adapters)} adapter names for {len(inputs)} prompts")
    peft_model = None
    if any(name is not None for name in adapters):
        if not is_peft_model(model):
            raise FieldError("adapter", f"names a LoRA adapter of a peft.PeftModel, got a {type(model).__name__}")
        peft_model, model = model, model.get_base_model()  # its LoRA layers pass through; the engine adds them
    peft_off = contextlib.ExitStack()  # closed last: the adapters enabled again, then merged again
    if peft_model is not None:
        # The engine serves the base and the adapters unmerged, so a merged adapter (peft's merge_adapter) leaves the
        # base weights first; peft's disabled forward would unmerge it for good, `_merge_back` restores it.
        peft_off.callback(_merge_back, _unmerged(peft_model))
    try:
        engine, warm = engine_for(model, generation_config, continuous_batching_config, persistent_manager)
    except BaseException:
        peft_off.close()
        raise
    engine.intake.tokenizer = tokenizer  # this call's (a kept engine may have served another tokenizer's)
    if engine.config.seed is None:  # unseeded samples repeat after torch.manual_seed, as transformers' sampling
        engine.intake.seed_source = TorchSeeds()
    results: dict[str, GenerationOutput] = {}
    order: list[str] = []
    try:
        if peft_model is not None:
            peft_off.enter_context(peft_model.disable_adapter())
        for name in sorted({name for name in adapters if name is not None}):
            engine.load_adapter(name, from_peft_model(peft_model, name))
        routes_asked = any(
            params.get("return_routes") if isinstance(params, dict) else getattr(params, "return_routes", False)
            for params in per_prompt
        )
        if routes_asked and engine.intake.routes_refusal is not None:  # before the warm-up's compile, not after it
            raise FieldError("return_routes", engine.intake.routes_refusal)
        if warmup and not warm:
            engine.warmup()
        for index, (prompt, params) in enumerate(zip(inputs, per_prompt)):
            engine.intake.say_dropped(params)
            try:
                order += engine.add_request(
                    f"req_{index}", prompt, params, n, max_new_tokens, False, record_timestamps, adapters[index]
                )
            except FieldError as error:
                error = error.renamed(TRANSFORMERS_FIELD_NAMES)
                if len(inputs) == 1:
                    raise error from None
                raise FieldError(error.field, f"prompt {index} of the batch: {error.reason}") from None
        with SampleProgress(engine.counters, len(order), progress_bar, desc="generate_batch") as progress:
            while engine.has_unfinished():
                finished = engine.step()
                for output in finished:
                    results[output.request_id] = output
                progress.after_step(len(finished))
    except BaseException as error:
        if cached_engine(model) is engine:
            release_cached_engine(model)  # an engine left mid-run is not reused
        if isinstance(error, KeyboardInterrupt) and not isinstance(error, GenerationInterrupted):
            finished = {request_id: results[request_id] for request_id in order if request_id in results}
            raise GenerationInterrupted(finished, len(order)) from error  # the samples already generated are kept
        raise
    finally:
        peft_off.close()
        if cached_engine(model) is engine:  # kept (persistent_manager) and still this call's
            engine.runner.suspend()  # the model is the caller's again until the next call
            done_with(model)
        else:
            engine.close()
    failed = [results[request_id] for request_id in order if results[request_id].finish_reason == "error"]
    if failed:  # a caller reading only the tokens would see empty samples and no reason
        warnings.warn(
            f"generate_batch: {len(failed)} of {len(order)} samples failed (finish_reason 'error', their `error` "
            f"says why); the first, {failed[0].request_id}: {failed[0].error}",
            SamplesFailedWarning,
            stacklevel=2,
        )
    return {request_id: results[request_id] for request_id in order}


def _unmerged(peft_model: Any) -> list[tuple[Any, list[str]]]:
    """Unmerge every LoRA layer of `peft_model` with adapters merged into its base weights (peft's own unmerge);
    returns (layer, the adapters it had merged, in order) for `_merge_back`."""
    from peft.tuners.lora import LoraLayer

    merged = []
    for layer in peft_model.modules():
        if isinstance(layer, LoraLayer) and layer.merged:
            merged.append((layer, list(layer.merged_adapters)))
            layer.unmerge()
    return merged


def _merge_back(merged: list[tuple[Any, list[str]]]) -> None:
    """Merge again what `_unmerged` unmerged (peft's own merge: the weights equal the merged ones up to rounding)."""
    for layer, adapters in merged:
        layer.merge(adapter_names=adapters)


def _pad_to_drop(model: torch.nn.Module, generation_config: Any) -> int | None:
    """The pad token `generate` masks out of a 2-D `input_ids` given without its `attention_mask`: the generation
    config's `pad_token_id` (the caller's, else the model's), unless it is also a stop token (then `generate` cannot
    tell padding from text, and keeps it)."""
    configs = [c for c in (generation_config, getattr(model, "generation_config", None)) if c is not None]
    pad = next((config.pad_token_id for config in configs if getattr(config, "pad_token_id", None) is not None), None)
    eos = next((config.eos_token_id for config in configs if getattr(config, "eos_token_id", None) is not None), None)
    stops = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return None if pad is None or pad in stops else pad


def _prompts(inputs: Any, pad: int | None = None) -> Any:
    """Prompts as lists of token ids, also from what a tokenizer returns (a BatchEncoding or dict with `input_ids`;
    padding dropped where its `attention_mask` is 0) or a 2-D tensor / array (without a mask: `pad` dropped, as
    `generate` infers the mask from it); anything else but an iterator is left for the engine's validation to name.

    Raises:
        FieldError: ("input_ids") text; ("inputs") an iterator or None; ("attention_mask") one whose rows do not
            match the prompts'.
    """
    mask = None
    if hasattr(inputs, "keys") and "input_ids" in inputs:
        mask, inputs = inputs.get("attention_mask"), inputs["input_ids"]
    if mask is None and pad is not None and getattr(inputs, "ndim", None) == 2:  # a padded batch without its mask
        mask = (inputs != pad).tolist()
    if hasattr(inputs, "tolist"):
        inputs = inputs.tolist()
    if isinstance(inputs, str):  # (as the engine names a prompt of text; unchecked, each character were a prompt)
        raise FieldError("input_ids", "expected prompts of token ids, got str: tokenize it first, e.g. tokenizer(text)")
    if inputs is None or (not isinstance(inputs, (list, tuple)) and hasattr(inputs, "__next__")):
        kind = type(inputs).__name__
        raise FieldError(
            "inputs", f"expected a list of prompts (lists of token ids) or a tokenizer's output, got {kind}"
        )
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], int):  # one prompt
        inputs = [inputs]
    if mask is not None:
        mask = mask.tolist() if hasattr(mask, "tolist") else mask
        mask = [mask] if mask and isinstance(mask[0], int) else mask
        if len(mask) != len(inputs):
            raise FieldError("attention_mask", f"{len(mask)} rows for {len(inputs)} prompts")
        inputs = [[token for token, keep in zip(row, keeps) if keep] for row, keeps in zip(inputs, mask)]
    return inputs
