"""Engine-level behaviour: KV sizing, failure isolation, attention hand-back, logits only where sampled."""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine
from rollout.engine.kv import kv_cache

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def test_num_blocks_from_memory_percent(monkeypatch):
    """Without num_blocks, the cache takes max_memory_percent of free memory, capped at what max_num_seqs
    sequences of the model's context could use."""
    model = tiny_model("qwen3")
    shape = kv_cache.KVCacheShape.from_model_config(model.config)
    per_block = shape.bytes_per_block(4, torch.float32)
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 100 * per_block)
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, max_memory_percent=0.5))
    assert engine.block_manager.num_blocks == 50
    assert engine.kv_cache.kv.shape[2] == 50 + 1  # + the scratch block
    capped = Engine(
        tiny_model("qwen3"),
        ContinuousBatchingConfig(block_size=4, max_memory_percent=1.0, max_num_seqs=1, max_model_len=40),
    )
    assert capped.block_manager.num_blocks == 10  # one sequence of 40 tokens needs 10 blocks of 4
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: per_block // 2)
    with pytest.raises(ValueError, match="max_memory_percent"):
        Engine(tiny_model("qwen3"), ContinuousBatchingConfig(block_size=4, max_memory_percent=0.5))


def test_failing_forward_ends_its_requests_with_error_and_engine_goes_on(monkeypatch):
    """A forward that raises ends the step's requests with finish_reason "error" (message kept); the engine frees
    their blocks and serves the next requests correctly."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    engine = make_engine(model)
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky_run(batch, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_run(batch, *args)

    monkeypatch.setattr(engine.runner, "run", flaky_run)
    engine.add_request("doomed", [1, 2, 3, 4, 5], GREEDY, max_new_tokens=8)
    failed = run_to_completion(engine)["doomed"]
    assert failed.finish_reason == "error" and "device fell over" in failed.error
    engine.block_manager.check_all_free()
    prompt = make_prompts(1, 10, 10)[0]
    engine.add_request("after", prompt, GREEDY, max_new_tokens=8)
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert run_to_completion(engine)["after"].generated_tokens == expected[0, len(prompt) :].tolist()
    engine.block_manager.check_all_free()


def test_a_step_that_fails_for_one_requests_sake_ends_that_request_alone(monkeypatch):
    """A launch that raises whenever request "bad" is in the step: the first step (every group's prompt) fails; each
    group is then tried in a step of its own, "bad" ends with the error, and the other groups, sampled and greedy,
    get the tokens transformers' `generate` gives (greedy) and those of a run without "bad" (seeded sampling). A
    flaky forward that fails one step with a single group in it still ends that group at once."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    prompts = make_prompts(4, 6, 12, seed=3)
    sampled = SamplingParams(do_sample=True, seed=5, temperature=0.8, stop_token_ids=())

    def run(with_bad: bool) -> dict:
        engine = make_engine(reference_copy(model))
        real_sample = engine.sampler.sample
        fails = {"n": 0}

        def sample(logits, samples, *args, **kwargs):
            if any(request.group_id == "bad" for request, _ in samples):
                fails["n"] += 1
                raise ValueError("bad's sampling parameters broke the step")
            return real_sample(logits, samples, *args, **kwargs)

        monkeypatch.setattr(engine.sampler, "sample", sample)
        engine.add_request("greedy", prompts[0], GREEDY, max_new_tokens=8)
        engine.add_request("sampled", prompts[1], sampled, max_new_tokens=8, n=3)
        if with_bad:
            engine.add_request("bad", prompts[2], GREEDY, max_new_tokens=8)
        engine.add_request("greedy2", prompts[3], GREEDY, max_new_tokens=8)
        outputs = run_to_completion(engine)
        engine.block_manager.check_all_free()
        assert fails["n"] == (2 if with_bad else 0)  # the shared step, then bad's own
        return outputs

    outputs, without = run(True), run(False)
    assert outputs["bad"].finish_reason == "error" and "broke the step" in outputs["bad"].error
    for name, prompt in (("greedy", prompts[0]), ("greedy2", prompts[3])):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert outputs[name].generated_tokens == expected[0, len(prompt) :].tolist()
    sampled_ids = [key for key in outputs if key.startswith("sampled")]
    assert len(sampled_ids) == 3
    for key in sampled_ids:
        assert outputs[key].finish_reason == "length"
        assert outputs[key].generated_tokens == without[key].generated_tokens


def test_close_restores_attention_and_aborts_leftovers():
    """close() ends unfinished requests and gives the model its attention implementation back; the model then
    generates as before."""
    model = tiny_model("qwen3")
    original = model.config._attn_implementation
    engine = make_engine(model)
    assert model.config._attn_implementation == "rollout_paged"
    engine.add_request("left", [1, 2, 3], GREEDY, max_new_tokens=50)
    engine.step()
    engine.close()
    assert model.config._attn_implementation == original
    assert not engine.has_unfinished()
    engine.block_manager.check_all_free()


def test_unpaged_forward_through_registered_attention_matches_sdpa():
    """While the engine holds the model, an ordinary forward (training, teacher forcing) still gives the same logits
    as SDPA: the registered function falls back when no paged metadata is passed."""
    for kind in ("qwen3", "gemma2", "mistral_sliding"):
        model = tiny_model(kind)
        reference = reference_copy(model)
        make_engine(model)
        ids = torch.tensor(make_prompts(2, 40, 40, seed=7))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # left padding on the second row
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=mask).logits
            expected = reference(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(ours[0], expected[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours[1, 5:], expected[1, 5:], atol=1e-4, rtol=1e-4)


def test_logits_only_at_sampled_positions(monkeypatch):
    """The model's lm_head sees one row per sampled sequence, not one per packed token."""
    model = tiny_model("qwen3")
    engine = make_engine(model, max_batch_tokens=64)
    rows = []
    head = model.get_output_embeddings()
    monkeypatch.setattr(head, "forward", lambda hidden, _f=head.forward: rows.append(hidden.shape[-2]) or _f(hidden))
    for index, prompt in enumerate(make_prompts(3, 12, 12)):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=2)
    engine.step()  # 36 prompt tokens packed, 3 sampled positions
    assert rows == [3]
    run_to_completion(engine)


def test_request_that_fits_exactly_runs():
    """KV is needed for prompt + max_new_tokens - 1 tokens (the last token is never fed back): a request needing
    exactly the whole cache runs and equals generate; one token more is refused with an error output."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    prompt = [1, 2, 3, 4, 5, 6]
    engine = make_engine(model, num_blocks=2, block_size=4)
    engine.add_request("fits", prompt, GREEDY, max_new_tokens=3)
    engine.add_request("too_big", prompt, GREEDY, max_new_tokens=4)
    outputs = run_to_completion(engine)
    expected = reference.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 6, dtype=torch.long),
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
    )[0, 6:].tolist()
    assert outputs["fits"].generated_tokens == expected and outputs["fits"].finish_reason == "length"
    assert outputs["too_big"].finish_reason == "error" and "KV blocks" in outputs["too_big"].error
    engine.block_manager.check_all_free()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off CUDA")
def test_cuda_graphs_insisted_on_off_cuda_are_refused_by_name():
    """use_cuda_graph=True insists: on a CPU it is refused by name, never run eagerly in silence (None runs eagerly)."""
    with pytest.raises(ValueError, match="use_cuda_graph: True needs a CUDA device"):
        Engine(tiny_model("qwen3"), ContinuousBatchingConfig(num_blocks=16, use_cuda_graph=True))
    Engine(tiny_model("qwen3"), ContinuousBatchingConfig(num_blocks=16)).close()


def test_top_logprobs_without_logprobs_is_refused():
    """Asking for top_logprobs from an engine that computes no logprobs is an error naming the field, not a silent
    empty list."""
    engine = make_engine(tiny_model("qwen3"), return_logprobs=False)
    with pytest.raises(ValueError, match="top_logprobs"):
        engine.add_request("r", [1, 2, 3], SamplingParams(top_logprobs=2), max_new_tokens=2)
