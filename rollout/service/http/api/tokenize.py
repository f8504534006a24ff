"""vLLM's /tokenize and /detokenize: a prompt (text, or chat messages through the chat template) to token ids, and
token ids to text. Both parse and check their bodies on worker threads, never on the event loop that streams every
answer, and both are capped as the generation endpoints are (the prompt's characters before tokenizing, its tokens
after)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.engine.requests.adapter_ref import AdapterRef
from rollout.service.http.api.prompts import PromptLimits, chat_prompt, needs_tokenizer
from rollout.service.http.api.served_models import requested_adapter
from rollout.service.http.errors import APIError, bad_field

TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
}
CHAT_ONLY_FIELDS = TOKENIZE_FIELDS - {"model", "prompt", "messages", "add_special_tokens"}
DETOKENIZE_FIELDS = {"model", "tokens"}


class TokenizeEndpoints:
    """/tokenize and /detokenize over the worker's tokenizer (call both off the event loop)."""

    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        limits: PromptLimits,
        adapters: Mapping[str, AdapterRef] | None = None,
    ):
        """
        Args:
            tokenizer: the worker's tokenizer (None: both answer 400).
            model_name: the served model's name (`model` must be it, one of `adapters`, or absent).
            adapters: the served LoRA adapters by name.
            vocab_size: token ids must be below it.
            max_model_len: the longest sequence the engine runs (the most ids /detokenize decodes at once).
            limits: the longest prompt, and whether a request may bring its own chat template.
        """
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.adapters = {} if adapters is None else adapters  # the served LoRA adapters (same tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits

    def tokenize(self, body: Any) -> list[int]:
        """The token ids of a /tokenize body (parsed JSON).

        Raises:
            APIError: a malformed body, a field it does not take, or a prompt over the worker's limits.
        """
        body = self._body(body, "/tokenize", TOKENIZE_FIELDS)
        if "messages" in body:
            extra = sorted({"prompt", "add_special_tokens"} & set(body))
            if extra:
                raise bad_field(extra[0], "not used with messages (the chat template decides special tokens)")
            return self._capped("messages", chat_prompt(body, self.tokenizer, self.limits))
        extra = sorted(CHAT_ONLY_FIELDS & set(body))
        if extra:
            raise bad_field(extra[0], "only used with messages")
        prompt, add_special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str):
            raise bad_field("prompt", "give a string prompt, or messages")
        if not isinstance(add_special, bool):
            raise bad_field("add_special_tokens", "must be a boolean")
        if len(prompt) > self.limits.max_chars:
            raise APIError(
                400, f"prompt: over {self.limits.max_chars} characters", "prompt", code="context_length_exceeded"
            )
        try:
            ids = list(self.tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
        except Exception as error:  # noqa: BLE001 - text the tokenizer cannot take
            raise bad_field("prompt", f"the tokenizer cannot encode it: {type(error).__name__}") from None
        return self._capped("prompt", ids)

    def detokenize(self, body: Any) -> str:
        """The text of a /detokenize body's token ids (parsed JSON).

        Raises:
            APIError: a malformed body, or ids that are not the vocabulary's.
        """
        body = self._body(body, "/detokenize", DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        vocab = self.vocab_size
        if isinstance(tokens, list) and len(tokens) > self.max_model_len:  # before reading a huge list through
            reason = f"{len(tokens)} ids; this worker decodes at most {self.max_model_len} (its max_model_len) at once"
            raise bad_field("tokens", reason)
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise bad_field("tokens", f"must be a list of token ids in [0, {vocab})")
        try:
            return self.tokenizer.decode(tokens)
        except Exception as error:  # noqa: BLE001 - ids the tokenizer cannot take (as /tokenize's text it cannot)
            raise bad_field("tokens", f"the tokenizer cannot decode them: {type(error).__name__}") from None

    def _body(self, body: Any, path: str, known: set[str]) -> dict[str, Any]:
        needs_tokenizer(self.tokenizer, path)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - known)
        if unknown:
            raise bad_field(unknown[0], "unknown field")
        requested_adapter(body.get("model"), self.model_name, self.adapters)
        return body

    def _capped(self, field: str, ids: list[int]) -> list[int]:
        if len(ids) > self.limits.max_prompt_len:
            reason = f"is {len(ids)} tokens; this worker takes at most {self.limits.max_prompt_len}"
            raise APIError(400, f"{field}: {reason}", field, code="context_length_exceeded")
        return ids
