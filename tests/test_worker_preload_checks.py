"""`rollout-worker` refuses flags that the model's config, an adapter's adapter_config.json or a `--tokenizer`
directory refute before it loads the model (minutes for a large one): a `--max-prompt-len` above the model's context,
a `--tokenizer` directory holding no tokenizer, a `--lora` adapter whose rank is above `--max-lora-rank`. Each was
found only after loading. The model directories here hold a config.json and no weights: loading them fails with an
error naming --model, so seeing the flag's own error proves it came first."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import GPT2Config, Qwen3Config, Qwen3ForCausalLM

from rollout.presets.catalog import TINY_MODEL_CONFIG
from rollout.service.launch import cli

SMALL = {**TINY_MODEL_CONFIG, "num_hidden_layers": 1, "pad_token_id": 0}


def worker_error(capsys, *argv: str) -> str:
    """rollout-worker's one usage error line (prefix dropped), checked: exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--device", "cpu", "--bind", "tcp://127.0.0.1:*"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("rollout-worker: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("rollout-worker: error: ")


@pytest.fixture
def no_weights(tmp_path) -> Path:
    """A model directory of a 64-token context holding its config.json alone: loading it fails naming --model."""
    folder = tmp_path / "model"
    Qwen3Config(**{**SMALL, "max_position_embeddings": 64}).save_pretrained(folder)
    return folder


def test_the_model_directory_alone_fails_loading_naming_model(capsys, no_weights):
    """The reference for the tests below: without a refuted flag, the error is loading's, naming --model."""
    assert worker_error(capsys, "--model", str(no_weights), "--max-prompt-len", "64").startswith(
        f"--model {no_weights}: "
    )


def test_a_max_prompt_len_above_the_context_is_refused_before_the_model_loads(capsys, no_weights):
    message = worker_error(capsys, "--model", str(no_weights), "--max-prompt-len", "65")
    assert message == "--max-prompt-len 65: above the model's context of 64 tokens"


def test_a_tokenizer_directory_without_a_tokenizer_is_refused_before_the_model_loads(capsys, tmp_path, no_weights):
    """GPT-2's config alone: transformers builds an empty tokenizer from it (refused by name, as after loading)."""
    from rollout.service.launch.loading import load_tokenizer

    empty = tmp_path / "tokenizer"
    GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(empty)
    with pytest.raises(ValueError) as reference:
        load_tokenizer(str(no_weights), str(empty))
    message = worker_error(capsys, "--model", str(no_weights), "--tokenizer", str(empty))
    assert message == f"--tokenizer {empty}: {str(reference.value).splitlines()[0]}"
    assert "it holds no tokenizer files" in message


@pytest.mark.parametrize("pattern", [False, True])
def test_a_lora_adapter_above_the_rank_limit_is_refused_before_the_model_loads(capsys, tmp_path, no_weights, pattern):
    """The adapter's rank from its weights (the file's header): `r`, or a higher one its `rank_pattern` gives a
    module."""
    from peft import LoraConfig, get_peft_model

    rank = dict(r=4, rank_pattern={"q_proj": 32}) if pattern else dict(r=32)
    adapter = tmp_path / "adapter"
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL))
    get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], **rank)).save_pretrained(adapter)
    message = worker_error(capsys, "--model", str(no_weights), "--lora", f"a={adapter}")
    assert message == f"--lora a={adapter}: rank 32 is outside [1, max_lora_rank=16]; raise --max-lora-rank to 32"
    within = worker_error(capsys, "--model", str(no_weights), "--lora", f"a={adapter}", "--max-lora-rank", "32")
    assert within.startswith(f"--model {no_weights}: ")  # within the limit: on to loading


@pytest.mark.parametrize(
    "pattern", [{"q_proj": 8, "v_proj": 8}, {"o_proj": 64}], ids=["every-target-lower", "untargeted"]
)
def test_a_rank_pattern_that_leaves_every_tensor_within_the_limit_is_not_refused(capsys, tmp_path, no_weights, pattern):
    """`r` 32 with every targeted module patterned to 8, or `r` 8 with a pattern for a module it does not target: the
    adapter's tensors are within the limit, so the worker goes on to load the model (it serves such adapters)."""
    from peft import LoraConfig, get_peft_model

    adapter = tmp_path / "adapter"
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL))
    settings = LoraConfig(target_modules=["q_proj", "v_proj"], r=32 if "q_proj" in pattern else 8, rank_pattern=pattern)
    get_peft_model(model, settings).save_pretrained(adapter)
    assert worker_error(capsys, "--model", str(no_weights), "--lora", f"a={adapter}").startswith(
        f"--model {no_weights}: "
    )


def test_a_tokenizer_hub_id_this_machine_cannot_get_is_named_once(capsys, no_weights, monkeypatch):
    """Offline, a --tokenizer hub id the cache does not hold: the message names the flag once (it read
    "--tokenizer X: --tokenizer X: not a local path...")."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = worker_error(capsys, "--model", str(no_weights), "--tokenizer", "nobody/no-such-tokenizer")
    assert message.startswith("--tokenizer nobody/no-such-tokenizer: not a local path, offline mode is on")


def test_max_model_len_is_vllms_flag_and_is_checked_against_the_context(capsys, no_weights):
    """`--max-model-len` (vLLM's flag; the worker had none, and the typo hint sent a vLLM user to --max-prompt-len, an
    operator's limit on prompts alone) sets the engine's max_model_len; above the model's context it is refused
    before loading, as vLLM refuses it, and a --max-prompt-len above it is refused naming it."""
    from rollout.service.launch.flags import engine_config

    assert engine_config(cli.build_parser().parse_args(["--max-model-len", "48"])).max_model_len == 48
    assert engine_config(cli.build_parser().parse_args([])).max_model_len is None
    message = worker_error(capsys, "--model", str(no_weights), "--max-model-len", "65")
    assert message == "--max-model-len 65: above the model's context of 64 tokens"
    message = worker_error(capsys, "--model", str(no_weights), "--max-model-len", "32", "--max-prompt-len", "33")
    assert message == "--max-prompt-len 33: above --max-model-len 32"
    within = worker_error(capsys, "--model", str(no_weights), "--max-model-len", "32", "--max-prompt-len", "32")
    assert within.startswith(f"--model {no_weights}: ")  # within both: on to loading
    assert worker_error(capsys, "--max-model-len", "1") == "--max-model-len: 1 is invalid: must be an integer >= 2"


def test_max_model_len_above_a_built_in_models_context_is_refused_once_it_loads(capsys):
    """A built-in model's context is known only once it is built (tiny: 2048): the engine refuses it."""
    assert worker_error(capsys, "--max-model-len", "2049") == (
        "--max-model-len: 2049 is above the model's context of 2048 tokens (its max_position_embeddings, RoPE "
        "scaling included): completions would run past the positions it was trained for"
    )


def test_max_model_len_up_to_a_rope_scaled_context_passes_as_vllms(capsys, tmp_path):
    """A YaRN-scaled model (Qwen's long-context setting: factor 4 over its original context) serves the scaled
    context, as vLLM derives its max_model_len: `--max-model-len` up to it goes on to loading, past it is refused
    naming the scaled context (it was refused past max_position_embeddings, vLLM's usual --max-model-len 131072
    for such a model included)."""
    folder = tmp_path / "yarn"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    Qwen3Config(**{**SMALL, "max_position_embeddings": 64, "rope_parameters": yarn}).save_pretrained(folder)
    assert worker_error(capsys, "--model", str(folder), "--max-model-len", "256").startswith(f"--model {folder}: ")
    message = worker_error(capsys, "--model", str(folder), "--max-model-len", "257")
    assert message == "--max-model-len 257: above the model's context (RoPE-scaled) of 256 tokens"
    message = worker_error(capsys, "--model", str(folder), "--max-prompt-len", "65")  # the engine's own: unscaled
    assert message == "--max-prompt-len 65: above the model's context of 64 tokens"
