"""`--model` pointed at the wrong thing on disk, the way a newcomer does: the weights file, the config file, or a
folder without a model. A file was taken for a hub id: a minute of retries against huggingface.co on a machine
without network, then "the config file at '.../model.safetensors' is not a valid JSON file", or for config.json an
UnpicklingError traceback (torch.load of a JSON file). An empty folder said "Should have a `model_type` key in its
config.json", of a config.json that is not there."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from rollout.service.launch.loading import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tinyqwen")
    tiny_model("qwen3").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("file", ["model.safetensors", "config.json"])
def test_a_file_of_a_model_directory_is_refused_naming_its_directory(saved, file, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # without the fix: no minute of retries, the same wrong error
    with pytest.raises(ValueError, match=rf"a file, not a model directory: pass .*{saved.name}"):
        load_model(str(saved / file), None, CPU)


def test_a_folder_without_a_config_is_refused_saying_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path), None, CPU)


def test_the_model_directory_itself_loads(saved):
    model = load_model(str(saved), None, CPU)
    assert model.config.model_type == json.loads((saved / "config.json").read_text())["model_type"]
