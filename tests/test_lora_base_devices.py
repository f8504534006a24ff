"""An adapter push of a PEFT model placed on several devices (a device_map: some layers on a GPU, the rest on the CPU
or on another GPU): the base's fingerprint stacked every tensor's sum into one tensor, which torch refuses across
devices, so every adapter push of such a model failed ("Expected all tensors to be on the same device") where the
push itself handles each tensor on its own device. Needs a CUDA device (the CPU is the second device)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rollout.presets import tiny_model
from trainer_bridge.weights.lora_push import base_id_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device beside the CPU")


def test_a_base_on_two_devices_is_named_and_its_changes_seen():
    base = tiny_model(0)
    base.model.layers[0].to("cuda")  # the rest stays on the CPU, as a device_map with cpu entries places it
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    first = base_id_of(model)
    assert base_id_of(model) == first  # nothing changed: the base does not travel again
    with torch.no_grad():
        model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight.mul_(1.5)  # a weight on the GPU
    assert base_id_of(model) != first
