"""How a `GRPOConfig` becomes the rollout workers' sampling settings, field by field.

Every GRPOConfig field that TRL hands its vLLM generation backend is honoured, has no effect here (the settings of
the vLLM engine the workers replace), or is refused at construction with an error naming it. `generation_kwargs`
takes rollout `SamplingParams` fields and the vLLM spellings users copy from TRL recipes: `max_tokens`,
`min_tokens`, `ignore_eos` and `stop_token_ids` (stops in addition to the EOS tokens, as in vLLM); `stop` strings
and `skip_special_tokens` are SamplingParams fields (stop strings need a worker with a tokenizer); the other
detokenization options, `include_stop_str_in_output` among them, have no effect (workers return token ids, which a
stop string ends alike either way); anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

from rollout.config import FieldError, SamplingParams
from rollout.sampling_params import SAMPLING_FIELDS
from rollout.sampling_spellings import VLLM_SPELLINGS, spelling_hints

# GRPOConfig fields the workers' sampling follows.
HONOURED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "generation_kwargs",
    "vllm_structured_outputs_regex",
)
# Settings of the vLLM engine (or server) that rollout replaces: they change no token. (In rollout_mode="colocate"
# vllm_gpu_memory_utilization sizes the KV cache on CUDA, vllm_enable_sleep_mode turns sleep_between_rounds on, and
# vllm_max_model_length caps prompt + completion as vLLM's max_model_len does: see RolloutGRPOTrainer.)
NO_EFFECT = (
    "vllm_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_group_port",
    "vllm_server_timeout",
    "vllm_tensor_parallel_size",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "vllm_enable_sleep_mode",
    "vllm_model_impl",
    "trust_remote_code",
    "per_device_train_batch_size",
    "steps_per_generation",
)
# Fields rollout cannot honour, with their harmless value and why.
REFUSED = {
    "use_transformers_continuous_batching": (False, "RolloutGRPOTrainer generates with rollout, not transformers"),
    "use_transformers_paged": (False, "RolloutGRPOTrainer generates with rollout, not transformers"),
}
# vLLM options about detokenization: the workers return token ids, so they change nothing.
NO_EFFECT_KWARGS = ("spaces_between_special_tokens", "detokenize", "include_stop_str_in_output")


def grpo_sampling(args: Any, eos_token_ids: list[int]) -> dict[str, Any]:
    """The sampling settings (a `SamplingParams` dict) for the rows of a GRPO trainer.

    Args:
        args: the trainer's GRPOConfig.
        eos_token_ids: the trainer's EOS tokens (they stop generation unless `ignore_eos`).
    Raises:
        ValueError: a field or generation_kwargs key rollout cannot honour, naming it.
    """
    for name, (harmless, why) in REFUSED.items():
        if getattr(args, name, harmless) != harmless:
            raise ValueError(f"GRPOConfig.{name}={getattr(args, name)!r} is not supported: {why}")
    extra = dict(args.generation_kwargs or {})
    spelled = {}  # rollout's field -> the vLLM spelling the user gave it (what an error names)
    for vllm_name, name in VLLM_SPELLINGS.items():
        if vllm_name in extra:
            if name in extra:
                raise ValueError(f"generation_kwargs gives both {vllm_name!r} and {name!r} (the same setting)")
            extra[name] = extra.pop(vllm_name)
            spelled[name] = f"generation_kwargs[{vllm_name!r}] ({name})"
    for name in NO_EFFECT_KWARGS:
        extra.pop(name, None)
    ignore_eos = extra.pop("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"generation_kwargs['ignore_eos'] must be a bool, got {ignore_eos!r}")
    stops = [] if ignore_eos else list(eos_token_ids)
    extra_stops = extra.pop("stop_token_ids", None) or []
    if not isinstance(extra_stops, (list, tuple)):
        raise ValueError(f"generation_kwargs['stop_token_ids'] must be a list of token ids, got {extra_stops!r}")
    stops += [token for token in extra_stops if token not in stops]
    unknown = sorted(set(extra) - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown} are not supported: give rollout SamplingParams fields, or the vLLM "
            f"spellings {sorted([*VLLM_SPELLINGS, 'ignore_eos', 'stop_token_ids'])}"
            + spelling_hints(unknown, {*SAMPLING_FIELDS, *VLLM_SPELLINGS, "ignore_eos", *NO_EFFECT_KWARGS})
        )
    sampling = {
        "do_sample": True,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": 0 if args.top_k in (None, -1) else args.top_k,  # -1: off, as TRL's vLLM backend reads it
        "min_p": args.min_p or 0.0,
        "repetition_penalty": args.repetition_penalty,
        "max_new_tokens": args.max_completion_length,
        "stop_token_ids": stops,
        "logprob_mode": "temperature_scaled",  # what TRL's loss recomputes: log_softmax(logits / T)
        **extra,
    }
    regex = getattr(args, "vllm_structured_outputs_regex", None)
    if regex is not None:  # TRL's structured outputs: the completions match it (needs the workers' tokenizer)
        sampling["regex"] = regex
    try:
        SamplingParams(**sampling)  # fail at construction, naming the field as the user spelled it
    except FieldError as error:
        raise error.renamed(spelled) from None
    return sampling
