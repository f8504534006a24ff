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
from rollout.sampling_warping import warping_fields

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
    if extra.get("top_k") == -1 and not isinstance(extra["top_k"], bool):  # vLLM's "no top-k", as for GRPOConfig.top_k
        extra["top_k"] = 0
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
    _greedy(sampling, extra)
    regex = getattr(args, "vllm_structured_outputs_regex", None)
    if regex is not None:  # TRL's structured outputs: the completions match it (needs the workers' tokenizer)
        sampling["regex"] = regex
    try:
        SamplingParams(**sampling)  # fail at construction, naming the field as the user spelled it
    except FieldError as error:
        raise error.renamed(spelled) from None
    if sampling["max_new_tokens"] == 0:  # rollout's prompt-only scoring (beside prompt_logprobs): TRL needs tokens
        name = spelled.get("max_new_tokens", "generation_kwargs['max_new_tokens']")
        raise ValueError(f"{name} must be at least 1 (as vLLM's max_tokens): TRL trains on the completions' tokens")
    return sampling


def _greedy(sampling: dict[str, Any], extra: dict[str, Any]) -> None:
    """Greedy rollouts (generation_kwargs `do_sample=False`, or vLLM's `temperature=0`) with the GRPOConfig's
    sampling settings, in place: the workers refuse a map that asks for a greedy pick and a shaped distribution.

    vLLM (TRL's vLLM path) samples greedily at temperature 0 whatever top_p, top_k and min_p say (it resets them), so
    the GRPOConfig's are left out. `do_sample=False` at a temperature other than 1 (TRL's loss scores the log-probs at
    GRPOConfig.temperature) picks greedily as top_k=1 at that temperature: the same tokens, and temperature_scaled
    log-probs at the temperature TRL recomputes them at. Warping keys given in generation_kwargs beside a greedy
    setting are refused by name here, not at the first round.
    """
    reason = "do_sample=False" if sampling.get("do_sample") is False else ""
    reason = reason or ("temperature=0" if sampling.get("temperature") == 0 else "")
    if not reason:
        return
    given = warping_fields({k: v for k, v in extra.items() if k not in ("temperature", "do_sample")})
    if given:
        raise ValueError(
            f"generation_kwargs {given} have no effect with greedy rollouts (generation_kwargs {reason}): remove them"
        )
    sampling.update(top_k=0, top_p=1.0, min_p=0.0)  # the GRPOConfig's: vLLM resets them when greedy
    if reason == "do_sample=False" and sampling.get("temperature") not in (0, 1):
        if sampling.get("logprob_mode") != "temperature_scaled":
            raise ValueError(
                f"generation_kwargs do_sample=False at temperature {sampling['temperature']!r} "
                f"(GRPOConfig.temperature, or generation_kwargs) with logprob_mode={sampling.get('logprob_mode')!r}: "
                "a greedy pick has no temperature; use temperature=1.0"
            )
        sampling.update(do_sample=True, top_k=1)  # the argmax, its log-prob temperature_scaled at the temperature
