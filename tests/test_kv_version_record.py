"""`kv_version_min` keeps the record of the oldest weights behind the KV a sample's tokens were sampled on, where
a "keep" commit meets the prefix cache or a preemption. Both were found by an adversarial review; the tokens are
checked against transformers' forward passes over a KV cache built half under each weights (`mixed_kv_greedy`).

- A request admitted on a prefix-cache hit but not computed in that step, then a "keep" commit: its tokens are the
  new weights over the old weights' cached prefix, and it reported `kv_version_min` 1 (the commit's), as if its KV
  were all new.
- A sample whose first tokens were sampled over KV of the old weights, then preempted and recomputed under the new
  ones: its record was reset to the new version, so `sample_oldest_version` (what `max_staleness` bounds) said 1.
"""

from __future__ import annotations

import torch
from test_weight_updates import greedy, mixed_kv_greedy

from conftest import make_engine, make_prompts, tiny_model
from rollout.config import SamplingParams
from trainer_bridge.client.calls import sample_oldest_version

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def finished(engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        outputs.update((output.request_id, output) for output in engine.step() if output.is_finished)
    return outputs


@torch.no_grad()
def test_a_prefix_hit_admitted_before_a_keep_commit_reports_the_prefixs_version():
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(tiny_model(seed=0), max_num_seqs=2, num_blocks=1024)
    prefix = make_prompts(1, 20, 20, seed=3)[0]
    engine.add_request("warm", prefix, GREEDY, max_new_tokens=2)
    finished(engine)  # its prompt blocks stay in the prefix cache, under version 0
    for index, prompt in enumerate(make_prompts(2, 8, 8, seed=4)):  # the running set full: max_num_seqs
        engine.add_request(f"long{index}", prompt, GREEDY, max_new_tokens=60)
    for _ in range(3):
        engine.step()
    prompt = prefix + [5, 6]
    engine.add_request("short", prompt, GREEDY, max_new_tokens=4)
    engine.step()  # admitted through the express lane on the cached prefix, not computed yet
    (short,) = [request for request in engine.scheduler.running if request.request_id == "short"]
    assert short.num_computed_tokens == 20 and short.num_output_tokens == 0, "the case did not arise"
    engine.update_weights(new.state_dict(), mode="keep")
    output = finished(engine)["short"]
    assert output.generated_tokens == mixed_kv_greedy(old, new.state_dict(), prompt[:20], prompt[20:], 4)
    assert output.generated_tokens != greedy(new, prompt, 4), "the check could not tell the weights apart"
    assert output.policy_versions == [[1, 0]] and output.kv_version_min == 0  # was 1


@torch.no_grad()
def test_a_preemption_keeps_the_record_of_the_weights_behind_earlier_tokens():
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(tiny_model(seed=0), max_batch_tokens=16)
    prompt = make_prompts(1, 40, 40, seed=19)[0]
    engine.add_request("late", prompt, GREEDY, max_new_tokens=12)
    engine.step()  # the first 16 prompt tokens under the old weights
    (request,) = engine.scheduler.running
    engine.update_weights(new.state_dict(), mode="keep")
    while request.num_output_tokens < 4:
        engine.step()
    assert request.kv_version_min == 0 and request.token_versions == [[1, 0]]
    engine.scheduler.recompute(request)  # what a preemption under memory pressure does
    output = finished(engine)["late"]
    first = mixed_kv_greedy(old, new.state_dict(), prompt[:16], prompt[16:], 4)
    assert output.generated_tokens == first + greedy(new, prompt + first, 8)  # the rest: recomputed under the new
    assert output.kv_version_min == 0  # was 1: the first tokens were sampled over the old weights' KV
    assert sample_oldest_version(output) == 0
