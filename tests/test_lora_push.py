"""Adapter-only pushes to a real rollout-worker subprocess: `push_weights(client, peft_model)` sends the frozen base
once (in the adapter's transaction) and then only the LoRA tensors; the worker serves the adapter unmerged, and its
completions equal peft's own generate of the same `PeftModel`, tagged with the adapter's name and version. A base
that changed under the worker makes the next push carry it again, an adapter for another base is refused, and bad
adapters are refused whole, naming the culprit."""

from __future__ import annotations

import copy
import uuid

import openai
import pytest
import torch
from lora_models import lora_model, peft_greedy
from peft import LoraConfig, get_peft_model

from rollout import protocol as p
from rollout.presets import tiny_model, tiny_tokenizer
from service_helpers import Client, Worker, free_port
from trainer_bridge import PromptGroup, RolloutClient, RolloutError, push_weights

pytestmark = pytest.mark.timeout(180)

PROMPT = [(37 * i + 5) % 101 for i in range(37)]
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 12}


@pytest.fixture(scope="module")
def worker():
    port = free_port()
    server = Worker("--max-loras", "2", "--max-lora-rank", "8", "--http", f"127.0.0.1:{port}")
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(worker):
    with RolloutClient(worker.address, timeout=60) as connection:
        yield connection


def test_base_once_then_adapter_only_and_tokens_match_peft(client):
    model = lora_model(1)
    adapter_bytes = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "lora_" in n)
    first = push_weights(client, model)
    assert first.base_included and first.num_bytes > 10 * adapter_bytes
    model_again = model  # a training step later: the same base, new adapter weights
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    second = push_weights(client, model_again)
    assert not second.base_included and second.num_bytes == adapter_bytes
    assert client.adapter == "default"
    result = client.generate(PromptGroup(PROMPT, n=2, sampling=GREEDY))
    for completion in result.completions:
        assert completion.token_ids == peft_greedy(model_again, PROMPT)
        assert (completion.adapter, completion.adapter_version) == ("default", second.version)
    base = client.generate(PromptGroup(PROMPT, sampling=GREEDY, adapter="__base__")).completions[0]
    with model_again.disable_adapter():
        assert base.token_ids == peft_greedy(model_again, PROMPT)
    assert base.adapter is None
    with pytest.raises(RolloutError) as error:
        client.generate(PromptGroup(PROMPT, sampling=GREEDY, adapter="missing"))
    assert error.value.field == "adapter"


def test_a_changed_base_is_sent_again_and_stale_adapters_are_refused(client, worker):
    """A whole push of other weights (as a restarted worker's start weights) unnames the worker's base: an adapter
    update for the trainer's base is refused, and the next push_weights carries the base again."""
    model = lora_model(3)
    push_weights(client, model)
    assert client.adapter == "default"
    other = tiny_model(5)
    push_weights(client, other, adapters="merged")  # a plain model: new, unnamed base weights
    # The client samples the weights pushed, not the adapter on top of them (it kept "default" after a plain push)
    assert client.adapter is None
    sampled = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0]
    reference = copy.deepcopy(other)
    reference.generation_config.eos_token_id = None
    assert sampled.token_ids == peft_greedy(reference, PROMPT) and sampled.adapter is None
    raw = Client(worker.address)
    try:
        specs = [p.TensorSpec("model.layers.0.self_attn.q_proj.lora_A", "float32", [8, 64])]
        specs.append(p.TensorSpec("model.layers.0.self_attn.q_proj.lora_B", "float32", [64, 8]))
        begin = p.WeightsBegin(uuid.uuid4().hex, specs, adapter="default", base_id="another-base")
        begin.scalings = {"model.layers.0.self_attn.q_proj": 2.0}
        reply = raw.ask(begin)
        assert isinstance(reply, p.Error) and (reply.code, reply.field) == ("base_mismatch", "base_id")
    finally:
        raw.close()
    again = push_weights(client, model)
    assert again.base_included
    completion = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0]
    assert completion.token_ids == peft_greedy(model, PROMPT)


def test_bad_adapters_are_refused_whole(client):
    good = lora_model(4)
    push_weights(client, good)

    def answers() -> list[tuple[list[int], list[float]]]:  # the base's and the good adapter's, tokens and logprobs
        groups = [PromptGroup(PROMPT, sampling=GREEDY, adapter=name) for name in ("__base__", "default")]
        return [(c.token_ids, c.logprobs) for c in (client.generate(g).completions[0] for g in groups)]

    before = answers()
    with pytest.raises(RolloutError) as error:  # adapter-only insisted on ("auto" would push it merged)
        push_weights(client, lora_model(5, r=16), adapters="adapter")
    assert "max_lora_rank" in str(error.value)
    dora = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="DoRA"):  # adapter-only insisted on ("auto" would push it merged)
        push_weights(client, dora, adapters="adapter")
    push_weights(client, lora_model(6), adapter_name="second")
    with pytest.raises(RolloutError) as error:
        push_weights(client, lora_model(7), adapter_name="third")
    assert error.value.field == "max_loras"
    with pytest.raises(RolloutError) as error:  # lora_alpha 1e38: a scaling that overflows, refused by name
        push_weights(client, lora_model(8, lora_alpha=1e38))
    assert error.value.field.startswith("scalings.model.layers.") and "overflow" in str(error.value)
    poisoned = lora_model(10)
    with torch.no_grad():  # finite, but overflowing once multiplied (lora_B = 1e30)
        next(parameter for name, parameter in poisoned.named_parameters() if "lora_B" in name)[0, 0] = 1e30
    with pytest.raises(RolloutError) as error:
        push_weights(client, poisoned, adapter_name="second")
    assert error.value.field.endswith(".lora_B") and "overflow" in str(error.value)
    with pytest.raises(RolloutError) as error:  # the served model's name (--model tiny) means the base
        push_weights(client, lora_model(9), adapter_name="tiny")
    assert error.value.field == "adapter" and "served model's name" in str(error.value)
    assert answers() == before  # the base and the good adapter: the same tokens and logprobs as before the attacks


def test_modules_to_save_travel_with_the_adapter(client):
    """An adapter that trains the input embeddings whole (modules_to_save): the push carries the trained copy (not
    the frozen original, which is the base's), and the worker's tokens equal peft's generate."""
    model = lora_model(9, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens"])
    with torch.no_grad():
        model.base_model.model.model.embed_tokens.modules_to_save["default"].weight.add_(0.3)
    push_weights(client, model)
    result = push_weights(client, model)
    lora = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "lora_" in n)
    embeddings = model.base_model.model.model.embed_tokens.original_module.weight
    assert result.num_bytes == lora + embeddings.numel() * embeddings.element_size()
    completion = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0]
    assert completion.token_ids == peft_greedy(model, PROMPT)
    with model.disable_adapter():
        assert completion.token_ids != peft_greedy(model, PROMPT)


def test_openai_model_names_a_served_adapter(client, worker):
    """/v1/models lists the adapters under the worker's model (vLLM's shape); `model="NAME"` samples with one (the
    official openai client), echoing its name; an unknown model is a 404 naming `model`."""
    model = lora_model(8)
    push_weights(client, model, adapter_name="default")
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60) as api:
        listed = {entry.id: entry.model_extra for entry in api.models.list()}
        assert listed["default"]["parent"] == "tiny" and listed["tiny"]["parent"] is None
        settings = dict(
            prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True}
        )
        answer = api.completions.create(model="default", **settings)
        assert answer.model == "default"
        assert answer.choices[0].model_extra["token_ids"] == peft_greedy(model, PROMPT)
        base = api.completions.create(model="tiny", **settings).choices[0].model_extra["token_ids"]
        with model.disable_adapter():
            assert base == peft_greedy(model, PROMPT)
        with pytest.raises(openai.NotFoundError) as error:
            api.completions.create(model="nope", **settings)
        assert error.value.body["param"] == "model"


def test_trl_grpo_with_peft_pushes_adapters_only(tmp_path, client):
    """RolloutGRPOTrainer with `peft_config`: the base reaches the worker once, then each sync sends only the
    adapter; the worker samples with it (TRL's own importance ratio stays 1 within fp32 noise under top_p=0.9,
    top_k=20, step 2 included, after the adapter moved)."""
    from trainer_bridge.trl import RolloutGRPOTrainer
    from trl_helpers import dataset, grpo_config, id_reward

    (before,) = client.stats()
    config = grpo_config(tmp_path, temperature=0.7, top_p=0.9, top_k=20, max_steps=2)
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=config,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        rollout_workers=client,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert abs(entry["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, entry
    (after,) = client.stats()
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "lora_" in n)
    base = sum(t.numel() * t.element_size() for t in tiny_model(0).parameters())
    pushed = after["weight_update_bytes"] - before["weight_update_bytes"]
    assert pushed == base + 2 * adapter  # two syncs: the base once, the adapter each time
    assert after["adapters"]["default"]["version"] == after["policy_version"]


RANKS = """
import json, sys
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from rollout.presets import tiny_model
from trainer_bridge import PromptGroup, RolloutClient, push_weights
from trainer_bridge.weights.lora_push import served_adapter_name

address, out, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)  # the same adapter on both ranks (DDP keeps them equal)
config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
model = accelerator.prepare(get_peft_model(tiny_model(0), config))
greedy = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 12}
steps = []
with RolloutClient(address, timeout=60) as client:
    for step in range(2):
        result = push_weights(client if accelerator.is_main_process else None, model, accelerator=accelerator)
        accelerator.wait_for_everyone()  # the workers serve the push before any rank samples
        client.adapter = served_adapter_name(model, accelerator)
        completion = client.generate(PromptGroup(prompt, sampling=greedy)).completions[0]
        with torch.no_grad():
            reference = accelerator.unwrap_model(model).generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )[0, len(prompt):].tolist()
        steps.append({
            "base_included": None if result is None else result.base_included,
            "bytes": None if result is None else result.num_bytes,
            "tokens": completion.token_ids, "adapter": completion.adapter, "reference": reference,
        })
        with torch.no_grad():  # a training step: the adapter moves on every rank alike
            for name, parameter in accelerator.unwrap_model(model).named_parameters():
                if "lora_B" in name:
                    parameter.add_(0.05)
json.dump(steps, open(f"{out}/rank{accelerator.process_index}.json", "w"))
"""


@pytest.mark.timeout(240)
def test_two_ranks_push_adapters_only_and_both_sample_with_them(tmp_path, worker):
    """accelerate on 2 CPU ranks (gloo): only the main process sends, the base once (its decision reaches the other
    rank, which gathers the same tensors), then the adapter alone; both ranks sample with the adapter and match
    peft's generate."""
    import json

    from service_helpers import run_ranks

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    run_ranks(script, [worker.address, str(tmp_path), json.dumps(PROMPT)])
    main, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert [step["base_included"] for step in main] == [True, False]
    assert main[1]["bytes"] < main[0]["bytes"] / 10
    assert [step["base_included"] for step in other] == [None, None]  # it sent nothing
    for rank in (main, other):
        for step in rank:
            assert step["adapter"] == "default" and step["tokens"] == step["reference"]
    assert main[0]["tokens"] != main[1]["tokens"]  # the second push served the moved adapter


def test_what_an_adapter_push_would_not_carry_is_pushed_merged_or_refused():
    """A base parameter unfrozen beside the adapter (an adapter push sends the base once: the workers kept its first
    values) goes merged under "auto" and is refused under "adapter"; a LoRA-trained module whose weight is tied to
    another (LoRA on a tied embed_tokens: the trainer changes its input embedding, a worker's tied model would change
    its head too) is refused in every mode, and by the colocated engine's in-place merge. A modules_to_save copy of a
    tied module (peft trains it apart from the frozen tied weight) is refused only merged: adapter-only it is served
    as peft computes it (`test_lora_saved_push.py`; it was refused in every mode, in server mode every TRL run of a
    tied model with modules_to_save=["lm_head"])."""
    import warnings

    from transformers import AutoModelForCausalLM, Qwen3Config

    from rollout.config import FieldError
    from trainer_bridge.colocated_model import peft_merged
    from trainer_bridge.weights.adapter_mode import _RANK_REFUSED, push_mode

    unfrozen = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj"]))
    assert push_mode(unfrozen, "adapter") == "adapter"
    unfrozen.base_model.model.lm_head.weight.requires_grad_(True)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert push_mode(unfrozen, "auto") == "merged"
    assert any("lm_head.weight" in str(warning.message) for warning in warned)
    with pytest.raises(FieldError, match="lm_head.weight: is a base parameter trained beside the adapter"):
        push_mode(unfrozen, "adapter")
    config = Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    tied_safe = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["q_proj"]))
    assert push_mode(tied_safe, "auto") == "adapter"
    lora = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"])
    tied = get_peft_model(AutoModelForCausalLM.from_config(config), lora)
    for mode in ("auto", "adapter", "merged"):  # named as the user names them, not by peft's wrappers' parameters
        with pytest.raises(FieldError, match="model: model.embed_tokens is trained \\(LoRA\\) but .* tied to lm_head:"):
            push_mode(tied, mode)
    with pytest.raises(ValueError, match="peft_merge: .* tied"):
        with peft_merged(tied):
            pass
    saved = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    tied = get_peft_model(AutoModelForCausalLM.from_config(config), saved)
    assert push_mode(tied, "auto") == push_mode(tied, "adapter") == "adapter"
    with pytest.raises(FieldError, match="model: lm_head is trained \\(modules_to_save\\) but .* tied to model"):
        push_mode(tied, "merged")
    with peft_merged(tied):  # nothing of the copy is merged in place
        pass
    _RANK_REFUSED.add(tied)  # the workers refused its rank: "auto" would push it merged, which says why it cannot
    with pytest.raises(FieldError, match="tied to model.* The workers refused the adapter for its rank: raise their"):
        push_mode(tied, "auto")
    # trainable tokens (peft ties their rows itself): pushed merged, not refused as a tied trained module
    tokens = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[5, 6])
    tied = get_peft_model(AutoModelForCausalLM.from_config(config), tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert push_mode(tied, "auto") == push_mode(tied, "merged") == "merged"
    with pytest.raises(FieldError, match="trainable_token_indices: trainable tokens is not served unmerged"):
        push_mode(tied, "adapter")


def test_an_adapter_whose_init_rewrote_the_base_travels_with_that_base(client):
    """PiSSA rewrites the base weights as peft builds the model (W - s B0 A0): the worker's base (the checkpoint's)
    is not the adapter's, so the push sends the rewritten one, and the worker's tokens are peft's own."""
    model = lora_model(3, init_lora_weights="pissa")
    pushed = push_weights(client, model)
    assert pushed.base_included
    completion = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0]
    assert completion.token_ids == peft_greedy(model, PROMPT)
    assert (completion.adapter, completion.adapter_version) == ("default", pushed.version)


def test_a_restarted_worker_gets_the_base_once_again_and_no_adapter_group_before(client, worker):
    """The worker restarts mid-run (the module's last test: it replaces the module's worker). A group for the
    adapter, sent meanwhile, waits: the new process serves its start weights, not the trainer's base. The next push
    carries the base again (the new process names none); the group then runs over the right base and adapter, equal
    to peft's generate; the push after it is adapter-only again."""
    import threading
    import time

    model = lora_model(8)
    version = push_weights(client, model, version=client.stats()[0]["policy_version"] + 1).version
    worker.close()

    def wait_live(expected: list[int], what: str) -> None:
        deadline = time.monotonic() + 20
        while client.live_workers() != expected:
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    wait_live([], "the client never saw the worker go")
    restarted = Worker("--max-loras", "2", "--max-lora-rank", "8", address=worker.address)
    try:
        wait_live([0], "the restarted worker never answered the client")
        results = []
        waiting = threading.Thread(target=lambda: results.append(client.generate(PromptGroup(PROMPT, sampling=GREEDY))))
        waiting.start()
        time.sleep(0.5)
        assert not results and restarted.stats()["generated_tokens"] == 0  # parked: no adapter over the start base
        with torch.no_grad():  # a training step
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.add_(0.05)
        again = push_weights(client, model, version=version + 1)  # as trainers do (TRL): the versions go on
        assert again.base_included
        waiting.join(60)
        (completion,) = results[0].completions
        assert completion.token_ids == peft_greedy(model, PROMPT)
        assert (completion.adapter, completion.adapter_version) == ("default", again.version)
        assert not push_weights(client, model, version=version + 2).base_included
    finally:
        restarted.close()


def test_batch_invariant_with_an_adapter_that_goes_merged_says_why():
    """batch_invariant=True with a DoRA adapter: the refusal names DoRA (it blamed rollout_push_kwargs, unset)."""
    from trainer_bridge.trl.settings import check_invariant_push

    dora = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="batch_invariant=True: .*DoRA is not served unmerged"):
        check_invariant_push(dora, None, None)
