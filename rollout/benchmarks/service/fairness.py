"""`rollout-bench fairness`: how long a short request from a second client waits behind a first client's work, with
the scheduler's express lane (`rollout/engine/scheduling/express_lane.py`) open, as it is by default, and closed
(`ExpressLane(..., fraction=0.0)`: no blocks, no sequence slots of its own), side by side. In-process, on the tiny
preset, one engine per run.

Client A submits its work; after A has run a few steps, client B submits one sample of a 16-token prompt and 4 new
tokens. Each run goes on until every sample finished or `--max-steps` steps ran. Reported per run: B's wait, in
engine steps and seconds from its submission to its final output ("finished": false and no figures when it had
not finished by the cap), how many of A's samples finished before it, A's tokens generated per second over the
whole run, the preemptions, and the steps run. No sample stops early (no stop tokens), so every run does the same
work.

- tight-cache: A's 32 groups of 4 samples of 160 tokens in a cache holding about a third of their peak KV; the
  growth reserve keeps A's later groups queued, and without the lane B waits for A's first groups to end.
- wide-group: A's one group of 32 samples of 200 tokens, twice max_num_seqs (16): it fills the running set for its
  whole life, and without the lane B waits for the whole group.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.scheduling.block_manager import cdiv
from rollout.engine.scheduling.express_lane import EXPRESS_FRACTION, ExpressLane, life_blocks
from rollout.presets.models import tiny_model

BLOCK_SIZE = 16
PROMPT_TOKENS = 16  # every prompt's length, A's and B's
B_NEW_TOKENS = 4
VOCAB = range(5, 1000)  # token ids of the tiny preset, its special tokens left out


@dataclass(frozen=True)
class Scenario:
    """A's work and the engine it runs in.

    Attributes:
        groups: A's groups, submitted at once.
        n: samples per group.
        max_new_tokens: every sample's length (no stop tokens).
        max_num_seqs: the engine's sequence slots.
        cache_share: the cache's blocks, as a share of the blocks all of A's groups hold at their peak.
        b_after: engine steps A runs before B submits.
    """

    groups: int
    n: int
    max_new_tokens: int
    max_num_seqs: int
    cache_share: float
    b_after: int

    def num_blocks(self) -> int:
        """The cache's blocks: `cache_share` of A's groups' peak; at least one group's peak with B's life beside it,
        and enough that the open lane's share holds B's life (else the lane could not take B: nothing to compare)."""
        own = cdiv(PROMPT_TOKENS + self.max_new_tokens - 1, BLOCK_SIZE)
        peak = own + (self.n - 1) * (cdiv(self.max_new_tokens - 1, BLOCK_SIZE) + 1)  # as `life_blocks` counts
        b_life = cdiv(PROMPT_TOKENS + B_NEW_TOKENS - 1, BLOCK_SIZE)
        return max(int(self.groups * peak * self.cache_share), peak + b_life, math.ceil(b_life / EXPRESS_FRACTION))


SCENARIOS = {
    "tight-cache": Scenario(groups=32, n=4, max_new_tokens=160, max_num_seqs=256, cache_share=1 / 3, b_after=10),
    "wide-group": Scenario(groups=1, n=32, max_new_tokens=200, max_num_seqs=16, cache_share=2.0, b_after=4),
}


def run(
    scenarios: tuple[str, ...] = tuple(SCENARIOS),
    max_steps: int = 1000,
    seed: int = 0,
    shapes: dict[str, Scenario] | None = None,
) -> dict:
    """Run each scenario with the lane open, then closed; return the JSON-able summary (a table line is printed as
    each run ends).

    Args:
        scenarios: names in `SCENARIOS`, run in this order.
        max_steps: the most engine steps a run takes (B not finished by then: reported as not finished).
        seed: the model's seed, and the prompts' and samples'.
        shapes: scenarios by name, in place of `SCENARIOS`' (smaller ones for a quick run).
    Raises:
        ValueError: an unknown scenario, max_steps < 1, or a cache whose lane cannot hold B's request.
    """
    shapes = {**SCENARIOS, **(shapes or {})}
    unknown = [name for name in scenarios if name not in shapes]
    if unknown or max_steps < 1:
        raise ValueError(f"scenarios must be among {sorted(shapes)} (got {unknown}), max_steps >= 1 (got {max_steps})")
    model = tiny_model(seed)
    summary: dict[str, Any] = {"benchmark": "fairness", "max_steps": max_steps, "seed": seed, "scenarios": {}}
    print(
        f"B ({PROMPT_TOKENS}-token prompt, {B_NEW_TOKENS} new tokens) behind A's work, at most {max_steps} steps a run"
    )
    print(
        f"{'scenario':<13}{'lane':<8}{'B wait steps':>13}{'B wait s':>10}{'A done before B':>17}"
        f"{'A tokens/s':>12}{'preempted':>11}{'steps':>7}{'seconds':>9}",
        flush=True,
    )
    for name in scenarios:
        shape = shapes[name]
        figures = {"shape": {**asdict(shape), "num_blocks": shape.num_blocks()}}
        for lane in ("open", "closed"):
            line = _run_one(model, shape, lane == "open", max_steps, seed)
            figures[lane] = line
            steps = line["b_wait_steps"] if line["finished"] else "not finished"
            steps = "not sent" if line["b_submitted_step"] is None else steps
            seconds = f"{line['b_wait_s']:.2f}" if line["finished"] else "-"
            print(
                f"{name:<13}{lane:<8}{steps:>13}{seconds:>10}{line['a_samples_done_before_b']:>17}"
                f"{line['a_tokens_per_s']:>12.1f}{line['preemptions']:>11}{line['steps']:>7}{line['seconds']:>9.2f}",
                flush=True,
            )
        summary["scenarios"][name] = figures
    return summary


def _run_one(model: Any, shape: Scenario, lane_open: bool, max_steps: int, seed: int) -> dict:
    """One engine, A's work, then B's request after `shape.b_after` steps; stepped until every sample finished or
    `max_steps` steps ran."""
    num_blocks = shape.num_blocks()
    config = ContinuousBatchingConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=shape.max_num_seqs)
    engine = Engine(model, config)
    try:
        engine.warmup()  # not counted: first-call costs are no one's wait
        if not lane_open:
            engine.scheduler.admission.express = ExpressLane(num_blocks, BLOCK_SIZE, shape.max_num_seqs, fraction=0.0)
        rng = random.Random(seed)
        for g in range(shape.groups):
            sampling = SamplingParams(
                do_sample=True, seed=seed + g, max_new_tokens=shape.max_new_tokens, stop_token_ids=[]
            )
            prompt = [rng.choice(VOCAB) for _ in range(PROMPT_TOKENS)]
            engine.submit(engine.intake.prepare(GroupSpec(f"a{g}", prompt, sampling, shape.n, client="A")))
        b_prompt = [rng.choice(VOCAB) for _ in range(PROMPT_TOKENS)]
        b_sampling = SamplingParams(do_sample=True, seed=seed, max_new_tokens=B_NEW_TOKENS, stop_token_ids=[])
        b_request = engine.intake.prepare(GroupSpec("b", b_prompt, b_sampling, 1, client="B"))
        # The figure means something only where the open lane can take B: its life fits the lane's blocks.
        capacity = ExpressLane(num_blocks, BLOCK_SIZE, shape.max_num_seqs).capacity
        if life_blocks(b_request, BLOCK_SIZE) > capacity:
            raise ValueError(f"B's request needs {life_blocks(b_request, BLOCK_SIZE)} blocks, the lane has {capacity}")
        steps = a_done = 0
        b_submitted = b_done = b_tokens = None
        a_done_before_b = None
        started = time.perf_counter()
        while steps < max_steps and (b_submitted is None or engine.has_unfinished()):
            if steps == shape.b_after:
                engine.submit(b_request)
                b_submitted = (steps, time.perf_counter())
            outputs = engine.step()
            steps += 1
            for output in outputs:
                if not output.is_finished:
                    continue
                if output.group_id == "b":
                    b_done, b_tokens = (steps, time.perf_counter()), len(output.generated_tokens)
                    a_done_before_b = a_done
                else:
                    a_done += 1
        seconds = time.perf_counter() - started
        a_tokens = engine.counters.generated_tokens - (b_tokens or 0)
        finished = b_done is not None
        return {
            "b_submitted_step": None if b_submitted is None else b_submitted[0],  # None: the cap came first
            "finished": finished,
            "b_wait_steps": b_done[0] - b_submitted[0] if finished else None,
            "b_wait_s": round(b_done[1] - b_submitted[1], 3) if finished else None,
            "a_samples_done_before_b": a_done if a_done_before_b is None else a_done_before_b,
            "a_samples": shape.groups * shape.n,
            "a_tokens": a_tokens,
            "a_tokens_per_s": round(a_tokens / seconds, 1),
            "preemptions": engine.scheduler.num_preemptions,
            "steps": steps,
            "seconds": round(seconds, 3),
        }
    finally:
        engine.cancel(*engine.open_group_ids())
        engine.close()
