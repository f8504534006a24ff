"""The min_new_tokens admission check of a constraint (`rollout/engine/grammar/checks.py`) whatever the request's
stop tokens: the engine ends a sample whose grammar completed (it accepted the grammar's end token) even when that
token is not one of the request's stop tokens, so a grammar whose every output ends before min_new_tokens is refused
by name with `stop_token_ids` empty or other tokens too, never answered with outputs shorter than min_new_tokens.

Reference: xgrammar's own matcher, walked over every path of the small grammars here."""

from __future__ import annotations

import itertools
import json
import string

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

xgrammar = pytest.importorskip("xgrammar")

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch  # noqa: E402
from rollout.config import FieldError  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402

TOKENIZER = tiny_tokenizer()
MODEL = tiny_model(0)
PROMPT = TOKENIZER("pick: ")["input_ids"]
OTHER_STOP = TOKENIZER("z", add_special_tokens=False)["input_ids"][-1]  # a stop token that is not the grammar's end


def run(**sampling) -> list:
    outputs = generate_batch(
        MODEL,
        [PROMPT],
        sampling=SamplingParams(seed=1, max_new_tokens=12, **sampling),
        tokenizer=TOKENIZER,
        n=4,
        progress_bar=False,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, block_size=16),
    )
    return list(outputs.values())


def longest_output(choices: list[str]) -> int:
    """The most tokens (the end token included) any output of the choice grammar has, by xgrammar's matcher."""
    info = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=MODEL.config.vocab_size)
    grammar = xgrammar.GrammarCompiler(info).compile_grammar("root ::= " + " | ".join(f'"{c}"' for c in choices))
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def deepest() -> int:
        if matcher.is_terminated():
            return 0
        matcher.fill_next_token_bitmask(bitmask)
        allowed = [t for t in range(info.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1]
        best = 0
        for token in allowed:
            assert matcher.accept_token(token)
            best = max(best, 1 + deepest())
            matcher.rollback(1)
        return best

    return deepest()


@pytest.mark.parametrize("stops", [None, (), (OTHER_STOP,)], ids=["default", "none", "other"])
def test_a_grammar_whose_every_output_ends_before_min_new_tokens_is_refused_whatever_the_stop_tokens(stops):
    assert longest_output(["a"]) <= 2  # "a" then the end token: no output reaches 3 tokens
    extra = {} if stops is None else {"stop_token_ids": stops}
    with pytest.raises(FieldError) as refused:
        run(choice=["a"], min_new_tokens=3, **extra)
    assert refused.value.field == "choice" and "min_tokens=3" in str(refused.value)


@pytest.mark.parametrize("stops", [(), (OTHER_STOP,)], ids=["none", "other"])
def test_a_grammar_with_a_long_enough_output_is_admitted_and_followed(stops):
    choices = ["a", "abcdefghij"]
    assert longest_output(choices) >= 4
    info = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=MODEL.config.vocab_size)
    grammar = xgrammar.GrammarCompiler(info).compile_grammar("root ::= " + " | ".join(f'"{c}"' for c in choices))
    outputs = run(choice=choices, min_new_tokens=3, stop_token_ids=stops)
    for output in outputs:  # each a complete output, min_new_tokens tokens before its end token: none took "a"
        matcher = xgrammar.GrammarMatcher(grammar)
        assert all(matcher.accept_token(token) for token in output.generated_tokens)
        assert output.finish_reason == "stop", (output.finish_reason, output.generated_tokens, output.error)
        assert matcher.is_terminated() and len(output.generated_tokens) > 3, output.generated_tokens


def grammar_of(choices: list[str]):
    info = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=MODEL.config.vocab_size)
    return xgrammar.GrammarCompiler(info).compile_grammar("root ::= " + " | ".join(f'"{c}"' for c in choices))


@pytest.mark.parametrize("stops", [None, ()], ids=["default", "none"])
def test_a_sample_never_takes_a_branch_that_ends_before_min_new_tokens(stops):
    """ "y" favoured (logit_bias) after "x": without the look-ahead every sample took "xy", then had only the end
    left, masked until min_new_tokens, and ended with an error. Each output is one xgrammar's matcher accepts whole,
    with min_new_tokens tokens before its end."""
    choices = ["xy", "xzzzzzzzzz"]
    y = TOKENIZER("y", add_special_tokens=False)["input_ids"][-1]
    matcher = xgrammar.GrammarMatcher(grammar_of(choices))
    assert matcher.accept_token(TOKENIZER("x", add_special_tokens=False)["input_ids"][-1]) and matcher.accept_token(y)
    assert not matcher.accept_token(TOKENIZER("z", add_special_tokens=False)["input_ids"][-1])  # "xy" is a dead end
    extra = {} if stops is None else {"stop_token_ids": stops}
    for output in run(choice=choices, min_new_tokens=4, logit_bias={y: 50.0}, **extra):
        assert output.finish_reason == "stop", (output.generated_tokens, output.error)
        matcher = xgrammar.GrammarMatcher(grammar_of(choices))
        assert all(matcher.accept_token(token) for token in output.generated_tokens) and matcher.is_terminated()
        assert TOKENIZER.decode(output.generated_tokens[:-1]) == "xzzzzzzzzz" and len(output.generated_tokens) > 4


def test_where_the_look_ahead_does_not_search_a_dead_end_is_an_error_naming_min_tokens(monkeypatch):
    """A grammar allowing more tokens than the look-ahead searches (here: any) is not pruned: a sample that takes a
    branch ending sooner ends with an error naming the grammar and min_tokens, never with a short output."""
    from rollout.engine.grammar import length_goal

    monkeypatch.setattr(length_goal, "MAX_CANDIDATES", 0)
    y = TOKENIZER("y", add_special_tokens=False)["input_ids"][-1]
    for output in run(choice=["xy", "xzzzzzzzzz"], min_new_tokens=4, logit_bias={y: 50.0}):
        assert output.finish_reason == "error", output.generated_tokens
        assert "choice: the grammar allows no token" in output.error and "min_tokens=4" in output.error


def test_a_schema_dict_whose_text_is_over_the_limit_is_refused_for_its_length():
    """The dict's size estimate counts no quotes or separators: its written text is measured too."""
    names = [f"p{i:04d}" for i in range(2000)]
    schema = {"type": "object", "properties": {name: {"type": "integer"} for name in names}, "required": names}
    for spec in (schema, json.dumps(schema)):
        assert len(json.dumps(spec if isinstance(spec, dict) else json.loads(spec))) > 65536
        with pytest.raises(FieldError, match="json: the schema's JSON text is longer than 65536 characters"):
            SamplingParams(json=spec)


@pytest.mark.parametrize("stops", [(), (OTHER_STOP,)], ids=["none", "other"])
def test_the_grammars_end_token_waits_for_min_new_tokens_like_a_stop_token(stops):
    """The end token favoured (logit_bias) right after "a": without its mask every sample would end there, two
    tokens long, short of min_new_tokens, since the grammar completing ends a sample whatever its stop tokens."""
    end = TOKENIZER.eos_token_id
    choices = ["a", "abcdefghij"]
    for output in run(choice=choices, min_new_tokens=3, stop_token_ids=stops, logit_bias={end: 50.0}):
        assert output.finish_reason == "stop" and output.generated_tokens[-1] == end, output.generated_tokens
        assert len(output.generated_tokens) > 3, output.generated_tokens  # three tokens came before its end
        assert TOKENIZER.decode(output.generated_tokens[:-1]) == "abcdefghij"


def large_tokenizer(vocab_size: int):
    """A tokenizer of `vocab_size` tokens (Qwen's size below): the tiny one's characters, then every string of 2 to
    4 of 42 characters (letters, digits, JSON's punctuation): a JSON string allows most of them."""
    tokens = ["<pad>", "<bos>", "<eos>", "<unk>", *string.printable[:95], "\n"]
    alphabet = string.ascii_lowercase + ' "{}:,0123456789'
    words = ("".join(p) for size in (2, 3, 4) for p in itertools.product(alphabet, repeat=size))
    tokens += list(itertools.islice(words, vocab_size - len(tokens)))
    backend = Tokenizer(models.WordLevel({token: index for index, token in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def test_the_look_ahead_on_a_large_vocabulary_masks_only_the_dead_end():
    """152k tokens: 8 rows of the choice ["xy", "xzzzzzzzzz"] after "x" (min_new_tokens 4), 64 rows of a JSON
    schema at its start and 64 inside one of its strings (min_new_tokens 50): "y" is masked in every choice row,
    where xgrammar's matcher says only the end follows it, whatever the JSON rows beside them (each row's search has
    its own bound), and nothing else is (every JSON path can be made long enough): the other bits are xgrammar's
    own. (What the look-ahead costs a step is measured by `rollout-bench structured`, not here.)"""
    from rollout.engine.grammar.constraints import Constrained, GrammarMasks, Grammars

    vocab = 151936
    tokenizer, grammars = large_tokenizer(vocab), Grammars()
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})

    def rows(field, spec, count, min_tokens, prefix):
        compiled = grammars.compile(tokenizer, vocab, field, spec, min_tokens, frozenset())
        ends = frozenset(compiled.tokenizer_info.stop_token_ids)
        states = []
        for _ in range(count):
            state = Constrained(field, compiled)
            state.goal = grammars.length_goal(tokenizer, vocab, min_tokens, ends)
            for token in ids(prefix):
                state.advance(token)
            states.append(state)
        return states

    choice = ("xy", "xzzzzzzzzz")
    states = (
        rows("choice", choice, 8, 4, "x")
        + rows("json", schema, 64, 50, "")
        + rows("json", schema, 64, 50, '{"name": "ab')
    )
    bitmask, _ = GrammarMasks().fill(states, vocab, False)
    reference = xgrammar.allocate_token_bitmask(len(states), vocab)
    for row, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(reference, row)
    y = ids("y")[0]
    matcher = xgrammar.GrammarMatcher(states[0].compiled)
    assert matcher.accept_token(ids("x")[0]) and y in allowed_next(matcher, vocab)
    assert matcher.accept_token(y) and set(allowed_next(matcher, vocab)) <= set(matcher.stop_token_ids)  # the end
    expected = reference.clone()
    expected[:8].numpy().view(np.uint32)[:, y // 32] &= ~np.uint32(1 << (y % 32))
    assert torch.equal(bitmask, expected)


def allowed_next(matcher, vocab: int) -> list[int]:
    """The tokens xgrammar's matcher allows next."""
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    return np.flatnonzero(np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]).tolist()


def test_a_schema_dicts_properties_are_generated_in_the_order_it_declares_them():
    """xgrammar (as vLLM and OpenAI) writes an object's properties in the schema's order: "reasoning" before "answer"
    is what the schema asks, and a dict schema must not be reordered on its way (its keys were sorted)."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string", "maxLength": 3}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    outputs = generate_batch(
        MODEL,
        [PROMPT],
        sampling=SamplingParams(json=schema, seed=0, max_new_tokens=60),
        tokenizer=TOKENIZER,
        n=3,
        progress_bar=False,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, block_size=16),
    )
    finished = [o for o in outputs.values() if o.finish_reason == "stop"]
    assert finished
    for output in finished:
        text = TOKENIZER.decode(output.generated_tokens, skip_special_tokens=True)
        assert [key for key, _ in json.loads(text, object_pairs_hook=list)] == ["reasoning", "answer"], text
