"""What `rollout-worker`'s flags mean before anything heavy loads: the values read one way and used another (each
converted here, once), the engine's and the limits' settings built from them, and the checks that need neither torch
nor a model. The parser (`cli.py`) and `startup.py` both use it; it imports neither torch nor ZeroMQ, so a bad
setting is a usage error at once, not after seconds of imports."""

from __future__ import annotations

import argparse
import math
import os

from rollout.cli.device_names import DEVICE_FORMS
from rollout.cli.parser import CliParser
from rollout.config import ContinuousBatchingConfig
from rollout.service.http.serving.flags import check_http_flags
from rollout.service.launch.speculative_flags import speculative_settings
from rollout.service.zmq.limits import WorkerLimits

# The flag of each config field (ContinuousBatchingConfig, WorkerLimits) whose name is not the flag's with
# underscores: a FieldError naming the field is reported naming the flag.
FIELD_FLAGS = {
    "scheduler_type": "--scheduler",
    "use_cuda_graph": "--cuda-graphs",
    "overlap_scheduling": "--overlap",
    "client_timeout_s": "--client-timeout",
}

# Flags of vLLM's and SGLang's servers a user may type here, and what to use instead.
_SERVE_ADDRESS = "--bind tcp://127.0.0.1:PORT (ZeroMQ clients) or --http 127.0.0.1:PORT (the OpenAI API)"
OTHER_TOOLS_FLAGS = {
    "--port": _SERVE_ADDRESS,
    "--host": _SERVE_ADDRESS,
    "--model-path": "--model",
    "--gpu-memory-utilization": "--max-memory-percent (a percent of free memory for the KV cache)",
    "--mem-fraction-static": "--max-memory-percent (a percent of free memory for the KV cache)",
}

# Flags that only the HTTP API reads: given without --http they would do nothing, so they are refused by name.
HTTP_ONLY_FLAGS = (
    "--http-max-body-bytes",
    "--http-max-receiving-bytes",
    "--http-max-receiving-bytes-per-client",
    "--http-max-answer-logprobs",
    "--http-head-timeout",
    "--http-keep-alive-timeout",
    "--http-max-waiting-connections",
    "--tool-call-parser",
    "--trust-request-chat-template",
    "--generation-config",
)

# --cuda-graphs and --overlap -> the config's use_cuda_graph / overlap_scheduling (None: the device decides).
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def percent(text: str) -> float:
    """The value of a flag that takes a percent (argparse `type`): a number in (0, 100].

    Args:
        text: the flag's value as given, e.g. "90".
    Raises:
        ValueError: not a number (argparse says "invalid percent value").
        argparse.ArgumentTypeError: out of range (argparse prefixes the flag's name).
    """
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 100):
        raise argparse.ArgumentTypeError(f"{text} is not a percent in (0, 100] (90 means 90% of free memory)")
    return value


def memory_fraction(percent_of_free: float | None) -> float | None:
    """`--max-memory-percent` (a percent, 90 for 90%) as `ContinuousBatchingConfig.max_memory_percent`, which is a
    fraction in (0, 1] (transformers' name for it, kept so its users carry their settings over).

    Args:
        percent_of_free: the flag's value; None (unset) stays None, the engine's own default.
    """
    return None if percent_of_free is None else percent_of_free / 100


def check_settings(parser: CliParser, args: argparse.Namespace) -> tuple[WorkerLimits, ContinuousBatchingConfig]:
    """The per-client limits and the engine settings the flags give, and the model and tokenizer directories they
    name checked; a bad one is a usage error naming its flag (`parser.error`, exit status 2).

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags.
    """
    # (a typed --gpu wins over ROLLOUT_DEVICE, whatever it holds: startup._device)
    device_given = parser.typed("--device") or not parser.typed("--gpu")
    if device_given and args.device is not None and not args.device.strip():  # read as unset: served on the CPU
        parser.error(f"--device {args.device!r}: empty; give {DEVICE_FORMS}, or leave it out (cpu unless --gpu)")
    check_http_only_flags(parser, args)
    if args.http is not None:
        check_http_flags(parser, args)
    lora_specs(parser, args.lora, served_model_name(args))
    if args.gpu is None and args.device in (None, "cpu"):  # a CPU worker, known before torch loads
        check_cuda_only_flags(parser, args, "cpu")
    try:
        limits = worker_limits(args)
    except ValueError as error:  # a FieldError: reported naming the flag, not the field
        parser.error(parser.flag_message(error))
    if args.model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(args.model)):
        parser.error(f"--model {args.model}: no such model directory")
    if args.served_model_name is not None and not args.served_model_name.strip():
        parser.error("--served-model-name: empty; give the name clients use, or leave it out to use --model's")
    if (args.tokenizer or "").startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(args.tokenizer)):
        parser.error(f"--tokenizer {args.tokenizer}: no such tokenizer directory")
    if args.num_blocks is not None and args.max_memory_percent is not None:  # it would size nothing
        parser.error(
            f"--max-memory-percent {args.max_memory_percent:g}: has no effect with --num-blocks {args.num_blocks} "
            "(which sizes the KV cache itself): give one of them"
        )
    try:
        config = engine_config(args)
    except ValueError as error:
        parser.error(parser.flag_message(error))
    return limits, config


def lora_specs(parser: argparse.ArgumentParser, specs: list[str], model_name: str) -> list[tuple[str, str]]:
    """The `--lora NAME=PATH` flags as (name, path) pairs; a usage error names a malformed one, a name given twice
    or one that is the served model's (`--model`, which requests name to mean the base model).

    Args:
        parser: rollout-worker's parser.
        specs: the --lora values.
        model_name: the served model's name (--served-model-name, else --model).
    """
    pairs: dict[str, str] = {}
    for spec in specs:
        name, separator, path = spec.partition("=")
        if not separator or not name or not path:
            parser.error(f"--lora {spec}: expected NAME=PATH")
        if name in pairs:
            parser.error(f"--lora {spec}: the adapter name {name!r} is given twice (also --lora {name}={pairs[name]})")
        if name == model_name:
            parser.error(
                f"--lora {spec}: {name!r} is the served model's name (--served-model-name, else --model): give the "
                "adapter another one"
            )
        pairs[name] = path
    for name, path in pairs.items():  # (after the names: a name given twice is the news, whatever its paths)
        if os.path.isdir(os.path.expanduser(path)):
            continue
        if not _hub_id(path):
            parser.error(f"--lora {name}={path}: no such directory (a PEFT adapter's, as save_pretrained writes it)")
        if _offline() and not _cached_hub_adapter(path):  # peft would fail only once the model loaded
            parser.error(
                f"--lora {name}={path}: no such directory, and no hub adapter of that id in the local Hugging Face "
                "cache (HF_HUB_OFFLINE is set): download it first, e.g. hf download ID --local-dir DIR"
            )
    return list(pairs.items())


def _hub_id(path: str) -> bool:
    """Whether a --lora PATH that is no directory may be a hub id (org/name), which peft fetches as for --model."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1 and all(path.split("/"))


def _offline() -> bool:
    """Whether the Hugging Face hub is not to be reached (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_hub_adapter(path: str) -> bool:
    """Whether the hub adapter `path` (org/name) has its adapter_config.json in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(path, "adapter_config.json"), str)
    except HFValidationError:
        return False


def check_cuda_only_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, device: str) -> None:
    """Usage errors for flags that need a CUDA device, on a worker serving on `device` (not CUDA).

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags.
        device: where the worker serves, as the message says it (e.g. "cpu").
    """
    if args.cuda_graphs == "on":
        parser.error(f"--cuda-graphs on: CUDA graphs need a CUDA device (--gpu N); this worker serves on {device}")
    if args.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(f"--attention-backend triton: the kernels run on CUDA (--gpu N); this worker serves on {device}")


def served_model_name(args: argparse.Namespace) -> str:
    """The model's name in the OpenAI API and the ZeroMQ hello: --served-model-name, else --model as given.

    Args:
        args: rollout-worker's parsed flags.
    """
    return args.served_model_name or args.model


def check_http_only_flags(parser: CliParser, args: argparse.Namespace) -> None:
    """A usage error naming an HTTP API flag typed without --http, which would ignore it silently; one set by its
    ROLLOUT_* variable is warned about instead, naming the variable (an environment may be shared by workers with
    and without the HTTP API).

    Args:
        parser: rollout-worker's parser (it knows which flags the command line gave).
        args: the parsed flags.
    """
    if args.http is not None:
        return
    for flag in HTTP_ONLY_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        if parser.typed(flag):  # even at its default: it was asked for and would do nothing
            parser.error(f"{flag}: has no effect without --http HOST:PORT (the OpenAI API is off)")
        variable = f"ROLLOUT_{dest.upper()}"
        if variable in os.environ:
            parser.warn(f"{variable} is set but {flag} has no effect without --http HOST:PORT")


def worker_limits(args: argparse.Namespace) -> WorkerLimits:
    """The per-client limits the flags give (a FieldError names a bad one).

    Args:
        args: rollout-worker's parsed flags.
    """
    return WorkerLimits(
        max_message_bytes=args.max_message_bytes,
        max_prompt_len=args.max_prompt_len,
        max_n=args.max_n,
        max_groups_per_client=args.max_groups_per_client,
        max_pending_bytes=args.max_pending_bytes,
        max_update_phase_s=args.max_update_phase_s,
        client_timeout_s=args.client_timeout,
        max_compile_s=args.max_compile_s,
        max_compile_bytes=args.max_compile_bytes,
        max_compiles_per_client=args.max_compiles_per_client,
    )


def engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine settings the flags give (a FieldError names a bad one).

    Args:
        args: rollout-worker's parsed flags.
    """
    return ContinuousBatchingConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_memory_percent=memory_fraction(args.max_memory_percent),
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        scheduler_type=args.scheduler,
        max_queue_size=args.max_queue_size,
        cpu_offload_space=args.cpu_offload_space,
        attention_backend=args.attention_backend,
        fp32_logits=args.fp32_logits,
        batch_invariant=args.batch_invariant,
        use_cuda_graph=AUTO_ON_OFF[args.cuda_graphs],
        overlap_scheduling=AUTO_ON_OFF[args.overlap],
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        **speculative_settings(args),
    )
