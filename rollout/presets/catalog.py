"""The built-in models (presets) as data, free of torch: the names `rollout-worker --model` takes and the tiny
preset's shape. `presets.py` builds the models; `preset_names.py` picks one by name. Kept apart so that a parser (and
`--help`) or a benchmark's workload table reads them without loading torch."""

from __future__ import annotations

PRESETS = ("tiny", "tiny-moe", "tiny-agent", "sized:<MB>")

# The "tiny" preset's shape, which is also the cpu-small benchmark model (docs/concepts/architecture.md, Benchmark workloads).
TINY_MODEL_CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)


def is_preset(name: str) -> bool:
    """Whether `name` is one of the built-in models (`PRESETS`).

    Args:
        name: a `--model` value.
    """
    return name in PRESETS or name.startswith("sized:")
