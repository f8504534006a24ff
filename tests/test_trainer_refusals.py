"""Trainer-side (`trainer_bridge`) answers that used to be silent or misleading, against real rollout-workers:

- `ColocatedEngine.generate` refuses what a worker refuses (an adapter it does not serve, a bad sampling field) under
  the worker's field names, instead of sampling without them;
- `push_weights(adapters="auto")` of a PEFT model whose LoRA rank is above the workers' `--max-lora-rank` pushes
  merged weights (one warning), as for the other adapters workers cannot serve unmerged; "adapter" still refuses it;
- a call that times out while every live worker is stale names the workers and their versions;
- `AsyncRollouts` says, in a logged warning, how many trailing prompts that do not fill a step it drops;
- `push_weights` refuses, naming the tensor, finite values a float16 worker's cast would turn to Inf;
- `push_weights` takes numpy / torch integer versions (and a client group numpy `n`), refusing bools by name;
- the client refuses an empty `group_id` by name instead of replacing it.

Two rollout-worker subprocesses (tiny CPU model: one fp32, one float16) serve the module.
"""

from __future__ import annotations

import asyncio
import logging
import warnings

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from rollout import ContinuousBatchingConfig, FieldError
from rollout.presets import tiny_model
from service_helpers import Worker
from trainer_bridge import AsyncRollouts, ColocatedEngine, PromptGroup, RolloutClient, RolloutError, push_weights

pytestmark = pytest.mark.timeout(120)
TENSOR = "model.layers.1.mlp.up_proj.weight"
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 8}


@pytest.fixture(scope="module")
def worker():
    server = Worker()  # --max-lora-rank 16 (the default)
    yield server
    server.close()


@pytest.fixture(scope="module")
def half_worker():
    server = Worker("--dtype", "float16")
    yield server
    server.close()


@pytest.fixture
def client(worker):
    with RolloutClient(worker.address, timeout=60) as connection:
        yield connection


def served_version(client: RolloutClient) -> int:
    return max(stats["policy_version"] for stats in client.stats())


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"adapter": "nope"}, "adapter"),
        ({"sampling": {"top_logprobs": 101, "max_new_tokens": 4}}, "sampling.top_logprobs"),
    ],
    ids=["adapter", "top_logprobs"],
)
def test_colocated_refuses_what_a_worker_refuses_by_the_same_field(client, settings, field):
    """Colocated, the adapter was dropped (samples of the base), where a worker refuses it; both refuse more than 100
    top log-probs under the same name."""
    group = PromptGroup([1, 2, 3], **{"sampling": {"max_new_tokens": 4}, **settings})
    with pytest.raises(RolloutError) as remote:
        client.generate(group, timeout=30)
    assert remote.value.code == "bad_request" and remote.value.field == field
    with ColocatedEngine(tiny_model(0), ContinuousBatchingConfig(num_blocks=32, block_size=16)) as engine:
        with pytest.raises(FieldError) as local:
            engine.generate([group])
        assert local.value.field == f"groups[0].{field}"
        assert engine.num_rounds == 0
        if field == "adapter":  # the worker's words
            assert "no adapter named 'nope'" in str(remote.value) and "no adapter named 'nope'" in str(local.value)
        # "__base__" is the model itself for a plain model, as for a worker's base
        base = engine.generate([PromptGroup([1, 2, 3], adapter="__base__", sampling=GREEDY)])
        assert len(base[0].completions[0].token_ids) == GREEDY["max_new_tokens"]


def lora_model(rank: int) -> torch.nn.Module:
    """A PeftModel over the worker's start model (tiny, seed 0) with a random, non-zero adapter of `rank`."""
    torch.manual_seed(rank)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_model(0), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.05)
    return model.eval()


def test_auto_pushes_a_rank_above_max_lora_rank_merged(client):
    """r=32 against --max-lora-rank 16 raised bad_update, though "auto" pushes merged what workers cannot serve."""
    model = lora_model(32)
    with pytest.raises(RolloutError, match="max_lora_rank") as refused:  # insisting on adapter-only still refuses
        push_weights(client, model, adapters="adapter")
    assert refused.value.code == "bad_update" and refused.value.field.endswith(".lora_A")
    with pytest.warns(UserWarning, match="max_lora_rank=16.*pushing merged weights"):
        result = push_weights(client, model)
    assert result.version == served_version(client) and client.adapter is None
    prompt = [5, 17, 29, 41]
    completion = client.generate(PromptGroup(prompt, sampling=GREEDY)).completions[0]
    with torch.no_grad():  # the merged policy samples what the PEFT model samples
        expected = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert completion.adapter is None and completion.token_ids == expected[0, len(prompt) :].tolist()
    with warnings.catch_warnings():  # merged from then on, without asking the workers or warning again
        warnings.simplefilter("error")
        assert push_weights(client, model).version == result.version + 1


def test_a_timeout_while_every_worker_is_stale_names_them(client, worker):
    """With the worker behind the client's newest version, the timeout said only "no answer in time": the stale
    workers were named only after connect_timeout (20 s), past a shorter call timeout."""
    version = served_version(client)
    client.min_policy_version = version + 5  # as if a push had reached it before the worker restarted
    group = PromptGroup([1, 2, 3], sampling=GREEDY)
    calls = {
        "generate": lambda: client.generate(group, timeout=1),
        "agenerate": lambda: asyncio.run(client.agenerate(group, timeout=1)),
    }
    for name, call in calls.items():
        with pytest.raises(RolloutError) as timed_out:
            call()
        message = str(timed_out.value)
        assert timed_out.value.code == "timeout", name
        assert f"older than version {version + 5}" in message and f"{worker.address} (version {version})" in message


@pytest.mark.parametrize("partial", [False, True], ids=["in_order", "partial_rollouts"])
def test_async_rollouts_warns_about_trailing_prompts_it_drops(client, caplog, partial):
    """5 prompts in steps of 3 gave one batch; the other 2 groups were generated, then cancelled without a word."""
    prompts = [PromptGroup([7, i, 9], sampling={**GREEDY, "max_new_tokens": 4}) for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="trainer_bridge.async_rollouts"):
        with AsyncRollouts(client, prompts, groups_per_step=3, max_staleness=1, partial_rollouts=partial) as rollouts:
            batches = list(rollouts)
    assert [len(batch.groups) for batch in batches] == [3]
    dropped = [r.getMessage() for r in caplog.records if r.name == "trainer_bridge.async_rollouts"]
    assert len(dropped) == 1 and "last 2 prompt group(s)" in dropped[0] and "groups_per_step=3" in dropped[0]


def test_push_refuses_values_the_workers_float16_turns_to_inf(half_worker):
    """1e6 in an fp32 tensor was cast to inf for a float16 worker, silently; its samples then ended in errors."""
    weight = tiny_model(0).state_dict()[TENSOR].clone()
    with RolloutClient(half_worker.address, timeout=60) as connection:
        version = served_version(connection)
        weight[3, 5] = 1e6
        with pytest.raises(RolloutError, match="float16") as refused:
            push_weights(connection, {TENSOR: weight}, partial=True)
        assert refused.value.code == "bad_update" and refused.value.field == TENSOR
        assert served_version(connection) == version  # nothing committed
        completion = connection.generate(PromptGroup([1, 2, 3], sampling=GREEDY)).completions[0]
        assert completion.finish_reason == "length"
        weight[3, 5] = 1e4  # within float16: pushed
        assert push_weights(connection, {TENSOR: weight}, partial=True).version == version + 1


def test_push_takes_numpy_and_torch_integer_versions_and_refuses_bools(client):
    """np.int64(5) was refused ("got np.int64(5)") while ColocatedEngine and PromptGroup take numpy integers."""
    weight = tiny_model(0).state_dict()[TENSOR]
    version = served_version(client)
    for given in (np.int64(version + 1), torch.tensor(version + 2)):
        result = push_weights(client, {TENSOR: weight}, version=given, partial=True)
        assert result.version == int(given) and type(result.version) is int
    for bad in (True, np.float64(version + 3), torch.tensor(True)):
        with pytest.raises(FieldError) as refused:
            push_weights(client, {TENSOR: weight}, version=bad, partial=True)
        assert refused.value.field == "version"
    result = client.generate(PromptGroup([1, 2, 3], n=np.int64(2), sampling=GREEDY))  # n too, as colocated
    assert len(result.completions) == 2


def test_an_empty_group_id_is_refused_not_replaced(client):
    """ "" was replaced by a generated id; only None asks for one."""
    with pytest.raises(RolloutError) as refused:
        client.generate(PromptGroup([1, 2, 3], group_id="", sampling=GREEDY), timeout=30)
    assert refused.value.code == "bad_request" and refused.value.field == "group_id"
