"""Speculative decoding's drafted steps through their own CUDA graphs (`ModelRunner.verify_graphs`: `DecodeGraphs`
with `width` = 1 + num_speculative_tokens rows a sequence, padding tokens' keys and values in the scratch slot).

On CPU the graphs are not captured (`capture=False` runs the same forward eagerly over the same persistent, padded
buffers, on the Triton kernels in Triton's interpreter): the tokens equal those of the plain engine without drafts,
and the log-probs agree within rounding, for sampled groups whose drafts have every length from none to the most,
in batches padded up to their bucket."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from test_speculative import MODEL, every_draft  # noqa: E402, F401 - the fixture is used by name

from conftest import make_engine, make_prompts, needs_triton_interpreter, run_to_completion  # noqa: E402
from rollout.config import SamplingParams  # noqa: E402
from rollout.engine.runner.verify_layout import verify_layout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ENGINE = dict(num_blocks=96, block_size=16, max_batch_tokens=64, attention_backend="triton", max_model_len=256)
SAMPLED = SamplingParams(do_sample=True, temperature=1.0, seed=7, stop_token_ids=())


def run(speculative: str | None, poison: bool = False) -> tuple[dict, list[tuple[int, int]]]:
    """Three sampled n=2 groups; each output's tokens, log-probs and finish reason, and what each verify-graph step
    served (sequences, draft tokens). `poison`: before each drafted step, NaN in the value slots just past each
    sequence's last position (a previous owner's leftovers, which no step reads before writing them)."""
    model = copy.deepcopy(MODEL).to(DEVICE)
    config = dict(ENGINE, speculative=speculative, num_speculative_tokens=3, speculative_disable_by_batch_size=8)
    if speculative is None:
        config["use_cuda_graph"] = False
    engine = make_engine(model, **config)
    served: list[tuple[int, int]] = []
    if speculative is not None:
        engine.runner.enable_decode_graphs(8, engine.max_model_len, capture=DEVICE.type == "cuda")
        graphs = engine.runner.verify_graphs
        assert graphs is not None and graphs.width == 4
        replay = graphs.run

        def counted(token_ids, positions, block_tables, device_tokens=None, valid=None):
            served.append((len(token_ids) // graphs.width, sum(valid) - len(token_ids) // graphs.width))
            return replay(token_ids, positions, block_tables, device_tokens, valid)

        graphs.run = counted
    if poison:
        poison_past_the_end(engine, config["num_speculative_tokens"])
    for index, prompt in enumerate(make_prompts(3, 6, 12, seed=17)):
        engine.add_request(f"g{index}", prompt, SAMPLED.merged(seed=index), n=2, max_new_tokens=12)
    outputs = run_to_completion(engine)
    engine.close()
    return {key: (list(out.generated_tokens), out.logprobs, out.finish_reason) for key, out in outputs.items()}, served


def poison_past_the_end(engine, num_speculative_tokens: int) -> None:
    """NaN in the value slots of positions start + num_tokens .. start + num_speculative_tokens of each sequence of
    a drafted step (in its own blocks), before the step runs."""
    kv, block_size, step = engine.runner.kv_cache, engine.runner.kv_cache.block_size, engine.runner.run

    def poisoned(batch, unresolved=None):
        if batch.num_draft_tokens:
            for seq in batch.sequences:
                blocks = seq.request.block_ids
                for position in range(seq.start + seq.num_tokens, seq.start + 1 + num_speculative_tokens):
                    if position // block_size < len(blocks):
                        kv.kv[:, 1, blocks[position // block_size], position % block_size] = float("nan")
        return step(batch, unresolved)

    engine.runner.run = poisoned


@needs_triton_interpreter
@pytest.mark.usefixtures("every_draft")
def test_drafted_steps_through_the_verify_graphs_give_the_plain_tokens():
    """Slots past a sequence's last position hold a previous owner's NaN (`poison`): the verify graphs' rows never
    read them (a masked key's weight 0 times NaN is NaN), as the packed path's do not, so the tokens and log-probs
    are the plain engine's."""
    (plain, _), (drafted, served) = run(None), run("suffix", poison=True)
    assert served, "no drafted step went through the verify graphs"
    assert any(drafts > 0 for _, drafts in served)
    assert any(sequences not in (1, 2, 4, 8) for sequences, _ in served), "no step padded up to its bucket"
    assert plain.keys() == drafted.keys()
    for key, (tokens, logprobs, reason) in plain.items():
        assert drafted[key][0] == tokens and drafted[key][2] == reason == "length", key
        assert max(abs(a - b) for a, b in zip(drafted[key][1], logprobs)) < 1e-4, key


def test_the_layout_pads_each_sequence_to_the_width_and_keeps_the_real_rows():
    """Unit: a drafted sequence (2 drafts), a plain decode and a full one (3 drafts) at width 4: padding tokens
    before each sequence's real ones, at the cached positions just before them."""
    from rollout.engine.runner.step_inputs import StepInputs
    from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence

    request = type("Request", (), {})()
    sequences = [
        ScheduledSequence(request, start=10, num_tokens=3, draft=(7, 8)),
        ScheduledSequence(request, start=5, num_tokens=1),
        ScheduledSequence(request, start=20, num_tokens=4, draft=(1, 2, 3)),
    ]
    batch = ScheduledBatch(sequences=sequences, logits_sequences=[0, 1, 2], num_draft_tokens=5)
    inputs = StepInputs(token_ids=[6, 7, 8, 4, 9, 1, 2, 3], one_token_each=False)
    layout = verify_layout(batch, inputs, 4)
    assert layout.token_ids == [0, 6, 7, 8, 0, 0, 0, 4, 9, 1, 2, 3]  # padding first
    assert layout.positions == [9, 10, 11, 12, 2, 3, 4, 5, 20, 21, 22, 23]
    assert layout.valid == [False] + [True] * 3 + [False] * 3 + [True] + [True] * 4
    assert layout.kept == [1, 2, 3, 7, 8, 9, 10, 11]
    assert verify_layout(batch, inputs, 3) is None  # a draft longer than the graphs' width
    sequences[1].start = 2  # three padding tokens, two cached positions to put them on
    assert verify_layout(batch, inputs, 4) is None
    chunk = ScheduledBatch(sequences=[ScheduledSequence(request, start=0, num_tokens=5)], logits_sequences=[0])
    assert verify_layout(chunk, StepInputs(token_ids=[1, 2, 3, 4, 5]), 8) is None  # a prefill chunk
