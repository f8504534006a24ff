"""`transformers.GenerationConfig` given to rollout's doors: every field honoured as transformers' `generate` honours
it (checked token for token against `generate` itself) or refused by name; none silently ignored."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, WatermarkingConfig

from conftest import make_prompts, reference_copy, tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch, init_continuous_batching
from rollout.config import FieldError
from rollout.generation_config import resolve

MAX_NEW = 30
CACHE = dict(num_blocks=256, block_size=4)


def reference_greedy(reference, prompt: list[int], **fields) -> list[int]:
    config = GenerationConfig(**{"do_sample": False, "max_new_tokens": MAX_NEW, **fields})
    return reference.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()


def rollout_greedy(model, prompts, overlap: bool, **fields) -> list[list[int]]:
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, **fields)
    outputs = generate_batch(
        model,
        prompts,
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(**CACHE, overlap_scheduling=overlap),
        progress_bar=False,
    )
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", [False, True])
def test_bans_decode_exactly_as_generate(overlap):
    """no_repeat_ngram_size, bad_words_ids (single- and multi-token), suppress_tokens and begin_suppress_tokens:
    greedy completions equal transformers' generate with the same GenerationConfig, with overlapped scheduling too
    (the bans then read tokens the host has not seen yet). Bad words are taken from the unbanned completions, so
    every one of them would otherwise have been generated."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompts = make_prompts(4, 3, 16, seed=7)
    plain = rollout_greedy(model, prompts, overlap)
    assert plain == [reference_greedy(reference, p) for p in prompts]
    first, second = plain[0], plain[1]
    cases = {
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[first[3]], [second[5], second[6]], [first[0], first[1], first[2]]]),
        "suppress": dict(suppress_tokens=[second[2], first[8]], begin_suppress_tokens=[first[0], second[0]]),
    }
    for name, fields in cases.items():
        banned = rollout_greedy(model, prompts, overlap, **fields)
        assert banned == [reference_greedy(reference, p, **fields) for p in prompts], name
        assert banned != plain, f"{name} changed nothing: the test would not notice it being ignored"


def test_num_return_sequences_samples_n_per_prompt():
    model = tiny_model("qwen3")
    prompts = make_prompts(2, 3, 8, seed=1)
    config = GenerationConfig(do_sample=True, num_return_sequences=3, max_new_tokens=6, top_k=0)
    outputs = generate_batch(
        model,
        prompts,
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(**CACHE),
        progress_bar=False,
    )
    assert list(outputs) == [f"req_{i}#{j}" for i in range(2) for j in range(3)]
    assert len({tuple(outputs[f"req_0#{j}"].generated_tokens) for j in range(3)}) > 1
    with init_continuous_batching(model, config, ContinuousBatchingConfig(**CACHE)) as manager:
        group = manager.add_request(prompts[0])
        results = [manager.get_result(group, timeout=30) for _ in range(3)]
        assert sorted(r.request_id for r in results) == [f"{group}#{j}" for j in range(3)]
        single = manager.add_request(prompts[0], n=1)  # an explicit n wins
        assert manager.get_result(single, timeout=30).request_id == single


def test_the_default_top_k_samples_a_vocabulary_smaller_than_it_as_generate_does():
    """transformers' default top_k=50 on a model of 32 tokens: `generate`'s TopKLogitsWarper keeps min(50, 32) tokens,
    so it samples from the whole vocabulary. It was refused ("top_k: 50 exceeds the vocabulary size 32"); now each
    sampled token's log-prob is log_softmax of transformers' TopKLogitsWarper(50) over a teacher-forced forward."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.generation.logits_process import TopKLogitsWarper

    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    model = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=32, num_key_value_heads=1, **small)).eval()
    model.generation_config.eos_token_id = None
    reference = reference_copy(model)
    prompt = [1, 2, 3, 4]
    config = GenerationConfig(do_sample=True, max_new_tokens=6)
    (out,) = generate_batch(model, [prompt], config, progress_bar=False, sampling={"seed": 3}).values()
    tokens = out.generated_tokens
    assert len(tokens) == 6
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    warped = TopKLogitsWarper(50)(torch.tensor([prompt + tokens]), logits)
    expected = torch.log_softmax(warped, -1).gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)
    assert resolve(GenerationConfig(do_sample=True, top_k=100), vocab_size=32).sampling.top_k == 32


def test_max_length_bounds_prompt_plus_completion_as_generate():
    """A GenerationConfig's max_length (Llama 3 ships one) counts the prompt, as in generate; max_new_tokens wins."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompt = make_prompts(1, 9, 9, seed=2)[0]
    config = GenerationConfig(do_sample=False, max_length=15)
    (out,) = generate_batch(model, [prompt], generation_config=config, progress_bar=False).values()
    expected = reference.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
    assert out.generated_tokens == expected and len(expected) == 6
    (out,) = generate_batch(model, [prompt], generation_config=config, max_new_tokens=3, progress_bar=False).values()
    assert len(out.generated_tokens) == 3
    with pytest.raises(FieldError) as raised:
        generate_batch(model, [list(range(20))], generation_config=config, progress_bar=False)
    assert raised.value.field == "max_length"
    past = GenerationConfig(do_sample=False, max_length=model.config.max_position_embeddings + 1)
    with pytest.raises(FieldError, match="exceeds the model's context") as raised:  # it named max_new_tokens
        generate_batch(model, [prompt], generation_config=past, progress_bar=False)
    assert raised.value.field == "max_length"


def test_a_generation_config_that_is_no_generation_config_is_refused_by_name():
    model, config = tiny_model("qwen3"), {"max_new_tokens": 2}  # a dict: a TypeError naming nothing, before
    with pytest.raises(FieldError, match="generation_config: expected a transformers GenerationConfig.*got dict"):
        generate_batch(model, [[1, 2]], generation_config=config, progress_bar=False)
    with pytest.raises(FieldError, match="generation_config: expected a transformers GenerationConfig.*got dict"):
        init_continuous_batching(model, generation_config=config)


def test_with_no_length_asked_for_a_request_ends_where_the_context_does():
    """No max_new_tokens or max_length anywhere: rollout's default (256 tokens), within what the model's context
    leaves after the prompt (it was refused as too long for a 40-token context)."""
    model = tiny_model("qwen3")
    model.config.max_position_embeddings = 40
    prompt = make_prompts(1, 10, 10, seed=2)[0]
    sampling = SamplingParams(do_sample=False, stop_token_ids=())
    (out,) = generate_batch(model, [prompt], sampling=sampling, progress_bar=False).values()
    assert (len(out.generated_tokens), out.finish_reason) == (30, "length")


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(num_beams=2, num_beam_groups=2, diversity_penalty=0.5), "num_beams"),
        (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
        (dict(watermarking_config=WatermarkingConfig()), "watermarking_config"),
        (dict(min_length=5), "min_length"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(sequence_bias={(3,): -1.0}), "sequence_bias"),
        (dict(forced_eos_token_id=2), "forced_eos_token_id"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(max_time=1.0), "max_time"),
        (dict(made_up_knob=3), "made_up_knob"),  # an unknown field is never silently dropped
        (dict(top_p=1.5), "top_p"),  # honoured, but invalid: named as the GenerationConfig's field
    ],
)
def test_fields_rollout_cannot_honour_are_refused_by_name(fields, field):
    model = tiny_model("qwen3")
    with pytest.raises(FieldError) as raised:
        generate_batch(model, [[1, 2, 3]], generation_config=GenerationConfig(**fields), progress_bar=False)
    assert raised.value.field == f"generation_config.{field}"


def test_the_models_own_config_is_checked_and_named():
    model = tiny_model("qwen3")
    model.generation_config.num_beams = 3
    with pytest.raises(FieldError) as raised:
        generate_batch(model, [[1, 2, 3]], progress_bar=False)
    assert raised.value.field == "model.generation_config.num_beams"
    # The caller's value wins over the model's, as in generate.
    (out,) = generate_batch(
        model, [[1, 2, 3]], generation_config=GenerationConfig(num_beams=1), max_new_tokens=2, progress_bar=False
    ).values()
    assert len(out.generated_tokens) == 2


@pytest.mark.parametrize(
    "source, fields, field",
    [
        ("generation_config", dict(eos_token_id=10**7), "eos_token_id"),
        ("generation_config", dict(eos_token_id=[1, 10**7]), "eos_token_id"),
        ("generation_config", dict(bad_words_ids=[[3, 10**7]]), "bad_words_ids"),
        ("model.generation_config", dict(suppress_tokens=[10**7]), "suppress_tokens"),
        ("model.generation_config", dict(begin_suppress_tokens=[10**7]), "begin_suppress_tokens"),
    ],
)
def test_a_configs_token_ids_outside_the_vocabulary_are_refused_at_init_by_the_configs_name(source, fields, field):
    """Refused when the manager is made, naming the config's own field, not at each request under the
    SamplingParams name (`stop_token_ids`) the caller never wrote."""
    model = tiny_model("qwen3")
    config = GenerationConfig(**fields) if source == "generation_config" else None
    if config is None:
        for name, value in fields.items():
            setattr(model.generation_config, name, value)
    with pytest.raises(FieldError) as raised:
        init_continuous_batching(model, config, ContinuousBatchingConfig(num_blocks=16, block_size=4))
    assert raised.value.field == f"{source}.{field}"
    assert "vocabulary" in raised.value.reason


def test_a_models_own_eos_outside_its_vocabulary_ends_nothing_as_in_generate():
    """A tiny model built from a config keeps the config's default EOS (GPT-2's 50256) beyond its small vocabulary:
    `generate` warns and runs it, no token ever matching; so does rollout (it refused every request)."""
    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = [10**7]
    model.generation_config.do_sample = False
    with torch.no_grad():
        reference = reference_copy(model).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, pad_token_id=0)
    with pytest.warns(UserWarning, match="eos_token_id"):
        outputs = generate_batch(model, [[1, 2, 3]], max_new_tokens=5, progress_bar=False)
    assert outputs["req_0"].generated_tokens == reference[0, 3:].tolist()


def test_fields_without_effect_and_defaults_are_accepted():
    config = GenerationConfig(
        num_beams=1,
        length_penalty=1.0,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        use_cache=True,
        renormalize_logits=True,
        typical_p=0.5,
        epsilon_cutoff=0.001,
        eta_cutoff=0.002,
        eos_token_id=[5, 6],
        suppress_tokens=[7],
    )
    defaults = resolve(config, None)
    sampling = defaults.sampling
    assert (sampling.typical_p, sampling.epsilon_cutoff, sampling.eta_cutoff) == (0.5, 0.001, 0.002)
    assert sampling.stop_token_ids == (5, 6) and sampling.suppress_tokens == (7,)
    assert defaults.n == 1 and defaults.max_length is None
    # transformers' global defaults: greedy, top_k 50 once sampling.
    assert resolve(None, None).sampling == SamplingParams(do_sample=False, top_k=50)


def test_a_continuous_batching_config_carried_by_the_generation_config_is_used():
    import transformers

    model = tiny_model("qwen3")
    config = GenerationConfig(max_new_tokens=2)
    from rollout.transformers_configs import page_size_field

    page_size = {page_size_field(): 8}  # block_size before transformers renamed it
    config.continuous_batching_config = transformers.ContinuousBatchingConfig(**page_size, num_blocks=40)
    with init_continuous_batching(model, config) as manager:
        assert (manager.config.block_size, manager.config.num_blocks) == (8, 40)


def test_custom_entries_of_a_checkpoint_config_are_ignored_as_generate_ignores_them():
    """Hub generation_config.json files carry custom keys (chat_format, user_token_id, ...): generate ignores them, so
    a model with one must still serve; the same unknown key in the caller's own config is a likely typo: refused."""
    model = tiny_model("qwen3")
    model.generation_config.chat_format, model.generation_config.user_token_id = "chatml", 195  # as from_pretrained
    assert "chat_format" in vars(model.generation_config)
    (out,) = generate_batch(model, [[1, 2, 3]], max_new_tokens=2, progress_bar=False).values()
    assert len(out.generated_tokens) == 2
    with pytest.raises(FieldError) as raised:
        generate_batch(model, [[1, 2, 3]], generation_config=GenerationConfig(chat_format="x"), progress_bar=False)
    assert raised.value.field == "generation_config.chat_format"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sample_with_every_token_banned_ends_with_an_error_not_a_token(overlap):
    """Bans that leave nothing to draw first are refused at intake, naming a field (transformers would draw token 0
    greedily, or raise when sampling); bans that run out later (no_repeat_ngram_size) end that sample with
    finish_reason "error" and its tokens so far; the other samples in the batch are untouched."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompts = make_prompts(2, 4, 8, seed=9)
    everything = tuple(range(256))
    config = ContinuousBatchingConfig(num_blocks=512, block_size=4, overlap_scheduling=overlap)
    banned = SamplingParams(do_sample=False, stop_token_ids=(), begin_suppress_tokens=everything)
    with pytest.raises(FieldError) as refused:
        generate_batch(model, [prompts[0]], sampling=banned, continuous_batching_config=config, progress_bar=False)
    assert refused.value.field == "begin_suppress_tokens" and "ban all 256 tokens" in str(refused.value)
    late = SamplingParams(do_sample=True, seed=1, stop_token_ids=(), no_repeat_ngram_size=1)  # runs out of tokens
    plain = SamplingParams(do_sample=False, stop_token_ids=())
    outputs = generate_batch(
        model,
        [prompts[1], prompts[1]],
        sampling=[late, plain],
        max_new_tokens=300,
        continuous_batching_config=config,
        progress_bar=False,
    )
    exhausted, untouched = outputs["req_0"], outputs["req_1"]
    # n = 1: every token seen is banned, so after the prompt's distinct tokens and 256 - those, nothing is left.
    assert exhausted.finish_reason == "error" and "banned" in exhausted.error
    assert len(exhausted.generated_tokens) == 256 - len(set(prompts[1]))
    assert len(set(exhausted.generated_tokens)) == len(exhausted.generated_tokens)
    assert untouched.generated_tokens == reference_greedy(reference, prompts[1], max_new_tokens=300)


@pytest.mark.parametrize(
    "prompt, bans, refused",
    [
        ([5, 6, 7], {"no_repeat_ngram_size": 1}, "no_repeat_ngram_size"),  # 7 is in the prompt
        ([6, 7, 5, 6], {"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),  # (6, 7) was seen: 7 may not follow 6
        ([6, 8, 5, 6], {"no_repeat_ngram_size": 2}, None),
        ([1, 5, 6], {"bad_words_ids": [[5, 6, 7]]}, "bad_words_ids"),  # the prompt ends with the word's beginning
        ([1, 5, 8], {"bad_words_ids": [[5, 6, 7]]}, None),
    ],
)
def test_bans_over_the_prompt_that_leave_no_first_token_are_refused_at_intake(prompt, bans, refused):
    """Every token but 7 suppressed: the prompt's n-grams or a bad word's beginning banning 7 leaves nothing to draw
    first, which the intake refuses, naming the fields; where 7 stays drawable it is the first token."""
    model = tiny_model("qwen3")
    others = tuple(token for token in range(256) if token != 7)
    sampling = SamplingParams(do_sample=False, stop_token_ids=(), suppress_tokens=others, **bans)
    run = dict(sampling=sampling, max_new_tokens=1, progress_bar=False)
    if refused is None:
        assert generate_batch(model, [prompt], **run)["req_0"].generated_tokens == [7]
        return
    with pytest.raises(FieldError) as error:
        generate_batch(model, [prompt], **run)
    assert f"suppress_tokens, {refused} together ban all 256 tokens" in str(error.value)


def test_a_score_only_request_is_not_failed_by_bans_it_never_draws_under():
    """max_new_tokens 0 with prompt_logprobs scores the prompt and draws nothing: bans over the whole vocabulary
    change nothing of it (it ended with an error, "no token can be drawn")."""
    model = tiny_model("qwen3")
    everything = tuple(range(256))
    outputs = generate_batch(
        model,
        [[5, 6, 7, 8]] * 2,
        sampling=[SamplingParams(prompt_logprobs=1, suppress_tokens=everything), SamplingParams(prompt_logprobs=1)],
        max_new_tokens=0,
        progress_bar=False,
    )
    banned, free = outputs["req_0"], outputs["req_1"]
    assert (banned.finish_reason, banned.error, banned.generated_tokens) == ("length", None, [])
    assert banned.prompt_logprobs[0] is None and banned.prompt_logprobs[1:] == pytest.approx(free.prompt_logprobs[1:])


def test_a_requests_private_sampling_copy_is_checked_again_only_when_a_field_was_set_since(monkeypatch):
    """The intake's private copy (`SamplingParams.with_defaults`) takes the generation config's stop tokens and
    max_new_tokens where the request leaves them None; a caller's later change reaches neither the copy nor, unchecked,
    a new request; a copy of settings checked and untouched since is not checked again (a maximal one costs ms)."""
    defaults = SamplingParams(max_new_tokens=7, stop_token_ids=(3,))
    mine = SamplingParams(temperature=0.5, bad_words_ids=[[1, 2]], stop=["ab"])
    checks = []
    post_init = SamplingParams.__post_init__
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: (checks.append(1), post_init(self)))

    private = mine.with_defaults(defaults)
    assert checks == [] and private is not mine
    assert (private.max_new_tokens, private.stop_token_ids, private.bad_words_ids) == (7, (3,), ((1, 2),))
    assert mine.max_new_tokens is None and mine.stop_token_ids is None  # the caller's object is left as it was

    mine.temperature = -1.0  # changed after its check: the next copy checks it again and names the field
    with pytest.raises(FieldError, match="temperature"):
        mine.with_defaults(defaults)
    assert checks == [1] and private.temperature == 0.5  # the copy made before is not reached
    mine.temperature = 0.25
    assert mine.with_defaults(defaults).temperature == 0.25 and checks == [1, 1]
    assert mine.with_defaults(defaults).temperature == 0.25 and checks == [1, 1, 1]  # still set since its last check

    import pickle

    travelled = pickle.loads(pickle.dumps(SamplingParams(top_k=3)))  # bytes carry no mark: checked on first use
    checks.clear()
    assert travelled.with_defaults(defaults).top_k == 3 and checks == [1]
    import numpy

    with pytest.raises(FieldError, match="logprob_mode"):  # a checked value must not change in place later
        SamplingParams(logprob_mode=numpy.array("processed"))
    scoring_defaults = SamplingParams(max_new_tokens=0, prompt_logprobs=1)  # 0 is valid only beside prompt_logprobs
    with pytest.raises(FieldError, match="max_new_tokens"):
        SamplingParams().with_defaults(scoring_defaults)
