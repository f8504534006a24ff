"""Which logits row each sample of a step reads, found wrong by a review of speculative decoding: the sampler took
"as many samples as rows" to mean "sample i reads row i". A drafted step has a row per draft token and a new group's
samples share their leader's row, so the counts can match by chance: then a group's samples drew from another
sample's logits (tokens and log-probs of another distribution). Checked on the sampler against the rows it was
given, and on the engine against decoding without drafts (bit for bit under `batch_invariant=True`) and a
teacher-forced transformers forward."""

from __future__ import annotations

import copy

import torch

from conftest import make_prompts, make_request
from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.engine.engine import Engine
from rollout.engine.sampling.sampler import Sampler
from rollout.presets import tiny_model


def test_samples_sharing_a_row_read_their_own_rows_when_the_counts_match():
    """Three samples over three rows, two of them sharing row 0 (a group's first token) and none reading row 1 (a
    draft row): each draws its own row's argmax."""
    vocab = 8
    logits = torch.full((3, vocab), -10.0)
    for row, peak in enumerate((2, 5, 7)):
        logits[row, peak] = 10.0
    samples = [
        (make_request(name, [1, 2], do_sample=False, seed=0), row) for name, row in (("a", 0), ("b", 0), ("c", 2))
    ]
    drawn = Sampler(vocab, "cpu").sample(logits, samples, True).fetch()
    assert drawn.token_ids == [2, 2, 7]


def test_a_new_group_forked_in_a_drafted_step_samples_its_own_logits():
    """A tail of penalized samples (their drafts are verified round by round, nothing drawn ahead) is drafted in the
    step where a new group of 3 gets its first tokens, and its 2 extra samples match the step's draft rows in number:
    the group's tokens and log-probs are those of decoding without drafts, and of a teacher-forced forward."""
    model = tiny_model(0)
    scale_to_entropy(model, make_prompts(6, 20, 40, seed=3), 0.3)
    reference = copy.deepcopy(model)
    tail_prompt, new_prompt = [215, 145, 134, 233, 89, 155, 185], make_prompts(1, 50, 50, seed=8)[0]
    penalized = SamplingParams(temperature=1.0, seed=265, frequency_penalty=-0.3, stop_token_ids=[])
    group = SamplingParams(temperature=1.0, seed=963, stop_token_ids=[], logprob_mode="raw")

    def run(speculative: str | None) -> tuple[dict, int]:
        config = ContinuousBatchingConfig(
            num_blocks=400, block_size=8, max_batch_tokens=32, batch_invariant=True, speculative=speculative
        )
        engine = Engine(copy.deepcopy(model), config)
        engine.add_request("earlier", tail_prompt, penalized, n=4, max_new_tokens=60)  # drafts for the next round
        while engine.has_unfinished():
            engine.step()
        engine.add_request("tail", tail_prompt, penalized, n=4, max_new_tokens=60)
        outputs, step = {}, 0
        while engine.has_unfinished():
            step += 1
            if step == 34:  # its last prompt chunk lands in a drafted step
                engine.add_request("new", new_prompt, group, n=3, max_new_tokens=8)
            for output in engine.step():
                if output.is_finished:
                    outputs[output.request_id] = (list(output.generated_tokens), list(output.logprobs))
        accepted = engine.scheduler.drafter.accepted_tokens if speculative else 0
        engine.close()
        return outputs, accepted

    plain, _ = run(None)
    drafted, accepted = run("suffix")
    assert accepted > 0  # drafts were verified: the comparison could fail
    assert drafted == plain
    for index in range(3):
        tokens, logprobs = drafted[f"new#{index}"]
        with torch.no_grad():
            logits = reference(torch.tensor([new_prompt + tokens])).logits[0, len(new_prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
