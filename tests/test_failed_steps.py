"""A step whose launch fails with several groups in it (`rollout/engine/scheduling/suspects.py`): each group's
samples are recomputed in steps of their own, only a group that fails alone ends with the error, and every other
group gets the tokens transformers' `generate` gives, in a bounded number of steps."""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine, make_prompts, reference_copy, tiny_model
from rollout.config import SamplingParams

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def greedy(reference, prompt: list[int], max_new: int) -> list[int]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def run_bounded(engine, limit: int) -> dict:
    """Step until idle, at most `limit` steps (a loop that never ends fails here); final outputs by request id."""
    outputs, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        assert steps <= limit, f"still running after {limit} steps: {[r.request_id for r in engine.scheduler.running]}"
        outputs.update((o.request_id, o) for o in engine.step() if o.is_finished)
    return outputs


@pytest.mark.parametrize("failure", ["bad's rows", "any step of several groups"])
def test_prompts_chunked_over_several_steps_are_tried_alone_to_their_first_token(monkeypatch, failure):
    """Prompts longer than a step's token budget: a group's own step that computes only a chunk of its prompt does
    not clear it (its sampled row, where the failure is, comes in a later chunk). Whether the sampler fails for one
    group's rows or the forward for any step of several groups, every group ends, in a bounded number of steps: "bad"
    with the error, the others with transformers' tokens (before, the groups went back and forth between a chunk of
    their own and a failing shared step for ever)."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    prompts = make_prompts(3, 20, 20, seed=1)
    engine = make_engine(reference_copy(model), max_batch_tokens=16)
    real_sample, real_run = engine.sampler.sample, engine.runner.run
    fails = []

    def sample(logits, samples, *args, **kwargs):
        if failure == "bad's rows" and any(request.group_id == "bad" for request, _ in samples):
            fails.append(samples)
            raise ValueError("bad's sampling parameters broke the step")
        return real_sample(logits, samples, *args, **kwargs)

    def run(batch, *args):
        if failure != "bad's rows" and len({seq.request.group_id for seq in batch.sequences}) > 1:
            raise RuntimeError("the device fails any step of several groups")
        return real_run(batch, *args)

    monkeypatch.setattr(engine.sampler, "sample", sample)
    monkeypatch.setattr(engine.runner, "run", run)
    names = ["good", "bad", "good2"]
    for name, prompt in zip(names, prompts):
        engine.add_request(name, prompt, GREEDY, max_new_tokens=6)
    outputs = run_bounded(engine, 150)
    engine.block_manager.check_all_free()
    for name, prompt in zip(names, prompts):
        if name == "bad" and failure == "bad's rows":
            assert outputs[name].finish_reason == "error" and "broke the step" in outputs[name].error
            assert len(fails) == 2  # the shared step, then bad's own
        else:
            assert outputs[name].finish_reason == "length", outputs[name].error
            assert outputs[name].generated_tokens == greedy(reference, prompt, 6), name


def test_a_recomputed_sample_beside_its_running_siblings_keeps_its_prompt_kv(monkeypatch):
    """A group of three seeded samples with max_num_seqs=2: its sample 0 decodes in a failing step while samples
    1 and 2 wait outside it, then run on. Sample 0 is recomputed once they end (it waits for a sequence slot) and
    takes their prompt blocks from the prefix cache: its tokens equal those of an undisturbed run, as do the
    others' (a quarantined prompt block, hashed again by a sibling and zeroed when freed, gave it zeros)."""
    model = tiny_model("llama")
    prompts = make_prompts(2, 7, 16, seed=7)
    sampled = SamplingParams(do_sample=True, seed=5, temperature=0.8, stop_token_ids=())

    def run(fail_at: int | None) -> dict:
        engine = make_engine(reference_copy(model), max_num_seqs=2)
        real_run, steps = engine.runner.run, {"n": 0}

        def run(batch, *args):
            steps["n"] += 1
            if steps["n"] == fail_at:
                assert {seq.request.request_id for seq in batch.sequences} == {"g0", "s1#0"}
                raise RuntimeError("flaky device")
            return real_run(batch, *args)

        monkeypatch.setattr(engine.runner, "run", run)
        engine.add_request("g0", prompts[1], GREEDY, max_new_tokens=8)
        engine.add_request("s1", prompts[0], sampled, max_new_tokens=8, n=3)
        outputs = run_bounded(engine, 100)
        engine.block_manager.check_all_free()
        return outputs

    undisturbed, failed = run(None), run(3)
    assert sorted(failed) == ["g0", "s1#0", "s1#1", "s1#2"]
    for key, output in undisturbed.items():
        assert failed[key].finish_reason == "length"
        assert failed[key].generated_tokens == output.generated_tokens, key
        assert failed[key].logprobs == pytest.approx(output.logprobs, abs=1e-5), key


def test_a_drain_right_after_a_failed_step_readmits_the_suspect_that_sampled(monkeypatch):
    """Admission paused (a "wait" pause or weight update drains) just after a failed step whose suspects are a new
    group "A" (nothing sampled, at the queue's head) and "B", which sampled: B is in flight, so it is readmitted
    alone and ends (before, only the queue's first suspect was tried, and the drain never ended); A waits for the
    resume, then both have transformers' tokens."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    prompts = make_prompts(2, 6, 10, seed=4)
    engine = make_engine(reference_copy(model))
    real_run, failed = engine.runner.run, []

    def run(batch, *args):
        if {seq.request.group_id for seq in batch.sequences} == {"A", "B"} and not failed:
            failed.append(batch)
            raise RuntimeError("flaky device")
        return real_run(batch, *args)

    monkeypatch.setattr(engine.runner, "run", run)
    engine.add_request("B", prompts[1], GREEDY, max_new_tokens=6)
    outputs = engine.step() + engine.step()
    engine.add_request("A", prompts[0], GREEDY, max_new_tokens=6)
    outputs += engine.step()
    assert failed and not outputs
    engine.pause_admission()
    for _ in range(20):
        if not engine.num_in_flight():
            break
        outputs += engine.step()
    assert not engine.num_in_flight()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.is_finished] == [("B", "length")]
    engine.resume_admission()
    outputs += run_bounded(engine, 20).values()
    finished = {o.request_id: o.generated_tokens for o in outputs if o.is_finished}
    assert finished == {"A": greedy(reference, prompts[0], 6), "B": greedy(reference, prompts[1], 6)}
    engine.block_manager.check_all_free()
