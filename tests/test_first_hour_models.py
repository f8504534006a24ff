"""A model developer's first hour with `generate_batch` and the manager, mistakes a review found answered wrongly:
an attention layer that does not pass its keyword arguments on (it ran unpaged over the packed batch: wrong tokens,
no error), a padded batch tensor without its mask (the padding became prompt), a base model or an encoder-decoder
(failed deep inside), inputs that are no list of prompts, a bad prompt of a batch not named by its index, a
GenerationConfig's sampling settings left out by a request's own SamplingParams without a word, and a script that
ends while its manager still generates (the process aborted). The references are transformers' own `generate` and
forward."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from transformers import GenerationConfig, LlamaModel, T5Config, T5ForConditionalGeneration
from transformers.models.llama.modeling_llama import LlamaAttention

from conftest import MODEL_CONFIGS, make_prompts, reference_copy, tiny_model
from rollout import SamplingParams, generate_batch, init_continuous_batching
from rollout.config import FieldError
from rollout.engine.generate import cached_engine, release_cached_engine

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def greedy_generate(model, input_ids: torch.Tensor, new: int, **kwargs) -> list[list[int]]:
    out = model.generate(input_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
    return out[:, input_ids.shape[1] :].tolist()


class KwargsDroppingAttention(LlamaAttention):
    """A model developer's attention that calls the attention function without the forward's keyword arguments."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states, position_embeddings, attention_mask)


def test_an_attention_that_drops_its_keyword_arguments_is_named_not_run_unpaged():
    model = tiny_model("llama")
    for index, layer in enumerate(model.model.layers):
        dropping = KwargsDroppingAttention(model.config, index)
        dropping.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = dropping
    prompts = make_prompts(2, 5, 9, seed=3)
    before = model(torch.tensor([prompts[0]])).logits
    # Refused when the engine is built (a probe forward), not at each request's first step; with or without warmup.
    for warmup in (False, True):
        with pytest.raises(
            FieldError, match=r"KwargsDroppingAttention calls its attention function without .*\*\*kwargs"
        ):
            generate_batch(model, prompts, max_new_tokens=4, sampling=GREEDY, progress_bar=False, warmup=warmup)
    # Outside the engine (a trainer's forward, generate) the model is as it was.
    assert torch.equal(model(torch.tensor([prompts[0]])).logits, before)


def test_a_padded_batch_tensor_without_its_mask_is_unpadded_as_generate_does():
    """`generate` infers the mask of a 2-D input_ids from the pad token (when it is no stop token): so does
    generate_batch, and both equal the unpadded prompts' tokens."""
    model = tiny_model("llama")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    short, long = [7, 8, 9], [11, 12, 13, 14, 15, 16]
    padded = torch.tensor([[0, 0, 0, *short], long])
    expected = greedy_generate(reference_copy(model), padded, 5)
    assert expected[0] == greedy_generate(model, torch.tensor([short]), 5)[0]
    for inputs in (padded, {"input_ids": padded}):  # a tensor, or a tokenizer's output without its mask
        outputs = generate_batch(model, inputs, max_new_tokens=5, sampling=GREEDY, progress_bar=False, warmup=False)
        assert [outputs[key].prompt_ids for key in ("req_0", "req_1")] == [short, long]
        assert [outputs[key].generated_tokens for key in ("req_0", "req_1")] == expected


def test_what_is_no_causal_lm_or_no_list_of_prompts_is_named():
    base = LlamaModel(MODEL_CONFIGS["llama"]())
    with pytest.raises(FieldError, match="AutoModelForCausalLM") as error:
        init_continuous_batching(base)
    assert error.value.field == "model"
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(FieldError, match="encoder-decoder"):
        generate_batch(t5, [[1, 2, 3]], progress_bar=False)
    for model in (None, {"config": None}):
        with pytest.raises(FieldError, match="expected a transformers causal LM") as error:
            generate_batch(model, [[1, 2, 3]], progress_bar=False)
        assert error.value.field == "model"
    model = tiny_model("llama")
    for inputs in (None, (prompt for prompt in [[1, 2, 3]])):
        with pytest.raises(FieldError, match="list of prompts") as error:
            generate_batch(model, inputs, progress_bar=False)
        assert error.value.field == "inputs"
    with pytest.raises(FieldError, match="prompt 2 of the batch") as error:
        generate_batch(model, [[1, 2], [3, 4], [], [5]], progress_bar=False, warmup=False)
    with pytest.raises(TypeError, match=r"\(temperature, top_k: SamplingParams settings, so pass sampling=") as error:
        generate_batch(model, [[1, 2, 3]], progress_bar=False, temperature=0.5, top_k=3, verbose=True)
    assert "['temperature', 'top_k', 'verbose']" in str(error.value)  # every unknown one named, the hint for two
    assert str(error.value).endswith("pass sampling=SamplingParams(temperature=0.5, top_k=3))")
    hinted = SamplingParams(temperature=0.5, top_k=3)  # what it says to pass works as it is
    for typo, meant in [("max_new_token", "max_new_tokens"), ("max_tokens", "max_new_tokens"), ("progres_bar", "progress_bar"), ("temprature", "temperature")]:  # fmt: skip
        with pytest.raises(TypeError, match=f"did you mean '{meant}' \\(for '{typo}'\\)\\?$"):
            generate_batch(model, [[1, 2, 3]], progress_bar=False, **{typo: 2})
    assert len(generate_batch(model, [[1, 2, 3]], progress_bar=False, max_new_tokens=2, sampling=hinted)) == 1


def test_sampling_settings_a_requests_own_sampling_params_leaves_out_are_said():
    """A SamplingParams replaces the GenerationConfig's sampling settings (documented; the tokens are the
    SamplingParams' own, as `generate` with those settings gives them): a caller who gave both is told, once."""
    model = tiny_model("llama")
    config = GenerationConfig(repetition_penalty=1.3, do_sample=False, max_new_tokens=8)
    prompt = [[11, 12, 11, 12]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the config alone: nothing to say
        alone = generate_batch(model, prompt, generation_config=config, progress_bar=False, warmup=False)
    assert alone["req_0"].generated_tokens == greedy_generate(model, torch.tensor(prompt), 8, repetition_penalty=1.3)[0]
    with pytest.warns(UserWarning, match=r"repetition_penalty=1\.3 from the generation_config are not used"):
        both = generate_batch(model, prompt, generation_config=config, sampling=GREEDY, progress_bar=False)
    assert both["req_0"].generated_tokens == greedy_generate(model, torch.tensor(prompt), 8)[0]
    inert = GenerationConfig(do_sample=False, temperature=0.7, top_p=0.9, max_new_tokens=8)  # greedy: warpers idle
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        generate_batch(model, prompt, generation_config=inert, sampling=GREEDY, progress_bar=False, warmup=False)
    assert not [warning for warning in said if "are not used for it" in str(warning.message)]


def test_a_script_that_ends_while_its_manager_generates_exits_cleanly():
    """Without `stop()`: the engine thread is stopped at exit, before the interpreter finalizes (it aborted with
    "terminate called without an active exception", status 134)."""
    script = textwrap.dedent(
        """
        import time
        from rollout import SamplingParams, init_continuous_batching
        from rollout.presets import tiny_model
        manager = init_continuous_batching(tiny_model()).start()
        manager.add_request([5, 6, 7], max_new_tokens=400, sampling=SamplingParams(seed=0, stop_token_ids=()))
        time.sleep(0.5)
        print("script end", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "script end" in done.stdout and "terminate called" not in done.stderr


def test_the_progress_bar_counts_tokens_while_no_sample_has_finished(capsys, monkeypatch):
    """Samples run together finish together: the bar of finished samples alone sat at 0/2 until the end; its
    postfix counts the generated tokens as they come, and ends at what the outputs hold."""
    monkeypatch.setattr("rollout.engine.progress.REFRESH_S", 0.0)  # a redraw every step: no timing in the test
    model = tiny_model("llama")
    outputs = generate_batch(model, [[1, 2, 3], [4, 5]], max_new_tokens=6, sampling=GREEDY, warmup=False)
    drawn = re.split(r"[\r\n]", capsys.readouterr().err)
    counted = [
        int(re.search(r"tokens=(\d+)", line).group(1)) for line in drawn if " 0/2 " in line and "tokens=" in line
    ]
    assert counted and counted == sorted(counted) and counted[-1] > 0  # it moved before any sample finished
    generated = sum(len(output.generated_tokens) for output in outputs.values())
    final = [line for line in drawn if " 2/2 " in line][-1]
    assert f"tokens={generated}" in final and "tok/s=" in final


def test_a_length_given_twice_for_one_prompt_is_refused_unless_the_same():
    """`max_new_tokens=50` beside a prompt's own `SamplingParams(max_new_tokens=3)`: the call's 50 silently won
    (and a manager's add_request did the same). Both are the request's own: differing, they are refused by name;
    equal, or given once, they are honoured."""
    model = tiny_model("llama")
    short = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=3)
    with pytest.raises(
        FieldError, match=r"prompt 1 of the batch: 50 given beside the sampling's max_new_tokens=3"
    ) as error:
        generate_batch(model, [[1, 2], [3, 4]], max_new_tokens=50, sampling=[GREEDY, short], progress_bar=False)
    assert error.value.field == "max_new_tokens"
    outputs = generate_batch(model, [[1, 2], [3, 4]], max_new_tokens=3, sampling=[GREEDY, short], progress_bar=False)
    assert [len(output.generated_tokens) for output in outputs.values()] == [3, 3]
    config = GenerationConfig(do_sample=False, max_new_tokens=8)  # a default, not the request's own: overridden
    outputs = generate_batch(
        model, [[1, 2]], config, max_new_tokens=2, sampling={"stop_token_ids": []}, progress_bar=False
    )
    assert len(outputs["req_0"].generated_tokens) == 2
    manager = init_continuous_batching(model).start()
    try:
        with pytest.raises(FieldError, match="given beside the sampling's max_new_tokens=3"):
            manager.add_request([1, 2], max_new_tokens=20, sampling=short)
    finally:
        manager.stop()
    # A generation config's length is a default: transformers' calls override it (they were refused by a first cut).
    with init_continuous_batching(model, GenerationConfig(max_new_tokens=20, do_sample=False)) as manager:
        manager.add_request([5, 6, 7], "positional", 4, False, False, 1)  # transformers' order, with eos_token_id
        manager.add_request([5, 6, 7], max_new_tokens=4, do_sample=True, temperature=0.7, seed=1)
        manager.add_request([5, 6, 7], max_new_tokens=4, sampling={"do_sample": True, "seed": 2})
        manager.add_requests([[5, 6, 7]], max_new_tokens=4, eos_token_id=1)
        lengths = [len(manager.get_result(timeout=60).generated_tokens) for _ in range(4)]
    assert lengths == [4] * 4


def test_scoring_prompts_generates_no_tokens_on_the_bar_or_in_the_stats(capsys):
    """Score-only samples (`max_new_tokens=0` with `prompt_logprobs`) draw one token the engine drops: the bar, and
    the engine's `generated_tokens` it reads, counted it (4 tokens for 4 prompts that got none)."""
    model = tiny_model("llama")
    scoring = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=0, prompt_logprobs=1)
    outputs = generate_batch(model, [[1, 2, 3]] * 4, sampling=scoring, persistent_manager=True, warmup=False)
    assert all(output.generated_tokens == [] and output.prompt_logprobs for output in outputs.values())
    assert "tokens=0," in re.split(r"[\r\n]", capsys.readouterr().err.strip())[-1]
    assert cached_engine(model).stats()["generated_tokens"] == 0
    release_cached_engine(model)


def test_a_max_model_len_past_the_models_positions_is_refused_as_generate_would_fail():
    """An engine's max_model_len above the model's context (RoPE scaling included, as vLLM derives it) is refused
    by name when the engine is built: a learned-position model's generate fails past its positions, and the engine
    took the setting and failed the sample there. Up to the context, and up to a YaRN-scaled one, it serves as
    transformers' generate does."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    from rollout import ContinuousBatchingConfig

    gpt2 = GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2, vocab_size=96)).eval()
    prompt = torch.randint(3, 96, (1, 40))
    with pytest.raises(IndexError):  # transformers' own verdict on running past 64 positions
        greedy_generate(gpt2, prompt, 30)

    def run(model, config, new):
        outputs = generate_batch(
            model,
            prompt.tolist(),
            max_new_tokens=new,
            sampling=GREEDY,
            progress_bar=False,
            warmup=False,
            continuous_batching_config=config,
        )
        return [output.generated_tokens for output in outputs.values()]

    with pytest.raises(FieldError, match=r"max_model_len: 128 is above the model's context of 64 tokens"):
        run(gpt2, ContinuousBatchingConfig(max_model_len=128, num_blocks=32), 20)
    assert run(gpt2, ContinuousBatchingConfig(max_model_len=64, num_blocks=32), 20) == greedy_generate(gpt2, prompt, 20)

    yarn = MODEL_CONFIGS["llama"]()
    yarn.max_position_embeddings = 64
    yarn.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    yarn.rope_parameters["rope_theta"] = 10000.0
    assert (
        len(run(LlamaForCausalLM(yarn).eval(), ContinuousBatchingConfig(max_model_len=256, num_blocks=32), 2)[0]) == 2
    )
