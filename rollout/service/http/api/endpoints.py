"""/v1/completions and /v1/chat/completions: a request body in, an OpenAI answer (or a stream of server-sent
events) out, every choice carrying rollout's `policy_versions` and `kv_version_min` (and, with `return_token_ids`,
vLLM's `prompt_token_ids` and `token_ids`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.sampling_params import MAX_SERVED_LOGPROBS
from rollout.service.compile.constraint_compiles import ConstraintCompiles
from rollout.service.group_counters import GroupCounters
from rollout.service.http.api import openai_fields as fields
from rollout.service.http.api.answer_size import check_answer_size
from rollout.service.http.api.answers import Answer, AnswerWriter
from rollout.service.http.api.bridge import Submission
from rollout.service.http.api.choices import LogprobFormat
from rollout.service.http.api.constraint_wait import client_address, compile_constraint
from rollout.service.http.api.prompt_scoring import PromptScoring
from rollout.service.http.api.prompts import PromptLimits, chat_prompt, completion_prompts, needs_tokenizer, tool_spec
from rollout.service.http.api.served_models import requested_adapter
from rollout.service.http.api.structured_fields import structured_request
from rollout.service.http.errors import APIError, bad_field
from rollout.service.http.tools.chat_tools import tool_calling
from rollout.service.observability.tracing import Tracer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the context)


class OpenAIEndpoints:
    """The two generation endpoints over one engine manager."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        model_name: str,
        tokenizer: Any,
        max_n: int,
        max_prompt_len: int,
        max_answer_logprobs: int,
        trust_request_chat_template: bool = False,
        counters: GroupCounters | None = None,
        tool_call_parser: str | None = None,
        compiles: ConstraintCompiles | None = None,
        model_defaults: bool = True,
    ):
        """
        Args:
            manager: the worker's engine manager (shared with the ZeroMQ socket).
            model_name: the served model's name (`model` must be it, or absent).
            tokenizer: the worker's tokenizer (None: these endpoints answer 400).
            max_n: most samples per request (the worker's --max-n): `n` times the number of prompts.
            max_prompt_len: longest prompt in tokens.
            trust_request_chat_template: accept a chat template in a request's `chat_template_kwargs` (a template
                is code that runs on the worker: off unless the operator trusts every client).
            counters: the worker's group counters (None: a fresh set).
            tool_call_parser: how chat answers' tool calls are read (`tool_calls.TOOL_CALL_PARSERS`; None: chat
                requests that ask for tool calls are refused).
            max_answer_logprobs: most log-prob entries a whole answer may hold (`answer_size.check_answer_size`).
            compiles: the worker's compile slots, shared with its ZeroMQ socket (None: slots of these endpoints' own,
                closed by `close`).
            model_defaults: a request that leaves a sampling field out takes the model's generation config's value
                (`openai_fields.MODEL_DEFAULT_FIELDS`, as vLLM's --generation-config auto); False: OpenAI's defaults.
        """
        self.manager = manager
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_n = max_n
        self.max_prompt_len = min(max_prompt_len, manager.engine.max_model_len - 1)
        self.limits = PromptLimits(self.max_prompt_len, trust_request_chat_template)
        self.format = LogprobFormat(tokenizer) if tokenizer is not None else None
        self.answers = AnswerWriter(self.format, tokenizer)  # the answers' bodies and event streams
        self.counters = GroupCounters() if counters is None else counters
        self.tracer = Tracer()  # a rollout.group span per group, as ZeroMQ groups get (no-op without OpenTelemetry)
        self.tool_call_parser = tool_call_parser
        self.max_answer_logprobs = max_answer_logprobs
        # The sampling settings of the model's generation_config.json, for requests that leave them out (as vLLM)
        engine = manager.engine
        self.model_defaults = fields.model_sampling_defaults(engine.model, engine.vocab_size) if model_defaults else {}
        self._own_compiles = compiles is None
        self.compiles = ConstraintCompiles(manager.engine.intake) if compiles is None else compiles

    # ---- requests -------------------------------------------------------------------------------------------------
    def prepare(self, body: Any, chat: bool, client: str = "http") -> Answer:
        """Check a body and tokenize its prompts (slow work: call it off the event loop); `Answer.start` then adds
        its groups to the engine.

        Args:
            body: the parsed request body.
            chat: a /v1/chat/completions body (else /v1/completions).
            client: who the request's groups take admission turns as (`Submission`'s `client`).

        Raises:
            APIError: anything wrong with it, naming the field.
        """
        body = fields.check_fields(body, fields.CHAT_FIELDS if chat else fields.COMPLETION_FIELDS)
        needs_tokenizer(self.tokenizer, "/v1/chat/completions" if chat else "/v1/completions")
        model = body.get("model")
        adapters = self.manager.engine.runner.adapters
        adapter = requested_adapter(model, self.model_name, adapters.refs, adapters.retired)
        prompt_field = "messages" if chat else "prompt"
        n = fields.integer(body, "n", 1, 1, self.max_n)
        parallel = body.get("parallel_tool_calls") is not False  # (a boolean or null: checked by check_fields)
        tools = tool_calling(tool_spec(body), self.tool_call_parser, parallel) if chat else None
        if chat:
            prompts = [chat_prompt(body, self.tokenizer, self.limits)]
        else:
            prompts = completion_prompts(body, self.tokenizer, self.limits)
        if len(prompts) * n > self.max_n:
            reason = f"{len(prompts)} prompts x n={n} samples; this worker takes at most {self.max_n} per request"
            raise bad_field("n", reason)
        engine = self.manager.engine
        queue_limit = engine.config.max_queue_size  # (a prompt is a group: a batch over it could never be queued)
        if queue_limit and len(prompts) > queue_limit:
            reason = (
                f"{len(prompts)} prompts; this worker queues at most {queue_limit} at once (its --max-queue-size), "
                f"so the batch could never be taken: send at most {queue_limit} prompts per request"
            )
            raise bad_field("prompt", reason)
        # A sample's tokens (but its last, never fed back) must fit the context and the whole KV cache: more is
        # refused here by name, never left to fail in the engine (a 500).
        kv_tokens = engine.num_blocks * self.manager.config.block_size
        context = self.context_len
        # A prompt needs one token of room (a scored prompt's every token is written to the KV cache, as is a
        # sampled one's last prompt token): a longer one is the prompt's fault, never a max_tokens range of [1, -n].
        longest = min(self.max_prompt_len, context - 1)
        for prompt in prompts:
            if len(prompt) > longest:
                kv_note = f" (its KV cache holds {kv_tokens} tokens)" if longest < self.max_prompt_len else ""
                reason = f"is {len(prompt)} tokens; this worker takes at most {longest}{kv_note}"
                raise APIError(400, f"{prompt_field}: {reason}", prompt_field, code="context_length_exceeded")
        room = context - max(len(prompt) for prompt in prompts)  # tokens the longest prompt leaves in the context
        scoring = None
        if chat:
            max_tokens = fields.integer(body, "max_tokens", room, 1, room)
            max_tokens = fields.integer(body, "max_completion_tokens", max_tokens, 1, room)
            logprobs = self._chat_logprobs(body)
        else:
            scoring = PromptScoring.of(body)
            least = 0 if scoring.scores_prompts else 1  # echo / prompt_logprobs may score the prompt only
            if least and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int:
                reason = (
                    f"0 scores the prompt only, which needs echo or prompt_logprobs; else it must be in [1, {room}]"
                )
                raise bad_field("max_tokens", reason)
            max_tokens = fields.integer(body, "max_tokens", min(DEFAULT_COMPLETION_MAX_TOKENS, room), least, room)
            logprobs = fields.integer(body, "logprobs", None, 0, MAX_SERVED_LOGPROBS)
            if fields.integer(body, "best_of", n, 1) != n:
                raise bad_field("best_of", "only best_of = n (or unset) is supported")
        if logprobs is not None and not self.manager.config.return_logprobs:
            raise bad_field("logprobs", "this worker computes no log-probs (return_logprobs=False)")
        stream, include_usage = fields.stream_settings(body)
        default_stops = self.manager.engine.intake.default_sampling.stop_token_ids or ()
        prompt_top = scoring.engine_top(logprobs, max_tokens) if scoring is not None else None
        sampling = fields.sampling_from(
            body,
            tuple(default_stops),
            max_tokens,
            logprobs or 0,
            prompt_field,
            prompt_logprobs=prompt_top,
            model_defaults=self.model_defaults,
        )
        request = fields.GenerationRequest(
            prompts, sampling, n, stream, include_usage, logprobs, fields.flag(body, "return_token_ids"), scoring
        )
        check_answer_size(request, chat, self.max_answer_logprobs)
        named_stops = frozenset(body.get("stop_token_ids") or ())  # checked as token ids by sampling_from
        submission = Submission(
            self.manager,
            prompts,
            sampling,
            n,
            self.tokenizer,
            self.counters,
            named_stops,
            adapter,
            self.tracer,
            stream,
            client,
        )
        prefix = "chatcmpl" if chat else "cmpl"
        answer_id = f"{prefix}-{uuid.uuid4().hex}"
        answer = Answer(chat, request, submission, answer_id, int(time.time()), tools, adapter or self.model_name)
        answer.constraint_param = structured_request(body).param  # the client's name of its constraint, if any
        return answer

    async def compile(self, answer: Answer, request: Any = None) -> None:
        """Compile a request's structured-output constraint in the compile slots, in turn with other clients and
        within the worker's budget (constraint_wait.py); the engine then finds it in its cache.

        Args:
            answer: the prepared request.
            request: the HTTP request (its client's address takes the turn; a client that leaves abandons it).
        Raises:
            APIError: 400 naming the client's field (a spec that does not compile, in the budget or at all, or that
                no sample can follow), 503 busy (too many compiles waiting).
        """
        if answer.constraint_param is None:
            return
        disconnected = getattr(request, "is_disconnected", None)
        await compile_constraint(
            self.compiles, answer.request.sampling, answer.constraint_param, client_address(request), disconnected
        )

    @property
    def context_len(self) -> int:
        """The longest sample this worker runs, in tokens: its max_model_len, or what its whole KV cache holds (plus
        the last sampled token, never fed back) when that is less. What /v1/models reports as `max_model_len`."""
        engine = self.manager.engine
        return min(engine.max_model_len, engine.num_blocks * self.manager.config.block_size + 1)

    def close(self) -> None:
        """Stop the compile slots, if they are these endpoints' own (a compile in this process is waited for)."""
        if self._own_compiles:
            self.compiles.close()

    @staticmethod
    def _chat_logprobs(body: dict[str, Any]) -> int | None:
        wanted = fields.flag(body, "logprobs")
        top = fields.integer(body, "top_logprobs", 0, 0, MAX_SERVED_LOGPROBS)
        if top and not wanted:
            raise bad_field("top_logprobs", "needs logprobs=true")
        return top if wanted else None
