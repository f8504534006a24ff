"""GPU test (`pytest -m gpu tests/gpu`) of `batch_invariant=True` on CUDA: the engine's log-probs (its linear layers
on the fixed-tile Triton matmul, its attention through `rollout.invariant.attend_invariant`) equal the trainer's
forward under `trainer_bridge.batch_invariant` in TRL's padded layout bit for bit, in bf16, on a model scaled to
realistic entropy, through chunked prefill and shared prompts. Skipped without CUDA (CI has none)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_gpu import small_qwen3

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.benchmarks.throughput.fidelity import padded_batch_logprobs, scale_to_entropy
from rollout.engine.engine import Engine
from trainer_bridge import batch_invariant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "budget, overlap, graphs",
    [(48, False, False), (48, True, True), (1024, False, True), (1024, True, False)],
    ids=["chunked-serial-eager", "chunked-overlapped-graphs", "whole-serial-graphs", "whole-overlapped-eager"],
)
def test_bf16_engine_logprobs_equal_the_trainers_invariant_forward(budget, overlap, graphs):
    """Decode steps eager or replayed from CUDA graphs captured over the invariant kernels."""
    model = small_qwen3(torch.bfloat16)  # built in bf16: its rotary frequencies stay fp32, as a worker's
    scale_to_entropy(model, [list(range(3, 40)), list(range(100, 160))])
    trainer = copy.deepcopy(model)
    config = ContinuousBatchingConfig(
        batch_invariant=True,
        num_blocks=512,
        max_batch_tokens=budget,
        overlap_scheduling=overlap,
        use_cuda_graph=graphs,
    )
    engine = Engine(model, config)
    assert (engine.runner.decode_graphs is not None) == graphs
    for index, prompt in enumerate([[(7 * i + j) % 4096 for j in range(5 + 9 * i)] for i in range(6)]):
        engine.add_request(f"g{index}", prompt, SamplingParams(temperature=1.0, seed=index), n=3, max_new_tokens=40)
    samples = []
    while engine.has_unfinished():
        samples += [(o.prompt_ids, o.generated_tokens, o.logprobs) for o in engine.step() if o.is_finished]
    engine.close()
    assert len(samples) == 18
    prompts, completions = [list(p) for p, _, _ in samples], [list(c) for _, c, _ in samples]
    with batch_invariant(trainer):  # the trainer's forward: TRL's layout, batches of 5
        reference = list(padded_batch_logprobs(trainer, prompts, completions, batch_size=5))
    gaps = [float((torch.tensor(lp) - ref).abs().max()) for (_, _, lp), ref in zip(samples, reference)]
    where = [
        (len(p), int((torch.tensor(lp) != ref).nonzero()[0]))
        for (p, _, lp), ref in zip(samples, reference)
        if not torch.equal(torch.tensor(lp), ref)
    ]
    assert max(gaps) == 0.0, (
        f"largest |delta| {max(gaps):.3e}, {len(where)} of {len(gaps)} samples; (prompt length, first token that "
        f"differs): {where}"
    )


def _record_outputs(model: torch.nn.Module, store: list) -> list:
    """Hooks appending (module name, its first floating output) to `store` at every module's forward."""

    def hook_for(name: str):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.is_floating_point():
                store.append((name, out.detach().clone()))

        return hook

    return [module.register_forward_hook(hook_for(name)) for name, module in model.named_modules() if name]


def test_the_engines_forward_equals_the_trainers_module_by_module():
    """One 70-token prompt (two key blocks) prefilled in one step, then 11 decode steps: every module's output in
    the engine equals the same module's output in the trainer's invariant forward over the same tokens, at the same
    positions; a failure names the first module that differs."""
    model = small_qwen3(torch.bfloat16)
    scale_to_entropy(model, [list(range(3, 40)), list(range(100, 160))])
    trainer = copy.deepcopy(model)
    prompt = [(11 * j + 3) % 4096 for j in range(70)]
    # Eager: a replayed graph runs no forward hook.
    config = ContinuousBatchingConfig(
        batch_invariant=True, num_blocks=64, overlap_scheduling=False, use_cuda_graph=False
    )
    engine = Engine(model, config)
    engine.add_request("one", prompt, SamplingParams(temperature=1.0, seed=3), max_new_tokens=12)
    steps, store = [], []
    hooks = _record_outputs(model, store)
    try:
        while engine.has_unfinished():
            store.clear()
            finished = [o for o in engine.step() if o.is_finished]
            steps.append(list(store))
    finally:
        for hook in hooks:
            hook.remove()
        engine.close()
    completion = list(finished[0].generated_tokens)
    expected: list = []
    hooks = _record_outputs(trainer, expected)
    try:
        with torch.no_grad(), batch_invariant(trainer):
            ids = torch.tensor([prompt + completion], device=next(trainer.parameters()).device)
            trainer(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for hook in hooks:
            hook.remove()
    reference = dict(reversed(expected))  # a module's first call
    differences = []
    first = 0
    for step, outputs in enumerate(steps):
        width = len(prompt) if step == 0 else 1
        for name, ours in outputs:
            theirs = reference.get(name)
            if theirs is None or theirs.dim() != ours.dim() or theirs.shape[2:] != ours.shape[2:]:
                continue
            end = first + width
            theirs = theirs[:, end - ours.shape[1] : end]
            if theirs.shape == ours.shape and not torch.equal(theirs, ours):
                differences.append((step, name, float((theirs.float() - ours.float()).abs().max())))
        first += width
    assert not differences, f"first differences (step, module, max |delta|): {differences[:6]}"
