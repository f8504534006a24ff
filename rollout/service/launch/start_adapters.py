"""The LoRA adapters a worker serves from its start (`rollout-worker --lora NAME=PATH`), checked before torch loads
(`flags.lora_specs`: a usage error names a malformed one, a name given twice or the served model's), each read from
its PEFT directory and served; from then on no adapter may take the served model's name."""

from __future__ import annotations

import argparse
import logging
import os

from rollout.engine.engine import Engine
from rollout.engine.lora.adapter_weights import load_peft_dir
from rollout.service.launch.flags import lora_specs

logger = logging.getLogger("rollout.worker")


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
            served_base = getattr(engine.model, "name_or_path", None)
            engine.serve_adapter_from_start(name, load_peft_dir(os.path.expanduser(path), served_base))
        except ValueError as error:
            parser.error(f"--lora {name}={path}: {error}")
        logger.info("serving LoRA adapter %s from %s", name, path)
