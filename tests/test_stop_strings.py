"""Stop strings (`SamplingParams.stop`): where an output ends, checked against a reference computed from the full
decode of an unstopped run, and against transformers' own `generate(stop_strings=..., tokenizer=...)`."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import GenerationConfig

from rollout import SamplingParams, generate_batch
from rollout.config import FieldError
from rollout.detokenizer import OutputText
from rollout.presets import tiny_model, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
VOCAB = TOKENIZER.vocab_size + len(TOKENIZER.get_added_vocab()) - 4  # 1024: the tiny model's


def reference_stop(
    output_ids: list[int], stops: list[str], include: bool, min_tokens: int = 0
) -> tuple[int, str, bool]:
    """(tokens kept, text, stopped) of an output cut at its first stop string, from full decodes of growing
    prefixes: the first token past min_tokens whose text completes a stop string ends it (as vLLM, stop strings
    completed within the first min_tokens tokens do not count)."""
    for end in range(min_tokens + 1, len(output_ids) + 1):
        before = len(TOKENIZER.decode(output_ids[: end - 1], skip_special_tokens=True))
        text = TOKENIZER.decode(output_ids[:end], skip_special_tokens=True)
        found = []
        for stop in stops:
            start = text.find(stop, max(0, before - len(stop) + 1))
            if start >= 0:
                found.append((start + len(stop), start, stop))
        if found:
            stop_end, start, _ = min(found)
            return end, text[: stop_end if include else start], True
    return len(output_ids), TOKENIZER.decode(output_ids, skip_special_tokens=True), False


def stops_across_boundaries(output_ids: list[int], rng: random.Random) -> list[str]:
    """Stop strings taken from an output's own text, each spanning at least one token boundary."""
    pieces = [TOKENIZER.decode([t], skip_special_tokens=True) for t in output_ids]
    stops = []
    for _ in range(3):
        i = rng.randrange(1, max(2, len(pieces) - 1))
        left, right = pieces[i - 1], "".join(pieces[i : i + 2])
        if left and right:
            stops.append(left[-rng.randint(1, len(left)) :] + right[: rng.randint(1, len(right))])
    return stops or ["zz"]


@pytest.mark.parametrize("include", [False, True])
def test_output_text_matches_full_decodes(include):
    rng = random.Random(0)
    for _ in range(200):
        output_ids = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 30))]
        stops = stops_across_boundaries(output_ids, rng)
        text = OutputText(TOKENIZER, [rng.randrange(VOCAB) for _ in range(6)], True, tuple(stops), include)
        released, fed = "", 0
        for token in output_ids:
            released += text.add(token)
            fed += 1
            if text.stopped:
                break
        released += text.finish()
        expected_tokens, expected_text, stopped = reference_stop(output_ids, stops, include)
        assert (fed, text.text, released) == (expected_tokens, expected_text, expected_text)
        assert (text.stopped is not None) == stopped


def test_streamed_text_never_shows_part_of_a_stop_string():
    text = OutputText(TOKENIZER, [5], stop=("abc",))
    ids = TOKENIZER.encode("xyab", add_special_tokens=False)
    released = [text.add(t) for t in ids]
    assert "".join(released) == "xy"  # "ab" may begin "abc": held back
    assert text.finish() == "ab"


def test_multibyte_characters_wait_for_their_last_token():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = tokenizer.encode("aé€b", add_special_tokens=False)  # é and € are 2 and 3 byte tokens
    assert len(ids) == 7
    text = OutputText(tokenizer, [ids[0]], stop=("€b",))
    released = [text.add(t) for t in ids]
    assert "\ufffd" not in "".join(released)
    assert text.stopped == "€b" and text.text == "aé"
    cut = OutputText(tokenizer, [ids[0]])  # a completion that ends inside "é" still returns all its bytes
    assert "".join(cut.add(t) for t in ids[:2]) + cut.finish() == tokenizer.decode(ids[:2]) == "a\ufffd"


def test_a_token_ending_inside_a_character_stops_where_generate_stops():
    """A byte-level token of "a" and the first byte of "é": its "a" is whole, so a stop string "a" ends the
    completion at that token, as transformers' `StopStringCriteria` ends it (it waited for the next token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, StopStringCriteria

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["a\u00c3"] = len(vocab)  # "a" merged with the first byte of "é" (0xC3, "Ã" in byte-level letters)
    backend = Tokenizer(models.BPE(vocab, [("a", "\u00c3")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt = tokenizer.encode("x", add_special_tokens=False)
    ids = tokenizer.encode("aé", add_special_tokens=False)
    assert ids[0] == vocab["a\u00c3"] and tokenizer.decode(ids[:1]) == "a\ufffd"
    generate_stops = StopStringCriteria(tokenizer, ["a"])(torch.tensor([prompt + ids[:1]]), None)
    text = OutputText(tokenizer, prompt, stop=("a",))
    assert text.add(ids[0]) == "" and text.stopped == "a" and text.text == ""
    assert bool(generate_stops[0])
    plain = OutputText(tokenizer, prompt, stop=("é",))
    assert [plain.add(t) for t in ids] == ["a", ""] and plain.stopped == "é" and plain.text == "a"


def test_a_special_token_inside_a_generation_configs_stop_string_keeps_it_apart_as_generate_does():
    """`generate` matches `stop_strings` in every token's text, special tokens' included: "G", <|im_start|>, "aj"
    does not complete "Gaj" there. A GenerationConfig's stop strings are matched so (the special token was left out
    of the text, and the completion stopped at "aj"); SamplingParams' `stop` keeps vLLM's rule."""
    from transformers import StopStringCriteria

    from rollout.generation_config import resolve

    ids = [*TOKENIZER.encode("G", add_special_tokens=False), 100, *TOKENIZER.encode("aj", add_special_tokens=False)]
    prompt = TOKENIZER.encode("x", add_special_tokens=False)
    criteria = StopStringCriteria(TOKENIZER, ["Gaj"])
    generate_stops = [bool(criteria(torch.tensor([prompt + ids[:fed]]), None)[0]) for fed in range(1, len(ids) + 1)]
    assert not any(generate_stops)
    sampling = resolve(GenerationConfig(stop_strings=["Gaj"])).sampling
    assert sampling.skip_special_tokens is False
    text = OutputText(TOKENIZER, prompt, sampling.skip_special_tokens, sampling.stop)
    for token in ids:
        text.add(token)
    assert text.stopped is None
    vllm_rule = OutputText(TOKENIZER, prompt, stop=("Gaj",))
    for token in ids:
        vllm_rule.add(token)
    assert vllm_rule.stopped == "Gaj"


def greedy_run(model, prompts, max_new_tokens=24, **fields):
    sampling = SamplingParams(temperature=0, stop_token_ids=(), **fields)
    outputs = generate_batch(
        model, prompts, sampling=sampling, max_new_tokens=max_new_tokens, tokenizer=TOKENIZER, progress_bar=False
    )
    return [o.generated_tokens for o in outputs.values()], list(outputs.values())


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_greedy_stops_match_transformers_generate(model):
    prompts = [TOKENIZER.encode(text, add_special_tokens=False) for text in ("hello there: ", "abc", "Q7xv: ")]
    unstopped, _ = greedy_run(model, prompts)
    rng = random.Random(1)
    reference = copy.deepcopy(model)
    reference.generation_config.eos_token_id = None
    for prompt, full in zip(prompts, unstopped):
        stops = stops_across_boundaries(full, rng)
        (tokens,), (output,) = greedy_run(model, [prompt], stop=stops)
        expected_tokens, _, _ = reference_stop(full, stops, include=False)
        assert tokens == full[:expected_tokens] and output.finish_reason == "stop"
        config = GenerationConfig(max_new_tokens=24, do_sample=False, stop_strings=stops, eos_token_id=None)
        generated = reference.generate(torch.tensor([prompt]), generation_config=config, tokenizer=TOKENIZER)
        assert tokens == generated[0, len(prompt) :].tolist()


def test_every_sample_of_a_group_stops_at_its_own_stop_string(model):
    prompt = TOKENIZER.encode("sample me: ", add_special_tokens=False)
    sampling = SamplingParams(temperature=1.0, seed=7, stop_token_ids=())
    unstopped = generate_batch(model, [prompt], sampling=sampling, n=4, max_new_tokens=20, progress_bar=False)
    full = [o.generated_tokens for o in unstopped.values()]
    stops = [TOKENIZER.decode(full[1][5:7]), TOKENIZER.decode(full[3][2:4])]
    stopped = generate_batch(
        model,
        [prompt],
        sampling=sampling.merged(stop=stops, include_stop_str_in_output=True, min_new_tokens=1),
        n=4,
        max_new_tokens=20,
        tokenizer=TOKENIZER,
        progress_bar=False,
    )
    for output, tokens in zip(stopped.values(), full):
        keep, _, stopped = reference_stop(tokens, stops, include=True, min_tokens=1)
        assert output.generated_tokens == tokens[:keep]  # same seeds: the same tokens up to the stop
        assert len(output.logprobs) == keep
        assert output.finish_reason == ("stop" if stopped else "length")


def test_min_new_tokens_defers_stop_strings(model):
    prompt = TOKENIZER.encode("abc", add_special_tokens=False)
    (full,), _ = greedy_run(model, [prompt])
    stop = TOKENIZER.decode(full[:1])  # completed by the first token
    (early,), _ = greedy_run(model, [prompt], stop=[stop])
    assert len(early) == 1
    (late,), _ = greedy_run(model, [prompt], stop=[stop], min_new_tokens=3)
    keep, _, _ = reference_stop(full, [stop], include=False, min_tokens=3)
    assert late == full[:keep] and len(late) > 3


def test_stop_strings_need_a_tokenizer(model):
    with pytest.raises(FieldError) as raised:
        generate_batch(model, [[5, 6]], sampling=SamplingParams(stop=["a"]), progress_bar=False)
    assert raised.value.field == "stop" and "tokenizer" in raised.value.reason
    config = GenerationConfig(stop_strings=["a"], max_new_tokens=4)
    with pytest.raises(FieldError, match="tokenizer") as raised:
        generate_batch(model, [[5, 6]], generation_config=config, progress_bar=False)
    assert raised.value.field == "stop_strings"  # the GenerationConfig's name for them
    outputs = generate_batch(model, [[5, 6]], generation_config=config, tokenizer=TOKENIZER, progress_bar=False)
    assert len(outputs) == 1


@pytest.mark.parametrize(
    "stop",
    ["", ["ok", 3], ["x" * 257], ["s"] * 33, [None]],
)
def test_bad_stop_strings_are_refused_by_name(stop):
    with pytest.raises(FieldError) as raised:
        SamplingParams(stop=stop)
    assert raised.value.field == "stop"


def test_a_stop_string_holding_a_lone_surrogate_is_refused_by_name_as_over_http(model):
    """ "a\\ud800" (a JSON escape of half a character) is in no decoded text, so it could never end a completion: the
    HTTP API refuses it naming `stop`; in process (and from a GenerationConfig) it was taken and silently never
    matched. The tokenizer cannot even encode it."""
    from rollout.generation_config import resolve

    with pytest.raises(TypeError):
        TOKENIZER.encode("a\ud800", add_special_tokens=False)
    with pytest.raises(FieldError, match="lone surrogate") as raised:
        generate_batch(model, [[5, 6]], sampling=SamplingParams(stop=["ok", "a\ud800"]), tokenizer=TOKENIZER)
    assert raised.value.field == "stop"
    with pytest.raises(FieldError, match="lone surrogate") as raised:
        resolve(GenerationConfig(stop_strings=["\udc80"]))
    assert raised.value.field == "generation_config.stop_strings"


def test_text_released_within_min_tokens_is_never_taken_back():
    ids = TOKENIZER.encode("kkjsz", add_special_tokens=False)
    text = OutputText(TOKENIZER, [5], stop=("js",), min_tokens=2)
    released = "".join(text.add(t) for t in ids) + ("" if text.stopped else text.finish())
    assert released == text.text == "kk" and text.stopped == "js"


def test_tokens_without_text_keep_each_step_cheap():
    special = TOKENIZER.convert_tokens_to_ids("<|im_start|>")
    text = OutputText(TOKENIZER, [5], skip_special_tokens=True, stop=("zz",))
    for _ in range(2000):
        text.add(special)
    assert len(text._ids) <= 2  # the decoded window did not grow with the text-less tokens
    assert text.add(TOKENIZER.convert_tokens_to_ids("a")) == "" and text.finish() == "a"


class FailingTokenizer:
    """The tiny tokenizer, whose decode raises on any text holding `bad` (a custom tokenizer's bug)."""

    def __init__(self, bad: int):
        self.bad = bad

    def __getattr__(self, name: str):
        return getattr(TOKENIZER, name)

    def decode(self, ids, **kwargs):
        if self.bad in list(ids):
            raise RuntimeError("this tokenizer cannot decode that")
        return TOKENIZER.decode(ids, **kwargs)


def test_a_tokenizer_that_fails_on_an_output_fails_that_sample_not_the_manager(model):
    """The stop strings of one request decode its output with the caller's tokenizer; one that raises there ended
    the manager's engine thread, so every request ended with "engine thread failed". Now that request alone ends
    with an error naming the tokenizer; the others finish, and the manager serves on."""
    from rollout import init_continuous_batching

    prompt = TOKENIZER.encode("hello there: ", add_special_tokens=False)
    (full,), _ = greedy_run(model, [prompt])
    greedy = SamplingParams(do_sample=False, stop_token_ids=())
    manager = init_continuous_batching(model, tokenizer=FailingTokenizer(full[3]))
    manager.start()
    try:
        failing = manager.add_request(prompt, max_new_tokens=8, sampling=greedy.merged(stop=["no such text"]))
        plain = manager.add_request(prompt, max_new_tokens=8, sampling=greedy)
        outputs = {request_id: manager.get_result(request_id, timeout=60) for request_id in (failing, plain)}
        assert outputs[failing].finish_reason == "error" and "tokenizer failed" in outputs[failing].error
        assert outputs[plain].finish_reason == "length" and list(outputs[plain].generated_tokens) == full[:8]
        after = manager.add_request(prompt, max_new_tokens=4, sampling=greedy)
        assert list(manager.get_result(after, timeout=60).generated_tokens) == full[:4]
    finally:
        manager.stop()
