"""`rollout-eval --model DIR` (and `rollout-worker --model DIR`: one loader) on a directory that holds no usable causal LM: a base model or classifier saved without
its LM head (which `from_pretrained` would fill at random, and the run would score noise with exit status 0), a
truncated weights file, or tokenizer files that cannot be read. Each is one error line naming --model and what is
wrong, exit status 2, no traceback. The references: transformers' own loading info (the weights it reports
missing) and its own errors on the broken files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification, Qwen3Model

from rollout.eval.cli import main
from rollout.presets import tiny_tokenizer
from rollout.presets.catalog import TINY_MODEL_CONFIG

REPO_DATASET = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic.jsonl"
SMALL = {**TINY_MODEL_CONFIG, "num_hidden_layers": 1, "pad_token_id": 0}


def error_of(capsys, model: Path) -> str:
    """rollout-eval's one error line (prefix dropped) for `--model model`, checked: exit status 2, no traceback."""
    flags = ["--model", model, "--dataset", REPO_DATASET, "--prompt-field", "question", "--max-new-tokens", "2"]
    assert main([str(flag) for flag in flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("rollout-eval: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("rollout-eval: error: ")


def save(folder: Path, model) -> Path:
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", [Qwen3Model, Qwen3ForSequenceClassification])
def test_a_checkpoint_without_its_lm_head_is_refused_naming_what_is_missing(capsys, tmp_path, kind):
    folder = save(tmp_path, kind(Qwen3Config(**SMALL)))
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}  # transformers would initialize the head at random
    message = error_of(capsys, folder)
    assert message.startswith(f"--model {folder}: its checkpoint lacks 1 weight(s) of Qwen3ForCausalLM")
    assert "(lm_head.weight)" in message and f"saved as {kind.__name__}" in message


def test_a_complete_checkpoint_with_tied_embeddings_still_runs(capsys, tmp_path):
    """The check is on weights transformers reports missing: a tied head, absent from the file, is not one."""
    from transformers import Qwen3ForCausalLM

    folder = save(tmp_path, Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=True)))
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"]
    flags = ["--model", folder, "--dataset", REPO_DATASET, "--prompt-field", "question", "--max-new-tokens", "2"]
    assert main([str(flag) for flag in flags]) == 0


def test_a_truncated_weights_file(capsys, tmp_path):
    from transformers import Qwen3ForCausalLM

    folder = save(tmp_path, Qwen3ForCausalLM(Qwen3Config(**SMALL)))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 16])  # an interrupted copy or download
    with pytest.raises(Exception) as reference:
        AutoModelForCausalLM.from_pretrained(folder)
    message = error_of(capsys, folder)
    cause = f"{type(reference.value).__name__}: {str(reference.value).splitlines()[0]}"
    assert message == f"--model {folder}: its checkpoint cannot be loaded ({cause})"


def test_tokenizer_files_that_cannot_be_read_say_why(capsys, tmp_path):
    from transformers import Qwen3ForCausalLM

    folder = save(tmp_path, Qwen3ForCausalLM(Qwen3Config(**SMALL)))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"})[:-3])  # cut short: not JSON
    with pytest.raises(ValueError) as reference:
        AutoTokenizer.from_pretrained(folder)
    message = error_of(capsys, folder)
    assert message == f"--model {folder}: its tokenizer cannot be loaded ({str(reference.value).splitlines()[0]})"


@pytest.fixture
def load_reports():
    """The LOAD REPORT tables transformers' `from_pretrained` logs (at its own logger, whatever its handlers)."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    reporter = logging.getLogger("transformers.modeling_utils")
    level = reporter.level
    reporter.setLevel(logging.WARNING)  # whatever verbosity an earlier test left transformers at
    reporter.addHandler(handler)
    yield said
    reporter.removeHandler(handler)
    reporter.setLevel(level)


def test_the_worker_refuses_a_checkpoint_without_its_lm_head_too(capsys, tmp_path, load_reports):
    """rollout-worker served such a model's random head (it loads models as rollout-eval does). The error is all it
    says: transformers' LOAD REPORT table of the same missing weight is not printed before it."""
    from rollout.service.launch import cli

    folder = save(tmp_path, Qwen3Model(Qwen3Config(**SMALL)))
    with pytest.raises(SystemExit) as exited:
        cli.main(["--model", str(folder), "--device", "cpu", "--bind", "tcp://127.0.0.1:*"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"rollout-worker: error: --model {folder}: its checkpoint lacks 1 weight(s) of Qwen3ForCausalLM" in error
    assert not [said for said in load_reports if "LOAD REPORT" in said]


def test_a_checkpoint_with_weights_the_model_does_not_take_loads_with_transformers_report(tmp_path, load_reports):
    """Unexpected weights are left out and the model serves: transformers' report of them is still said."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3ForCausalLM

    from rollout.service.launch.loading import load_model

    model = Qwen3ForCausalLM(Qwen3Config(**SMALL))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, "extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), None, torch.device("cpu"))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    (report,) = [said for said in load_reports if "LOAD REPORT" in said]
    assert "extra.weight" in report and "UNEXPECTED" in report


def test_a_model_directory_without_tokenizer_files_serves_token_ids_not_an_empty_tokenizer(caplog, tmp_path):
    """transformers builds GPT-2's tokenizer from a directory without tokenizer files, with one token: every text
    encodes to no ids. The worker served it (/tokenize answered 0 tokens); it now serves token ids only, as with
    --tokenizer none, saying so, and a --tokenizer directory without those files is refused by name."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rollout.service.launch.loading import load_tokenizer

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    empty = AutoTokenizer.from_pretrained(tmp_path)  # the reference: what transformers gives such a directory
    assert len(empty) == 1 and empty("hello world")["input_ids"] == []
    with caplog.at_level("WARNING"):
        assert load_tokenizer(str(tmp_path), None) == (None, None)
    assert f"--model {tmp_path} has no tokenizer (transformers built an empty tokenizer from" in caplog.text
    with pytest.raises(ValueError, match=r"transformers built an empty tokenizer from .*: it holds no tokenizer files"):
        load_tokenizer("tiny", str(tmp_path))
    tiny_tokenizer().save_pretrained(tmp_path)
    tokenizer, name = load_tokenizer(str(tmp_path), None)
    assert name == str(tmp_path) and len(tokenizer) == len(tiny_tokenizer())


def test_a_tokenizer_saved_only_as_a_tiktoken_model_is_loaded(tmp_path):
    """A directory whose tokenizer is `tiktoken.model` alone, which AutoTokenizer loads: a list of tokenizer file
    names (tokenizer.json, vocab.json ...) would have served it without one."""
    import base64

    from transformers import Qwen3ForCausalLM

    from rollout.service.launch.loading import load_tokenizer

    Qwen3ForCausalLM(Qwen3Config(**SMALL)).save_pretrained(tmp_path)
    ranks = [bytes([byte]) for byte in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    lines = [f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(ranks)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    reference = AutoTokenizer.from_pretrained(tmp_path)  # what transformers makes of it
    tokenizer, name = load_tokenizer(str(tmp_path), None)
    assert name == str(tmp_path) and tokenizer("hello")["input_ids"] == reference("hello")["input_ids"]
    assert len(tokenizer) > 256


def test_weights_saved_under_a_wrappers_prefix_are_named_with_what_is_missing(capsys, tmp_path):
    """A checkpoint whose every weight carries DDP's 'module.' prefix lacks them all under their names: the error
    names both sides, as transformers' report (held back) did."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3ForCausalLM

    folder = save(tmp_path, Qwen3ForCausalLM(Qwen3Config(**SMALL)))
    weights = load_file(folder / "model.safetensors")
    save_file({f"module.{name}": tensor for name, tensor in weights.items()}, folder / "model.safetensors")
    message = error_of(capsys, folder)
    assert f"lacks {len(weights)} weight(s) of Qwen3ForCausalLM" in message
    assert f"holds {len(weights)} it does not take (module." in message and "DDP's 'module.'" in message


def test_a_config_field_of_the_wrong_type_is_one_error_line(capsys, tmp_path):
    """transformers' config validation raises its own error kind (not a ValueError): named, with no traceback."""
    from transformers import Qwen3ForCausalLM

    folder = save(tmp_path, Qwen3ForCausalLM(Qwen3Config(**SMALL)))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": "512"}))
    message = error_of(capsys, folder)
    assert message.startswith(f"--model {folder}: its config.json cannot be read (StrictDataclassFieldValidationError")
