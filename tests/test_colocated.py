"""ColocatedEngine: the engine inside the trainer's process on the trainer's own model (trainer_bridge/colocated.py).

References we did not write: a rollout-worker subprocess on the same weights (what colocated must equal), a
training forward/backward of an untouched copy of the model, and transformers' own model state (training flag,
gradient checkpointing, attention implementation)."""

from __future__ import annotations

import copy
import gc
import json
import textwrap
import weakref

import numpy as np
import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.presets import tiny_model
from service_helpers import run_ranks
from trainer_bridge import ColocatedEngine, PromptGroup, RolloutClient

CONFIG = ContinuousBatchingConfig(num_blocks=256, block_size=16)
PROMPTS = [[5, 9, 14, 3, 7], [11, 2, 8, 8, 30, 4, 6, 1, 9], [3, 3, 3]]


def groups() -> list[PromptGroup]:
    """Greedy, sampled with a seed (a group of 3), and sampled with top_p and processed logprobs."""
    return [
        PromptGroup(PROMPTS[0], 1, SamplingParams(do_sample=False, max_new_tokens=12, stop_token_ids=()), "greedy"),
        PromptGroup(PROMPTS[1], 3, {"temperature": 0.9, "seed": 7, "max_new_tokens": 10, "stop_token_ids": []}, "g"),
        PromptGroup(
            PROMPTS[2],
            2,
            SamplingParams(temperature=1.1, top_p=0.8, seed=3, max_new_tokens=9, logprob_mode="processed"),
            "top_p",
        ),
    ]


@pytest.fixture(scope="module")
def worker(http_worker):
    return http_worker  # the session's worker on the tiny model (nothing here changes its weights)


def checkpointing(model: torch.nn.Module, what: str):
    """transformers' (activation | gradient) checkpointing attribute (renamed in transformers 5.x)."""
    new, old = {
        "enable": ("activation_checkpointing_enable", "gradient_checkpointing_enable"),
        "is": ("is_activation_checkpointing", "is_gradient_checkpointing"),
    }[what]
    return getattr(model, new) if hasattr(type(model), new) else getattr(model, old)


def training_loss(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A training forward/backward on a fixed batch: (loss, every parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    batch = torch.tensor([PROMPTS[1], [4, 5, 6, 7, 8, 9, 10, 11, 12]])
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in model.parameters()]


def test_completions_equal_a_workers(worker, capsys):
    """The same weights, prompts and seeds: the same tokens, finish reasons and policy versions as a worker, and
    logprobs within 1e-5 (fp32; the batches differ, so the sums may round differently). The progress bar ends at
    every sample and every token generated."""
    with RolloutClient(worker.address) as client:
        served = {result.group_id: result for result in client.generate_many(groups())}  # in finishing order
    with ColocatedEngine(tiny_model(0), CONFIG) as engine:
        colocated = engine.generate(groups(), progress_bar=True)
    tokens = sum(len(completion.token_ids) for result in colocated for completion in result.completions)
    last = capsys.readouterr().err.strip().split("\r")[-1]
    assert " 6/6 " in last and f"tokens={tokens}," in last
    assert [result.group_id for result in colocated] == ["greedy", "g", "top_p"]
    for ours in colocated:
        theirs = served[ours.group_id]
        assert ours.prompt_ids == theirs.prompt_ids
        assert len(ours.completions) == len(theirs.completions)
        for a, b in zip(ours.completions, theirs.completions):
            assert (a.sample_index, a.token_ids, a.finish_reason) == (b.sample_index, b.token_ids, b.finish_reason)
            assert a.policy_versions == b.policy_versions == [[0, 0]]
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_a_round_leaves_the_trainers_model_as_it_was():
    """Parameters bit-identical, training mode, gradient checkpointing, attention implementation and use_cache as
    the trainer set them; a training step after a round equals one on a copy that never generated."""
    model = tiny_model(0)
    model.config._attn_implementation = "eager"
    checkpointing(model, "enable")()
    model.config.use_cache = True
    model.train()
    model.model.embed_tokens.eval()  # a part the trainer keeps in eval mode: a round must not switch it on
    untouched = copy.deepcopy(model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with ColocatedEngine(model, CONFIG) as engine:
        assert model.training and model.config._attn_implementation == "eager"  # construction gave it back
        engine.generate(groups())
        engine.sleep()
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
        assert model.training and checkpointing(model, "is") and model.config.use_cache
        assert [m.training for m in model.modules()] == [m.training for m in untouched.modules()]
        assert model.config._attn_implementation == "eager"
        loss, grads = training_loss(model)
        expected_loss, expected_grads = training_loss(untouched)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_weights_changed_in_place_are_sampled_at_the_next_round_with_their_version():
    """No push: an in-place change to the trainer's parameters (an optimizer step) is what the next round samples,
    tagged with the version the caller sets; versions never go back."""
    model = tiny_model(0)
    greedy = [PromptGroup(PROMPTS[0], 1, SamplingParams(do_sample=False, max_new_tokens=8, stop_token_ids=()))]
    with ColocatedEngine(model, CONFIG, policy_version=3) as engine:
        first = engine.generate(greedy)[0].completions[0]
        assert first.policy_versions == [[3, 0]]
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)  # a different argmax almost everywhere
        second = engine.generate(greedy, policy_version=4)[0].completions[0]
        assert second.policy_versions == [[4, 0]] and engine.policy_version == 4
        with ColocatedEngine(copy.deepcopy(model), CONFIG) as fresh:  # the changed weights from scratch
            assert fresh.generate(greedy)[0].completions[0].token_ids == second.token_ids
        assert second.token_ids != first.token_ids
        for bad in (2, None, True, 4.0, "5"):  # lower, or not an integer: refused by its name, nothing changes
            with pytest.raises(FieldError, match="policy_version"):
                engine.set_policy_version(bad)
        with pytest.raises(FieldError, match="at least the current 4"):  # the same version is kept: it says so
            engine.set_policy_version(3)
        engine.set_policy_version(4)
        assert engine.policy_version == 4
        engine.set_policy_version(np.int64(6))  # an integer of another kind is an integer
        assert engine.policy_version == 6


def test_sleep_frees_the_cache_and_wake_restores_it_over_many_cycles():
    """sleep() releases the cache tensor (nothing keeps it alive), wake() or the next generate allocates it again;
    20 cycles leak nothing (blocks, sampling slots, block-table rows) and generate the same greedy tokens."""
    greedy = [PromptGroup(PROMPTS[1], 2, SamplingParams(do_sample=False, max_new_tokens=6, stop_token_ids=()))]
    with ColocatedEngine(tiny_model(0), CONFIG) as engine:
        cache_bytes = engine.kv_cache_bytes
        assert cache_bytes > 0 and not engine.is_sleeping
        expected = engine.generate(greedy)[0].completions[0].token_ids
        for cycle in range(20):
            released = weakref.ref(engine.engine.kv_cache.kv)
            engine.sleep()
            gc.collect()
            assert released() is None, "the cache tensor is still referenced after sleep()"
            assert engine.is_sleeping and engine.kv_cache_bytes == 0
            if cycle % 2:
                engine.wake()
                assert engine.kv_cache_bytes == cache_bytes
            result = engine.generate(greedy)[0]  # wakes the cache when asleep
            assert [c.token_ids for c in result.completions] == [expected, expected]
            assert engine.kv_cache_bytes == cache_bytes
        engine.engine.block_manager.check_all_free()
        assert engine.engine.sampler.slots.num_live == 0 and engine.engine.runner.block_tables.num_live == 0


def test_zero3_parameters_are_gathered_once_per_round(zero3):
    """A ZeRO-3-partitioned model is gathered once for a whole round (every parameter at once), never per step,
    and left partitioned; its completions equal the whole model's."""
    reference = tiny_model(0)
    model = tiny_model(0)
    zero3.partition(model)
    sampled = [PromptGroup(PROMPTS[1], 2, SamplingParams(temperature=0.8, seed=1, max_new_tokens=8))]
    with ColocatedEngine(reference, CONFIG) as engine:
        expected = engine.generate(sampled)[0]
    with ColocatedEngine(model, CONFIG) as engine:
        enters = zero3.enters
        for _ in range(2):
            result = engine.generate(sampled)[0]
            assert [c.token_ids for c in result.completions] == [c.token_ids for c in expected.completions]
        assert zero3.enters - enters == 2  # one gather per round, over many decode steps each
        assert all(len(gathered) == len(list(model.parameters())) for gathered in zero3.gathered_sets[-2:])
    assert all(param.numel() == 0 for param in model.parameters())


def test_bad_input_fails_by_name_and_loses_nothing():
    """A model the engine cannot serve and a cache that cannot fit fail at construction; a bad group fails the
    call by name before anything is generated, and the engine goes on serving."""
    with pytest.raises(FieldError, match="model"):
        ColocatedEngine(torch.nn.Linear(4, 4), CONFIG)
    with pytest.raises(FieldError, match="num_blocks"):
        ColocatedEngine(tiny_model(0), ContinuousBatchingConfig(num_blocks=10**9))
    with ColocatedEngine(tiny_model(0), CONFIG) as engine:
        bad = groups() + [PromptGroup([], 1, SamplingParams())]
        with pytest.raises(FieldError, match=r"groups\[3\]\.prompt_ids"):
            engine.generate(bad)
        with pytest.raises(FieldError, match=r"groups\[1\]\.sampling\.temperature"):
            engine.generate([groups()[0], PromptGroup([1, 2], 1, {"temperature": -1.0})])
        with pytest.raises(FieldError, match="appears twice"):
            engine.generate([groups()[0], groups()[0]])
        with pytest.raises(FieldError, match=r"groups\[1\]\.sampling\.max_new_tokens"):  # the worker's names
            engine.generate([groups()[0], PromptGroup([1, 2], 1, {"max_new_tokens": 10**9})])
        with pytest.raises(FieldError, match=r"groups\[0\]\.sampling\.prompt_logprobs"):  # past the most
            engine.generate([PromptGroup([1, 2], 1, {"prompt_logprobs": 21})])
        for sampling in (None, "greedy"):
            with pytest.raises(FieldError, match=r"groups\[0\]\.sampling: expected a SamplingParams"):
                engine.generate([PromptGroup([1, 2], 1, sampling)])
        with pytest.raises(FieldError, match="wrap it in a list"):
            engine.generate(groups()[0])
        assert engine.engine.open_group_ids() == [] and engine.num_rounds == 0
        assert len(engine.generate(groups())) == 3
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(groups())


def test_peft_model_samples_with_its_adapters_and_keeps_its_weights():
    """A LoRA model generates as its merged weights do (peft's own merge_and_unload of a copy), not as its base
    model; its weights, adapters included, are bit-identical after the round."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)  # adapters that change outputs
    merged = copy.deepcopy(model).merge_and_unload()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    greedy = SamplingParams(do_sample=False, max_new_tokens=10, stop_token_ids=())
    asked = [PromptGroup(prompt, 1, greedy) for prompt in PROMPTS]

    def tokens(of: torch.nn.Module) -> list[list[int]]:
        with ColocatedEngine(of, CONFIG) as engine:
            return [result.completions[0].token_ids for result in engine.generate(asked)]

    assert tokens(model) == tokens(merged) != tokens(tiny_model(0))
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    # Merged for the round (faster), then restored bit for bit (peft's unmerge alone is not exact).
    with ColocatedEngine(model, CONFIG, peft_merge=True) as engine:
        for _ in range(2):
            assert [result.completions[0].token_ids for result in engine.generate(asked)] == tokens(merged)
            assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
            assert not any(getattr(module, "merged", False) for module in model.modules())


FSDP2_CHILD = textwrap.dedent(
    """
    import datetime, json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from rollout import ContinuousBatchingConfig, SamplingParams
    from rollout.presets import tiny_model
    from trainer_bridge import ColocatedEngine, PromptGroup

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    greedy = SamplingParams(do_sample=False, max_new_tokens=8, stop_token_ids=())
    groups = [PromptGroup([5, 9, 14, 3 + rank], 2, greedy)]  # each rank its own rows
    config = ContinuousBatchingConfig(num_blocks=64)
    with ColocatedEngine(tiny_model(0), config) as engine:
        whole = [c.token_ids for c in engine.generate(groups)[0].completions]
    model = tiny_model(0)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gathers = [0]
    # What FSDP2 gathers with: all_gather_single in torch 2.13, all_gather_into_tensor before it.
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    all_gather = getattr(dist, gather_name)

    def counted(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    setattr(dist, gather_name, counted)
    with ColocatedEngine(model, config) as engine:
        sharded = [c.token_ids for c in engine.generate(groups)[0].completions]
    round_gathers = gathers[0]
    batch = torch.tensor([[5, 9, 14, 3, 7, 8]])
    loss = model(input_ids=batch, labels=batch).loss  # training goes on, sharded
    loss.backward()
    result = {"same": sharded == whole, "gathers": round_gathers, "loss": float(loss),
              "sharded_after": all(isinstance(p, DTensor) for p in model.parameters())}
    json.dump(result, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
    """
)


@pytest.mark.timeout(180)
def test_fsdp2_is_gathered_once_per_round_on_two_ranks(tmp_path):
    """Two gloo ranks, a model sharded with FSDP2's fully_shard: a round all-gathers each of its 5 FSDP modules
    once (its 8 decode steps gather nothing more: per-step gathering would be 5 x 8), its completions equal the
    whole model's, and the model is left sharded, ready for a training step."""
    script = tmp_path / "child.py"
    script.write_text(FSDP2_CHILD)
    run_ranks(script, [str(tmp_path)])
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["same"] and result["sharded_after"] and result["loss"] > 0, result
        assert result["gathers"] == 5, result
