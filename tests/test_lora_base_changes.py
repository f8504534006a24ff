"""An adapter-only push over a base changed in place: ReLoRA's restart (the adapter merged into the base with
`merge_and_unload()`, then a new adapter over the same model object) or any in-place edit of the base weights. The
base was named by the model object alone, so it did not travel again, and the worker served the new adapter over the
old base: greedy tokens unlike peft's own `generate`, with no error. The references: peft's forward of each model."""

from __future__ import annotations

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model

from rollout.presets import tiny_model
from service_helpers import Worker, free_port
from trainer_bridge import PromptGroup, RolloutClient, RolloutError, push_weights

pytestmark = pytest.mark.timeout(120)

PROMPT = [(37 * i + 5) % 101 for i in range(37)]
NEW_TOKENS = 12
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": NEW_TOKENS}
LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)


def random_lora(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    return model.eval()


@torch.no_grad()
def peft_greedy(model) -> list[int]:
    output = model.generate(
        input_ids=torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    return output[0, len(PROMPT) :].tolist()


def test_a_base_changed_in_place_travels_again():
    worker = Worker("--max-loras", "2", "--max-lora-rank", "8")
    try:
        with RolloutClient(worker.address, timeout=60) as client:

            def served() -> list[int]:
                return list(client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0].token_ids)

            model = random_lora(get_peft_model(tiny_model(0), LoraConfig(**LORA)), 1)
            assert push_weights(client, model).base_included
            assert served() == peft_greedy(model)
            random_lora(model, 3)  # a training step: only the adapter changed
            assert push_weights(client, model).base_included is False
            assert served() == peft_greedy(model)

            restarted = random_lora(get_peft_model(model.merge_and_unload(), LoraConfig(**LORA)), 2)  # ReLoRA
            assert push_weights(client, restarted).base_included  # was False: the old base served on
            assert served() == peft_greedy(restarted)

            with torch.no_grad():
                restarted.get_base_model().model.embed_tokens.weight.mul_(1.5)
            assert push_weights(client, restarted).base_included
            assert served() == peft_greedy(restarted)

            embeddings = restarted.get_base_model().model.embed_tokens.weight
            with torch.no_grad():  # rows of one value each, multiples of 1/8: sums exact in any order
                embeddings.copy_(((torch.arange(embeddings.shape[0]) % 7 - 3) * 0.125)[:, None].expand_as(embeddings))
            assert push_weights(client, restarted).base_included
            with torch.no_grad():  # two rows swapped: the tensor's sum is the same bits (it was all that was named)
                embeddings[[PROMPT[0], PROMPT[1]]] = embeddings[[PROMPT[1], PROMPT[0]]].clone()
            assert push_weights(client, restarted).base_included
            assert served() == peft_greedy(restarted)
    finally:
        worker.close()


def test_two_trainers_of_one_checkpoint_send_the_base_once_each_and_disturb_no_adapter():
    """Two trainers start from one checkpoint (two model objects, equal weights): the second one's base is found
    equal to the one served, so it is not copied, adapter "a" is not disturbed and no warning says it was; from then
    on neither trainer's pushes bring the base. A base that differs does change the weights, and the adapter pushed
    for the weights before is no longer served (it computed over the new base, with a warning only): a request
    naming it is refused, saying why, until its trainer pushes it again, with its base."""
    port = free_port()
    worker = Worker("--max-loras", "2", "--max-lora-rank", "8", "--http", f"127.0.0.1:{port}")
    try:
        with RolloutClient(worker.address, timeout=60) as first, RolloutClient(worker.address, timeout=60) as second:

            def served(client, adapter: str) -> list[int]:
                group = PromptGroup(PROMPT, sampling=GREEDY, adapter=adapter)
                return list(client.generate(group).completions[0].token_ids)

            a = random_lora(get_peft_model(tiny_model(0), LoraConfig(**LORA)), 1)
            b = random_lora(get_peft_model(tiny_model(0), LoraConfig(**LORA)), 2)
            assert push_weights(first, a, adapter_name="a").base_included
            assert push_weights(second, b, adapter_name="b").base_included  # its worker's base has another name
            assert served(first, "a") == peft_greedy(a) and served(second, "b") == peft_greedy(b)
            for model, client, name, seed in ((a, first, "a", 3), (b, second, "b", 4), (a, first, "a", 5)):
                random_lora(model, seed)  # a training step each
                assert push_weights(client, model, adapter_name=name).base_included is False
                assert served(client, name) == peft_greedy(model)
            assert "came with other base weights" not in worker.output()

            other = random_lora(get_peft_model(tiny_model(5), LoraConfig(**LORA)), 6)  # another checkpoint
            assert push_weights(second, other, adapter_name="b").base_included
            assert served(second, "b") == peft_greedy(other)
            assert "adapter 'b' came with other base weights: the adapters ['a']" in worker.output()
            with pytest.raises(RolloutError) as refused:
                served(first, "a")
            assert refused.value.field == "adapter" and "adapter 'a' is no longer served: adapter 'b' came" in str(
                refused.value
            )
            body = {"model": "a", "prompt": PROMPT, "max_tokens": 2}  # over HTTP: not found, and why
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 404 and "adapter 'a' is no longer served" in answer.json()["error"]["message"]
            assert push_weights(first, a, adapter_name="a").base_included  # its base must travel again
            assert served(first, "a") == peft_greedy(a)
            with pytest.raises(RolloutError, match="adapter 'b' is no longer served: adapter 'a' came"):
                served(second, "b")
    finally:
        worker.close()
