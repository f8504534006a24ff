"""A scripted tool-calling model: what `rollout-worker --model tiny-agent` serves, and what the agentic tests and
examples train. A random model never emits a well-formed tool call; this one's logits really do, in its chat
template's hermes format (`<tool_call>\\n{json}\\n</tool_call>`), so TRL's tool loop runs more than one turn.

Its script, in a fresh turn (no tool result in the conversation yet): after the generation prompt it makes one of
`calls` or refuses, each as likely (with a valid and an invalid call, as in TRL's tests: a third each). Once a tool
result is in the conversation (a `<tool_response>` token anywhere before), it answers `answer` instead. Every turn
then ends with `<|im_end|>`. Sampled at temperature 1 the first-turn choice varies between the samples of a group, so GRPO has an
advantage to learn from.

How the weights spell that (one Qwen3 layer, everything else zero): each scripted token's embedding is its own
one-hot direction and the output head maps it to its successors (a bigram). One attention head finds a
`<tool_response>` token (its key is the only one along the query's direction; RoPE is made negligible by a huge
theta) and writes a "tool result seen" direction; the MLP's gate opens only where that direction and the
generation prompt's newline meet, and writes the "answer" direction the head maps to `answer`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from rollout.presets.models import TINY_MODEL_CONFIG, tiny_tokenizer

# ChatML turns with hermes tool calls (the shape of Qwen's template, short): tools in a system turn, a tool result
# as a user turn wrapped in <tool_response>. Prefix-preserving: a conversation renders as the rendering of its
# first messages followed by the rest (what TRL's multi-turn loop requires).
AGENT_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n"
    '{{ {"name": call["function"]["name"], "arguments": call["function"]["arguments"]} | tojson }}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# transformers' response parsing for that format (`tokenizer.parse_response`): content, then zero or more calls.
AGENT_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
DEFAULT_CALLS = (
    {"name": "multiply", "arguments": {"a": 3, "b": 4}},
    {"name": "multiply", "arguments": {"a": 3, "c": 4}},
)
DEFAULT_ANSWER, DEFAULT_REFUSAL = "Done!", "I won't"
AGENT_EXTRA_VOCAB = 32  # room for added words: the vocabulary size is fixed, so any script fits one worker's model
_OPEN, _CLOSE, _RESULT = "<tool_call>\n", "\n</tool_call>", "<tool_response>"
_LOGIT = 2.0  # the head's weight per unit of a normalised direction: scripted choices lead every other token by ~30
_NORMALISED = TINY_MODEL_CONFIG["hidden_size"] ** 0.5  # a one-hot direction after the final norm


def agent_tokenizer(calls: Any = DEFAULT_CALLS, answer: str = DEFAULT_ANSWER, refusal: str = DEFAULT_REFUSAL):
    """The tiny tokenizer with the agent's chat template and response parsing, and one added word per scripted
    piece (a call's whole JSON is one token, so a bigram can spell it).

    Args:
        calls: the tool calls the model makes, as {"name": ..., "arguments": {...}} dicts, or as the text between
            the call's tags (e.g. malformed JSON).
        answer: what it says once a tool result is in the conversation.
        refusal: what it says instead of calling a tool.
    Raises:
        ValueError: no call or too many, or a piece that is empty, repeats another, or is already a token (named).
    """
    tokenizer = tiny_tokenizer()
    named = [("answer", answer), ("refusal", refusal), *((f"calls[{i}]", _call_text(c)) for i, c in enumerate(calls))]
    words = [_OPEN, _CLOSE, _RESULT, "</tool_response>"]
    if not calls or len(words) + len(named) > AGENT_EXTRA_VOCAB:
        raise ValueError(f"calls: the scripted agent takes 1 to {AGENT_EXTRA_VOCAB - 6} calls, got {len(calls)}")
    for name, text in named:
        # a piece must be a word of its own (one token the script can map), new to the tokenizer
        if (
            not isinstance(text, str)
            or not text
            or text in words
            or tokenizer.convert_tokens_to_ids(text) != tokenizer.unk_token_id
        ):
            raise ValueError(f"{name}: {text!r} is empty, repeats another piece, or is already a token")
        words.append(text)
    tokenizer.add_tokens(words)
    tokenizer.eos_token = "<|im_end|>"  # a chat model ends its turn there (as Qwen's instruct tokenizers say)
    tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    tokenizer.response_template = AGENT_RESPONSE_TEMPLATE
    return tokenizer


def scripted_agent(
    calls: Any = DEFAULT_CALLS,
    answer: str = DEFAULT_ANSWER,
    refusal: str = DEFAULT_REFUSAL,
    noise: float = 0.0,
    seed: int = 0,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """(model, tokenizer) following the module's script; the same architecture and vocabulary size for any script,
    so one worker serving `--model tiny-agent` serves another script once a trainer pushes its weights.

    Args:
        calls: the tool calls the model makes (as `agent_tokenizer` takes them).
        answer: what it says once a tool result is in the conversation.
        refusal: what it says instead of calling a tool.
        noise: standard deviation of random weights under the script (0: exact zeros). With noise every weight
            takes part in the forward and log-probs are not round numbers, so a train/inference mismatch shows; the
            script still decides every choice (its logits lead by ~30).
        seed: the noise's seed (the caller's RNG is left alone).
    """
    tokenizer = agent_tokenizer(calls, answer, refusal)
    word = tokenizer.convert_tokens_to_ids
    newline, end = word("\n"), word("<|im_end|>")
    call_ids = [word(_call_text(call)) for call in calls]
    successors = {newline: [word(_OPEN), word(refusal)], word(_OPEN): call_ids, word(answer): [end]}
    successors[word(refusal)] = [end]
    successors.update({call: [word(_CLOSE)] for call in call_ids})
    successors[word(_CLOSE)] = [end]
    config = Qwen3Config(
        **{
            **TINY_MODEL_CONFIG,
            "vocab_size": TINY_MODEL_CONFIG["vocab_size"] + AGENT_EXTRA_VOCAB,
            "num_hidden_layers": 1,
        },
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e12},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end,
    )
    with torch.random.fork_rng(devices=[]):  # its random init, all overwritten below, leaves the caller's RNG alone
        model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = end  # a chat model's turn ends at <|im_end|>
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in model.named_parameters():
            if "norm" not in name:  # norms stay one
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * noise)
        _write_script(model, config, successors, word(_RESULT), newline, word(answer))
        # Each call as likely as the refusal: the opening tag leads the refusal by log(number of calls).
        model.lm_head.weight[word(_OPEN), list(successors).index(newline)] += math.log(len(calls)) / _NORMALISED
    return model, tokenizer


def _call_text(call: Any) -> str:
    return call if isinstance(call, str) else json.dumps(call)


def _write_script(
    model: Qwen3ForCausalLM,
    config: Qwen3Config,
    successors: dict[int, list[int]],
    result: int,
    newline: int,
    answer: int,
) -> None:
    """Set the weights (zero or small noise before, norms one) that follow the script; see the module docstring."""
    hidden, head = config.hidden_size, config.head_dim
    seen, answering, marker = hidden - 1, hidden - 2, hidden - 3  # directions no scripted token uses
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    # No token but the script's own has a component along the script's directions: the norm would blow a noise
    # component up to ~1 and make any token look like a tool result.
    embed[:, : len(successors)] = 0.0
    embed[:, marker:] = 0.0
    for direction, token in enumerate(successors):
        embed[token, direction] = 1.0
        for following in successors[token]:
            lm_head[following, direction] = _LOGIT
    embed[result, marker] = 1.0
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    # Head 0: every query points along dim `head - 1` of the head (the pair RoPE turns least); only the marker's key
    # does (a bias gives every other key a direction of its own, so the key norm cannot blow it up).
    attention.q_proj.bias[head - 1] = 1.0
    attention.q_norm.weight[head - 1] = 4.0  # score 4 * sqrt(head) for the marker, 0 for any other token
    attention.k_proj.weight[head - 1, marker] = 1.0
    attention.k_proj.bias[head - 2] = 1e-2
    attention.v_proj.weight[0, marker] = 1.0 / hidden**0.5  # the marker's normalised input is sqrt(hidden)
    attention.o_proj.weight[seen, 0] = 1.0
    # MLP: silu(gate: "seen" - half the newline) * (up: the newline) -> "answering": open only where both are there
    # (after the norm both are ~11 there; without a tool result "seen" is ~0 and the gate is shut, silu(-8) ~ 0).
    newline_direction = list(successors).index(newline)
    mlp.gate_proj.weight[0, seen] = 1.0
    mlp.gate_proj.weight[0, newline_direction] = -0.5
    mlp.up_proj.weight[0, newline_direction] = 1.0
    mlp.down_proj.weight[answering, 0] = 0.25
    lm_head[answer, answering] = 2 * _LOGIT
