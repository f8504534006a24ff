"""vLLM's `GET /tokenizer_info` (`--enable-tokenizer-info-endpoint`): the tokenizer's settings as its
`tokenizer_config.json` holds them (special tokens as text, `model_max_length`, `added_tokens_decoder`, ...), with its
class and chat template, so that a client can tokenize as the worker does without the files (lm-eval's
`tokenizer_backend=remote`)."""

from __future__ import annotations

import math
from typing import Any

from rollout.service.http.errors import APIError

# File paths of the worker's machine, meaningless to a client (vLLM leaves them out too).
PATH_SETTINGS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The body of `GET /tokenizer_info`.

    Raises:
        APIError: 400 when the worker has no tokenizer.
    """
    if tokenizer is None:
        raise APIError(400, "this worker has no tokenizer (start it with --tokenizer)", None)
    settings = dict(getattr(tokenizer, "init_kwargs", None) or {})
    added = settings.pop("added_tokens_decoder", None)
    info = {key: _plain(value) for key, value in settings.items()}
    if isinstance(added, dict):  # token id -> {"content", "special", ...}, as tokenizer_config.json has it
        info["added_tokens_decoder"] = {str(index): _added_token(token) for index, token in added.items()}
    for key in PATH_SETTINGS:
        info.pop(key, None)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # the tokenizer's own, if set after loading
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            info[name] = value
    length = info.get("model_max_length")
    if isinstance(length, float):  # transformers' "no limit" is 1e30: a JSON integer as vLLM's schema has it
        info["model_max_length"] = int(length) if math.isfinite(length) else None
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template.strip():
        info["chat_template"] = template
    return info


def _added_token(token: Any) -> dict[str, Any]:
    """An entry of `added_tokens_decoder` (an AddedToken) as tokenizer_config.json writes it."""
    if isinstance(token, dict):
        return {str(key): _plain(value) for key, value in token.items()}
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {field: _plain(getattr(token, field)) for field in fields if hasattr(token, field)}


def _plain(value: Any) -> Any:
    """A setting as JSON holds it: an AddedToken as its text."""
    if hasattr(value, "content") and hasattr(value, "special"):
        return str(value.content)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
