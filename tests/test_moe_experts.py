"""An MoE model runs transformers' sync-free experts while an engine holds it: its decode steps read nothing back to
the host (so a GPU can capture them in graphs like a dense model's), its tokens equal transformers' `generate` with
the model's own experts, and the model's own setting comes back when the engine lets go."""

from __future__ import annotations

import torch
from test_overlap import HostReads

from conftest import make_prompts, reference_copy, run_to_completion, tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine

GREEDY = SamplingParams(do_sample=False, max_new_tokens=8, stop_token_ids=())
PROMPTS = make_prompts(3, 6, 14, seed=70)


def _eager_moe() -> torch.nn.Module:
    """A tiny Qwen3-MoE whose experts run transformers' eager loop (reads the routing back to the host)."""
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("eager")
    return model


def _run(model: torch.nn.Module) -> tuple[dict, list[str], dict]:
    """Greedy outputs, the host reads made while queueing steps, and the experts implementation during the run."""
    engine = Engine(model, ContinuousBatchingConfig(num_blocks=64, block_size=4))
    during = model.get_experts_implementation()
    spy = HostReads()
    launch = engine.loop._launch

    def watched_launch(batch, prior):
        spy.active = True
        try:
            with spy:
                return launch(batch, prior)
        finally:
            spy.active = False

    engine.loop._launch = watched_launch
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"p{index}", prompt, GREEDY)
    outputs = run_to_completion(engine)
    engine.close()
    return outputs, spy.calls, during


def test_moe_decodes_without_host_reads_and_gives_its_experts_back():
    model = _eager_moe()
    reference = reference_copy(model)  # keeps the eager experts: generate runs the model's own
    outputs, reads, during = _run(model)
    assert during == {"": "grouped_mm"} and reads == []
    assert model.get_experts_implementation() == {"": "eager"}  # given back as found
    for index, prompt in enumerate(PROMPTS):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert outputs[f"p{index}"].generated_tokens == expected.tolist()


def test_a_batch_invariant_engine_runs_the_trainers_eager_experts_and_agrees_with_its_neighbours():
    """`batch_invariant=True` runs the eager loop the trainer's block runs (one F.linear per expert), also after the
    engine suspends and resumes (colocated training); an ordinary engine on the same model meanwhile is refused by
    name (one of them would run the other's experts); the model's own setting comes back at close."""
    import pytest

    model = tiny_model("qwen3_moe")
    own = model.get_experts_implementation()
    engine = Engine(model, ContinuousBatchingConfig(num_blocks=64, block_size=4, batch_invariant=True))
    assert model.get_experts_implementation() == {"": "eager"}
    with pytest.raises(ValueError, match="batch_invariant"):
        Engine(model, ContinuousBatchingConfig(num_blocks=64, block_size=4))
    engine.runner.suspend()
    assert model.get_experts_implementation() == own
    engine.runner.resume()
    assert model.get_experts_implementation() == {"": "eager"}
    engine.close()
    assert model.get_experts_implementation() == own


def test_a_refused_resume_leaves_the_engine_suspended_and_its_neighbour_serving():
    """A suspended batch-invariant engine (colocated training) whose model an ordinary engine took meanwhile: its
    resume is refused by name, it stays suspended holding nothing, and closing it leaves the other engine serving."""
    import pytest

    model = tiny_model("qwen3_moe")
    own = model.get_experts_implementation(), model.config._attn_implementation
    invariant = Engine(model, ContinuousBatchingConfig(num_blocks=64, block_size=4, batch_invariant=True))
    invariant.runner.suspend()
    ordinary = Engine(model, ContinuousBatchingConfig(num_blocks=64, block_size=4))
    with pytest.raises(ValueError, match="batch_invariant"):
        invariant.runner.resume()
    invariant.close()
    ordinary.add_request("p", PROMPTS[0], GREEDY)
    assert len(run_to_completion(ordinary)["p"].generated_tokens) == 8
    ordinary.close()
    assert (model.get_experts_implementation(), model.config._attn_implementation) == own  # given back as found


def test_a_peft_adapter_of_an_moe_models_attention_is_served_unmerged():
    """peft records `target_parameters=set()` for an MoE model's adapter that targets no bare parameter: that is no
    LoRA on the experts, and the adapter is served unmerged; LoRA on the experts' parameters is refused by name."""
    import pytest
    from peft import LoraConfig, get_peft_model

    from rollout.config import FieldError
    from rollout.engine.lora.adapter_weights import from_peft_model
    from rollout.peft_adapters import check_peft_config

    peft_model = get_peft_model(tiny_model("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"]))
    assert not peft_model.peft_config["default"].target_parameters  # an empty collection, as peft stores it
    assert any(name.endswith("q_proj") for name in from_peft_model(peft_model, "default"))
    with pytest.raises(FieldError, match="target_parameters"):
        check_peft_config(LoraConfig(r=4, target_parameters=["mlp.experts.gate_up_proj"]))
