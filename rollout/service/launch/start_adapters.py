"""The LoRA adapters a worker serves from its start (`rollout-worker --lora NAME=PATH`): the flags checked before
the model loads (a usage error names a malformed one, a name given twice or the served model's), then each adapter
read from its PEFT directory and served; from then on no adapter may take the served model's name."""

from __future__ import annotations

import argparse
import logging
import os

from rollout.engine.engine import Engine
from rollout.engine.lora.adapter_weights import load_peft_dir

logger = logging.getLogger("rollout.worker")


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
                f"--lora {spec}: {name!r} is the served model's name (--served-model-name, else --model): give the adapter another one"
            )
        pairs[name] = path
    for name, path in pairs.items():  # (after the names: a name given twice is the news, whatever its paths)
        if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
            parser.error(f"--lora {name}={path}: no such directory (a PEFT adapter's, as save_pretrained writes it)")
    return list(pairs.items())


def serve_start_adapters(parser: argparse.ArgumentParser, specs: list[str], engine: Engine, model_name: str) -> None:
    """Serve the `--lora NAME=PATH` adapters from the start (a usage error names a bad one); from then on no adapter
    may take the served model's name (`AdapterTable.reserved_names`), pushed or loaded.

    Args:
        parser: rollout-worker's parser.
        specs: the --lora values.
        engine: the worker's engine.
        model_name: the served model's name (--served-model-name, else --model).
    """
    engine.runner.adapters.reserved_names.add(model_name)
    for name, path in lora_specs(parser, specs, model_name):
        try:
            engine.serve_adapter_from_start(name, load_peft_dir(os.path.expanduser(path)))
        except ValueError as error:
            parser.error(f"--lora {name}={path}: {error}")
        logger.info("serving LoRA adapter %s from %s", name, path)
