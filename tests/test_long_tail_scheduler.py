"""The scheduler at the long-tail shape of reasoning GRPO, without a model: lognormal output lengths that the
scheduler does not know (every sample asks for the cap and stops at its own length), and a KV cache at 27% of the
peak demand, so preemption is the normal state. Every sample finishes (no livelock), none is preempted more than a
few times (no starvation), the tokens recomputed stay under 10% of those generated, and a group's prompt blocks are
computed at most once more after preemption. GRPO groups come both ways a trainer sends them: one request of n
samples (forked after the prompt), and n requests of one sample with the same prompt (the HTTP API's way)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from conftest import make_request, make_scheduler
from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import cdiv
from rollout.engine.scheduling.scheduler import Scheduler

BLOCK = 16
TOKEN, STOP = 7, 2
GROUPS, N, MEDIAN, CAP, PROMPTS = 24, 8, 256, 2048, (50, 400)


@dataclass
class Run:
    """What a drained run computed."""

    scheduler: Scheduler
    lengths: dict[str, int]
    prompts: dict[str, list[int]]
    steps: int = 0
    computed: int = 0
    finished: dict[str, Request] = field(default_factory=dict)
    preemptions: Counter = field(default_factory=Counter)  # sample id -> times preempted
    block_computes: Counter = field(default_factory=Counter)  # (group, shareable prompt block) -> times computed


def long_tail(forked: bool, seed: int = 0, cache_fraction: float = 0.27) -> Run:
    """Queue GROUPS prompts x N samples and step the scheduler until all finish, counting what it computes."""
    rng = random.Random(seed)
    lengths: dict[str, int] = {}
    prompts: dict[str, list[int]] = {}
    requests = []
    for g in range(GROUPS):
        prompt = [100 + rng.randrange(5000) for _ in range(rng.randint(*PROMPTS))]
        prompts[f"g{g}"] = prompt
        ids = [f"g{g}#{j}" for j in range(N)] if forked else [f"g{g}s{j}" for j in range(N)]
        for sample_id in ids:
            lengths[sample_id] = min(CAP, max(1, round(rng.lognormvariate(math.log(MEDIAN), 1.0))))
        if forked:
            requests.append(make_request(f"g{g}", prompt, max_new_tokens=CAP, n=N, stop_token_ids=(STOP,)))
        else:
            requests += [make_request(i, prompt, max_new_tokens=CAP, stop_token_ids=(STOP,)) for i in ids]
    peak = sum(cdiv(len(prompts[i.split("#")[0].split("s")[0]]) + n, BLOCK) for i, n in lengths.items())
    longest = cdiv(max(map(len, prompts.values())) + CAP, BLOCK)
    scheduler = make_scheduler(
        num_blocks=max(math.ceil(cache_fraction * peak), longest),
        block_size=BLOCK,
        max_batch_tokens=2048,
        max_num_seqs=1024,
    )
    for request in requests:
        scheduler.add(request)
    run = Run(scheduler, lengths, prompts)
    while scheduler.has_unfinished():
        assert run.steps < 20 * CAP, "livelock: the run does not finish"
        running_before = set(map(id, scheduler.running))
        batch = scheduler.schedule()
        run.steps += 1
        for request in (r for r in scheduler.waiting if id(r) in running_before):
            run.preemptions[request.request_id] += 1
        for seq in batch.sequences:
            run.computed += seq.num_tokens
            group = seq.request.group_id.split("s")[0]
            # Shareable prompt blocks: full ones a prompt's last token is not in (that token is always computed, as
            # its logits are needed), whose last token this chunk computes.
            end = min(seq.start + seq.num_tokens, (len(prompts[group]) - 1) // BLOCK * BLOCK)
            for block in range(seq.start // BLOCK, cdiv(end, BLOCK)):
                if seq.start <= block * BLOCK + BLOCK - 1 < end:
                    run.block_computes[(group, block)] += 1
        scheduler.advance(batch, 0)
        tokens = [STOP if r.num_output_tokens >= lengths[r.request_id] else TOKEN for r, _ in batch.samples]
        for request in scheduler.resolve(batch, tokens) + batch.finished:
            if request.is_finished:
                run.finished[request.request_id] = request
    scheduler.block_manager.check_all_free()
    return run


@pytest.fixture(scope="module", params=[True, False], ids=["forked-groups", "separate-samples"])
def run(request) -> Run:
    return long_tail(forked=request.param)


def test_every_sample_finishes_at_its_own_length(run):
    assert run.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    assert len(run.finished) == GROUPS * N
    for sample_id, request in run.finished.items():
        assert request.finish_reason == "stop" and request.num_output_tokens == run.lengths[sample_id]
    # The longest sample decodes one token per step: the run takes not much longer than it.
    assert run.steps < 3 * max(run.lengths.values())


def test_no_sample_is_preempted_again_and_again(run):
    assert max(run.preemptions.values()) <= 3, run.preemptions.most_common(3)


def test_recomputed_tokens_stay_under_a_tenth_of_generated(run):
    """Recomputed: every token computed beyond each group's prompt once and each generated token but the last of
    each sample (the tokens a run with an unbounded cache computes)."""
    generated = sum(run.lengths.values())
    minimum = sum(map(len, run.prompts.values())) + generated - len(run.lengths)
    assert run.computed >= minimum
    assert (run.computed - minimum) / generated <= 0.10, (run.computed - minimum) / generated


def test_group_prompt_blocks_are_recomputed_at_most_once(run):
    assert run.scheduler.num_preemptions > 0
    shareable = {(g, b) for g, p in run.prompts.items() for b in range((len(p) - 1) // BLOCK)}
    assert set(run.block_computes) == shareable
    assert max(run.block_computes.values()) <= 2, run.block_computes.most_common(3)
