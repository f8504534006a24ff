"""The model lent to engines (model_lease.py) and the build-time probe: a peft model shares the lease of the
transformers model it wraps, engines built at once from several threads see one another, and a model kernelized
with the `kernels` library is given back in the mode it was kernelized for."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, run_to_completion, tiny_model
from rollout import SamplingParams

PAGED = "rollout_paged"


def greedy_tokens(engine, prompts: list[list[int]], new: int = 5) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(do_sample=False, stop_token_ids=[]), max_new_tokens=new)
    outputs = run_to_completion(engine)
    return [outputs[f"r{index}"].generated_tokens for index in range(len(prompts))]


def generate_tokens(model, prompts: list[list[int]], new: int = 5) -> list[list[int]]:
    return [
        model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[
            0, len(prompt) :
        ].tolist()
        for prompt in prompts
    ]


def test_a_peft_model_around_a_model_an_engine_holds_shares_its_lease():
    """An engine on a peft model whose base another engine serves: not probed again (the probe would switch the
    attention under the first engine's steps), and closing the first engine leaves it running (the lease was keyed
    on the wrapper, so the first close gave the shared config its own attention back under the second engine). The
    adapter layers peft added meanwhile are served in eval mode (their dropout off) and given back in train mode."""
    base = tiny_model().eval()
    implementation = base.config._attn_implementation
    first = make_engine(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5, init_lora_weights=False)
    peft = get_peft_model(base, lora)
    added = [(module, module.training) for module in peft.modules()]
    assert any(flag for _, flag in added)  # peft makes its layers in train mode (dropout on)
    second = make_engine(peft)
    first.close()
    assert base.config._attn_implementation == PAGED  # the second engine still holds it
    prompts = make_prompts(3, 4, 9, seed=3)
    tokens = greedy_tokens(second, prompts)
    second.close()
    assert base.config._attn_implementation == implementation
    assert [module.training for module, _ in added] == [flag for _, flag in added]
    assert tokens == generate_tokens(peft.eval(), prompts)  # peft's own forward, LoRA applied, no dropout


def test_an_engine_on_a_peft_model_whose_adapter_was_deleted_still_gives_the_model_back():
    """peft's get_base_model() reads the active adapter's config, which delete_adapter removes: closing the engine
    raised KeyError and left the model on the paged attention for good (the runner counted itself closed)."""
    base = tiny_model().eval()
    implementation = base.config._attn_implementation
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = make_engine(peft)
    peft.delete_adapter("default")
    engine.close()
    assert base.config._attn_implementation == implementation


def test_engines_built_at_once_on_one_model_leave_it_as_it_was(monkeypatch):
    """Two threads build engines on one model while the first one's probe forward runs: the second must not take
    the model (or record the probe's switch as the model's own attention) until the probe is done."""
    model = tiny_model().eval()
    implementation = model.config._attn_implementation
    second_built = threading.Event()
    inner = model.model.forward
    paused = []

    def probe_forward_that_pauses(*args, **kwargs):
        if threading.current_thread().name == "first" and not paused:
            paused.append(True)
            second_built.wait(timeout=1.0)  # with the lease lock the second build waits instead: this times out
        return inner(*args, **kwargs)

    monkeypatch.setattr(model.model, "forward", probe_forward_that_pauses)
    engines, errors = {}, []

    def build(name: str) -> None:
        try:
            engines[name] = make_engine(model)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            if name == "second":
                second_built.set()

    first = threading.Thread(target=build, args=("first",), name="first")
    first.start()
    while not paused:
        threading.Event().wait(0.01)
    second = threading.Thread(target=build, args=("second",), name="second")
    second.start()
    first.join()
    second.join()
    assert not errors
    assert model.config._attn_implementation == PAGED
    prompts = make_prompts(2, 4, 9, seed=4)
    tokens = greedy_tokens(engines["second"], prompts)
    for engine in engines.values():
        engine.close()
    monkeypatch.undo()
    assert model.config._attn_implementation == implementation
    assert tokens == generate_tokens(model, prompts)


def test_a_kernelized_model_in_training_is_given_back_kernelized_for_training():
    """transformers' eval() kernelizes a `use_kernels` model for inference; setting the training flags back does not
    kernelize it again, so a trainer went on with inference kernels after building an engine."""
    kernels = pytest.importorskip("kernels")
    model = tiny_model().train()
    model.set_use_kernels(True)
    assert model.kernels_mode == kernels.Mode.TRAINING
    engine = make_engine(model)
    assert model.kernels_mode == kernels.Mode.INFERENCE  # served in eval mode
    engine.close()
    assert model.training and model.kernels_mode == kernels.Mode.TRAINING


def test_a_kernelized_model_inside_a_peft_model_is_given_back_kernelized_for_training():
    """peft forwards `kernels_mode` to the model it wraps: read and set on the wrapper, the mode was put on the
    wrapper's own attributes and the model inside stayed kernelized for inference."""
    kernels = pytest.importorskip("kernels")
    base = tiny_model().train()
    base.set_use_kernels(True)
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    make_engine(peft).close()
    assert base.training and base.kernels_mode == kernels.Mode.TRAINING
    assert "kernels_mode" not in vars(peft)
