"""Structured outputs a client can abuse: a JSON schema whose `pattern` has a lookahead (xgrammar drops it, so a
violating string would finish with "stop"), and a grammar whose matcher state grows with the output (a nested
repetition: each token's accept and mask cost grow with the cube of the tokens so far, and every other sample's step
waits for them).

References: xgrammar's own matcher (it accepts the string the schema forbids, by `jsonschema`; it takes the time a
token's accept takes), the official `openai` client's error."""

from __future__ import annotations

import json
import re

import openai
import pytest

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch  # noqa: E402
from rollout.config import FieldError  # noqa: E402
from rollout.engine.engine import Engine  # noqa: E402
from rollout.engine.grammar import cpu_bounds  # noqa: E402
from rollout.engine.grammar.constraints import Constrained  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TOKENIZER = tiny_tokenizer()
MODEL = tiny_model(0)
INFO = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=MODEL.config.vocab_size)
PROMPT = TOKENIZER("x: ")["input_ids"]
EOS = TOKENIZER.eos_token_id
# 31 characters, compiled in a millisecond; its matcher's state grows with every "a" it accepts.
NESTED = 'root ::= ((((("a")+)+)+)+)+'
LOOKAHEAD_SCHEMAS = [
    ({"type": "string", "pattern": "^(?!foo).*$"}, '"foobar"'),
    ({"type": "string", "pattern": "(?=c)b"}, '"b"'),
    ({"type": "object", "propertyNames": {"pattern": "^(?!x)[a-z]+$"}}, '{"xa":1}'),
    (
        {"type": "object", "patternProperties": {"^(?!x).*$": {"type": "integer"}}, "additionalProperties": False},
        '{"xa":1}',
    ),
]


def xgrammar_completes(schema: dict, text: str) -> bool:
    """xgrammar's own matcher, compiled from the schema, takes `text` and then its end."""
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(INFO).compile_json_schema(json.dumps(schema)))
    tokens = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(token) for token in tokens) and matcher.accept_token(EOS)


@pytest.mark.parametrize(("schema", "violating"), LOOKAHEAD_SCHEMAS)
def test_a_pattern_lookahead_xgrammar_drops_is_refused_by_name(schema, violating):
    with pytest.raises(jsonschema.ValidationError):  # the schema forbids it ...
        jsonschema.validate(json.loads(violating), schema)
    assert xgrammar_completes(schema, violating)  # ... and xgrammar's grammar of it lets it finish
    with pytest.raises(FieldError) as refused:
        generate_batch(MODEL, [PROMPT], sampling=SamplingParams(json=schema), tokenizer=TOKENIZER, progress_bar=False)
    assert refused.value.field == "json" and "lookahead" in refused.value.reason
    assert "pattern" in refused.value.reason


def test_a_pattern_lookahead_is_a_400_naming_the_openai_field(http_worker):
    schema = LOOKAHEAD_SCHEMAS[0][0]
    response_format = {"type": "json_schema", "json_schema": {"name": "word", "schema": schema}}
    with openai.OpenAI(base_url=f"{http_worker.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "a word"}], response_format=response_format
            )
        assert refused.value.body["param"] == "response_format.json_schema.schema"
        assert "lookahead" in refused.value.body["message"]
        answer = client.chat.completions.create(  # the worker serves on, escaped and bracketed "(?!" included
            model="tiny",
            messages=[{"role": "user", "content": "a word"}],
            max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"pattern": "[(?!]\\(?!"}}},
        )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_grammar_too_slow_to_follow_ends_its_sample_and_not_the_others(monkeypatch):
    """EOS pushed away by logit_bias: the nested grammar's sample keeps taking "a"s until one token's accept costs more
    than the engine's bound; it ends with an error naming the grammar, long before max_new_tokens (whose last steps
    would take seconds each), and the other request of the batch runs to its length. The bound is lowered to a
    millisecond here, so that the test reaches it in about 40 tokens (at the engine's 20 ms it takes about 115, and 2 s
    of a core); a plain request's accepts stay far below even that."""
    monkeypatch.setattr(cpu_bounds, "MAX_ACCEPT_S", 0.001)
    engine = Engine(MODEL, ContinuousBatchingConfig(num_blocks=128, block_size=16), tokenizer=TOKENIZER)
    evil = SamplingParams(grammar=NESTED, logit_bias=((EOS, -100.0),), max_new_tokens=150, seed=0)
    engine.add_request("evil", PROMPT, evil)
    engine.add_request("plain", PROMPT, SamplingParams(max_new_tokens=150, seed=0, stop_token_ids=()))
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.is_finished:
                outputs[output.request_id] = output
    (evil_out,) = [o for rid, o in outputs.items() if rid.startswith("evil")]
    (plain_out,) = [o for rid, o in outputs.items() if rid.startswith("plain")]
    assert plain_out.finish_reason == "length" and len(plain_out.generated_tokens) == 150
    assert evil_out.finish_reason == "error" and "grammar" in evil_out.error and "CPU" in evil_out.error
    tokens = list(evil_out.generated_tokens)
    assert len(tokens) < 150
    # xgrammar's own matcher takes every token the sample drew: it was ended for its cost, not for a wrong token
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(INFO).compile_grammar(NESTED))
    assert all(matcher.accept_token(token) for token in tokens)


@pytest.mark.timeout(40)  # without its time bound, the admission check alone took 44 s of a core here
def test_the_min_new_tokens_check_of_a_nested_grammar_is_bounded():
    """The admission check walks xgrammar's matcher down one path of up to 256 tokens: on this grammar that cost 44 s
    of a core before its time bound. Admitted (the check could not decide), its sample then ends with an error."""
    engine = Engine(MODEL, ContinuousBatchingConfig(num_blocks=128, block_size=16), tokenizer=TOKENIZER)
    sampling = SamplingParams(grammar=NESTED, min_new_tokens=300, max_new_tokens=300, seed=0)
    engine.add_request("evil", PROMPT, sampling)
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.is_finished:
                outputs[output.request_id] = output
    (output,) = outputs.values()
    assert output.finish_reason == "error" and "grammar" in output.error
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(INFO).compile_grammar(NESTED))
    assert all(matcher.accept_token(token) for token in output.generated_tokens)


def test_bans_that_take_every_token_the_grammar_allows_end_the_sample_naming_them():
    """bad_words_ids banning every token xgrammar's own matcher allows first: no forbidden token, no hang, an error
    that names the bans (not only the grammar)."""
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(INFO).compile_grammar('root ::= "yes" | "no"'))
    bitmask = xgrammar.allocate_token_bitmask(1, INFO.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = [t for t in range(INFO.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and EOS not in allowed
    sampling = SamplingParams(choice=["yes", "no"], bad_words_ids=tuple((t,) for t in allowed), max_new_tokens=8)
    outputs = generate_batch(MODEL, [PROMPT], sampling=sampling, tokenizer=TOKENIZER, n=2, progress_bar=False)
    for output in outputs.values():
        assert output.finish_reason == "error" and list(output.generated_tokens) == []
        assert "choice" in output.error and "bad_words_ids" in output.error


def test_a_long_array_under_a_bounded_repetition_is_followed_to_its_end():
    """`{"type": "array", "items": {"type": "integer"}, "maxItems": 100000}` and 6,000 integers (34,890 tokens of
    the tiny tokenizer): xgrammar's matcher takes every token, in microseconds but for one accept each time the output
    about doubled, which grows a buffer (100 ms at 32,000 tokens). The sample was ended with "following the grammar
    took 26 ms of CPU at one step" after 8,300 tokens (a 2,000-item bound did it too): such an accept is a buffer's
    growth, not a grammar too slow to follow, and the sample's state stays open to its end."""
    tokenizer = TOKENIZER
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=1024)
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 100_000}
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    tokens = tokenizer(json.dumps(list(range(6000))), add_special_tokens=False)["input_ids"]
    reference = xgrammar.GrammarMatcher(compiled)
    assert all(reference.accept_token(token) for token in tokens)
    assert reference.accept_token(tokenizer.eos_token_id) and reference.is_terminated()
    state = Constrained("json", compiled)
    for token in tokens:
        state.accept(token)
        assert state.watch.too_slow is None, f"ended after {state.generated} tokens: {state.dead_end_reason()}"
    assert state.is_open and state.rejected is None


def test_a_character_no_token_spells_mid_output_ends_the_sample_naming_the_vocabulary_not_bans():
    """A regex `h(é)x`: "h" is a token of the tiny vocabulary, "é" none (by xgrammar's own matcher: after "h" it
    allows no token, and the grammar is not complete). With no bans at all, the sample ends with an error that says
    the vocabulary spells nothing the grammar accepts there, never that the request's bans took every token."""
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(INFO).compile_regex("h(é)x"))
    assert matcher.accept_token(TOKENIZER.convert_tokens_to_ids("h"))
    bitmask = xgrammar.allocate_token_bitmask(1, INFO.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    assert not bitmask.any() and not matcher.is_terminated()
    outputs = generate_batch(
        MODEL,
        [PROMPT],
        sampling=SamplingParams(regex="h(é)x", max_new_tokens=8),
        tokenizer=TOKENIZER,
        progress_bar=False,
    )
    (output,) = outputs.values()
    assert output.finish_reason == "error" and TOKENIZER.decode(output.generated_tokens) == "h"
    assert "regex" in output.error and "vocabulary" in output.error
    assert "bad_words_ids" not in output.error, output.error


@pytest.mark.parametrize(
    ("field", "spec", "text"),
    [
        ("regex", r"\Aab\Z", "AabZ"),  # Python's anchors
        ("regex", r"x\R", "xR"),  # PCRE's line break
        ("regex", r"[\h]", "h"),  # PCRE's horizontal space
        ("json", {"type": "string", "pattern": r"^ab\z"}, '"abz"'),
        ("json", {"type": "object", "patternProperties": {r"\Ax": {"type": "integer"}}}, '{"Ax": 1}'),
    ],
)
def test_an_escaped_letter_xgrammar_reads_as_the_letter_itself_is_refused_by_name(field, spec, text):
    """xgrammar reads an escape it does not know (`\\Z`, `\\A`, `\\R`, `\\h`) as the letter alone, where Python's
    `re` reads an anchor, PCRE a class, or refuses it: its own matcher takes `text`, which `re` never matches. Such a
    spec is refused naming the field, never followed as another pattern."""
    compiler = xgrammar.GrammarCompiler(INFO)
    compiled = compiler.compile_regex(spec) if field == "regex" else compiler.compile_json_schema(json.dumps(spec))
    matcher = xgrammar.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in TOKENIZER(text, add_special_tokens=False)["input_ids"])
    if field == "regex":
        assert spec in (r"[\h]", r"x\R") or re.fullmatch(spec, text) is None  # (Python's re refuses these)
    with pytest.raises(FieldError) as error:
        SamplingParams(**{field: spec})
    assert error.value.field == field and "escape" in str(error.value), error.value
