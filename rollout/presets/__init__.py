"""Built-in models, tokenizers and a toy task that need no download: what `rollout-worker --model tiny` serves, what
the tests and examples run on.

In the order a worker reads them:

- `catalog`: the preset names (`PRESETS`, `is_preset`) and the tiny model's config, without torch.
- `names`: a model and its tokenizer from a preset name (`model_from_preset`, `tokenizer_for`).
- `models`: `tiny_tokenizer`, `tiny_model`, `tiny_moe_model`, `sized_model`, `random_model`.
- `agent`: `scripted_agent`, a tiny model that follows a script of tool calls, and `agent_tokenizer`.
- `toy_grpo`: the main job's task (`toy_grpo_config`, `toy_prompts`, `letter_reward`).

Every public name is importable from `rollout.presets` itself (loaded on first use: `import rollout.presets` needs no
torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PRESETS": "rollout.presets.catalog",
    "TINY_MODEL_CONFIG": "rollout.presets.catalog",
    "is_preset": "rollout.presets.catalog",
    "model_from_preset": "rollout.presets.names",
    "tokenizer_for": "rollout.presets.names",
    "MODEL_DTYPES": "rollout.presets.models",
    "tiny_tokenizer": "rollout.presets.models",
    "tiny_model": "rollout.presets.models",
    "tiny_moe_model": "rollout.presets.models",
    "sized_model": "rollout.presets.models",
    "random_model": "rollout.presets.models",
    "agent_tokenizer": "rollout.presets.agent",
    "scripted_agent": "rollout.presets.agent",
    "toy_grpo_config": "rollout.presets.toy_grpo",
    "toy_prompts": "rollout.presets.toy_grpo",
    "letter_reward": "rollout.presets.toy_grpo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rollout.presets' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
