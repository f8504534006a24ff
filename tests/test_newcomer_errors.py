"""The errors a newcomer meets first (issue 37, item 3): each is one line that says what to do, never a traceback;
a console script or example exits 2 with the line on stderr. Everything runs in-process and fails before any model
loads, so the module costs a few seconds.

(a) a model id with no network: here generate_batch / init_continuous_batching given a model name, and
    examples/grpo_gpu.py. Already checked elsewhere: `rollout-worker --model ID` in
    tests/test_worker.py::test_a_hub_model_on_a_machine_without_network_is_one_line_at_once, `rollout-eval --model`
    and `--dataset` in tests/test_eval_errors.py::test_a_hub_model_with_no_network (and _dataset_, _offline_mode_),
    examples/generate_batch.py in test_eval_errors.py::test_the_generate_batch_example_with_a_hub_model_and_no_network.
(b) no chat template where one is needed: here the worker's /v1/chat/completions (a 400 saying what to do, and a
    warning when the worker starts). `rollout-eval --chat`: test_eval_errors.py::test_chat_with_a_tokenizer_without_a_
    chat_template. TRL renders conversational prompts itself (transformers' own message names the fix).
(c) a GPU flag on a CPU torch: here `rollout-worker --gpu 0` and `--device cuda`, word for word. `rollout-eval
    --device cuda`: test_eval_errors.py::test_a_gpu_flag_on_a_cpu_torch. The examples take no device flag.
(d) a port in use: here --bind, --http and --metrics-port, word for word, before the model loads (tests/test_worker.py::
    test_a_port_in_use_is_a_usage_error_before_the_model_loads checks --bind against a running worker).
(e) a missing extra, naming the pip command: here `rollout-worker --http` without FastAPI/uvicorn, `import rollout.ray`
    without Ray, examples/grpo_toy.py without matplotlib (its plot), and `rollout.cli.extras` against pyproject.toml.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import socket
import sys
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from rollout.config import FieldError

ROOT = Path(__file__).resolve().parents[1]
BIND = ["--bind", "tcp://127.0.0.1:*"]  # the default port may be taken on a test machine


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """A hub endpoint nothing listens on and an empty hub cache: a machine with no network (as test_eval_errors)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture
def no_model_loads(monkeypatch):
    """rollout-worker's usage errors must come before the model loads."""
    from rollout.service.launch import startup

    monkeypatch.setattr(startup, "load_model", lambda *a: pytest.fail("the model was loaded before the check"))


def error_line(capsys) -> str:
    """The message of the one "PROG: error: ..." line on stderr (argparse's usage before it aside), checked to come
    without a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if re.match(r"\S+: error: ", line)]
    assert len(lines) == 1, err
    return lines[0].partition(": error: ")[2]


def worker_error(capsys, flags: list[str]) -> str:
    """rollout-worker's error line for `flags`, checked to exit with status 2."""
    from rollout.service.launch import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(flags)
    assert stop.value.code == 2
    return error_line(capsys)


def example(name: str) -> types.ModuleType:
    """examples/<name>.py, loaded as a module (its main not run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub_module(monkeypatch, name: str, **attributes: object) -> None:
    """Stand a module in for `name` (an example's heavy import its checks never reach)."""
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attributes))


# (a) a model id with no network, or given where a model is needed


@pytest.mark.parametrize("entry", ["generate_batch", "init_continuous_batching"])
def test_a_model_name_where_a_loaded_model_is_needed_says_how_to_load_it(entry):
    import rollout

    arguments = ([[1, 2, 3]],) if entry == "generate_batch" else ()
    with pytest.raises(FieldError) as refused:
        getattr(rollout, entry)("Qwen/Qwen3-0.6B", *arguments)
    assert str(refused.value) == (
        "model: 'Qwen/Qwen3-0.6B' is a model name, not a model: load it first, e.g. model = "
        "AutoModelForCausalLM.from_pretrained('Qwen/Qwen3-0.6B') (from transformers), and pass the model"
    )
    # A built-in model's name (what `rollout-worker --model tiny` takes): from_pretrained would look for it on the hub.
    with pytest.raises(FieldError) as refused:
        getattr(rollout, entry)("tiny", *arguments)
    hint = str(refused.value).split("e.g. ")[1].split(",")[0]
    assert hint == "model = rollout.presets.model_from_preset('tiny')"
    exec(hint, {"rollout": rollout})  # the hint runs as written


def test_the_grpo_gpu_example_with_a_hub_model_and_no_network(capsys, monkeypatch, unreachable_hub):
    stub_module(monkeypatch, "trl", GRPOConfig=None)  # TRL's trainer stack loads for seconds; the hub check is first
    stub_module(monkeypatch, "trainer_bridge.trl", RolloutGRPOTrainer=None)
    with pytest.raises(SystemExit) as stop:
        example("grpo_gpu").main(["--model", "someone/some-model", "--workers", "tcp://127.0.0.1:1"])
    assert stop.value.code == 2
    assert error_line(capsys) == (
        "--model someone/some-model: not a local path, 127.0.0.1 cannot be reached from this machine (no network?), "
        "and the Hugging Face cache does not hold it: download it where there is network (`hf download "
        "someone/some-model --local-dir DIR`) and pass DIR, or point HF_HOME at a cache that holds it"
    )


# (b) a tokenizer without a chat template


def test_http_chat_with_a_tokenizer_without_a_chat_template(caplog):
    from rollout import ContinuousBatchingConfig, init_continuous_batching
    from rollout.presets import tiny_model, tiny_tokenizer
    from rollout.service.group_counters import GroupCounters
    from rollout.service.http.serving.launch import start_http
    from rollout.service.launch.cli import build_parser
    from rollout.service.zmq.limits import WorkerLimits

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=8))
    parser = build_parser()
    args = parser.parse_args(["--http", "127.0.0.1:0", "--model", "my-base-model"])
    worker = types.SimpleNamespace(  # what start_http reads of a RolloutWorker
        max_prompt_len=64,
        counters=GroupCounters(),
        compiles=None,
        update_committed=lambda directory, nbytes, pause_ms: None,
        update_refused=lambda: None,
        model_name="my-base-model",
    )
    caplog.set_level(logging.WARNING, logger="rollout.worker")
    http = start_http(parser, args, ("127.0.0.1", 0), manager, worker, tokenizer, WorkerLimits())
    try:
        assert (
            "--http: the tokenizer of my-base-model has no chat template, so /v1/chat/completions answers 400: pass "
            "--tokenizer naming one that has (the instruct model's), or send rendered prompts to /v1/completions"
        ) in [record.getMessage() for record in caplog.records]
        body = {"model": "my-base-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        request = urllib.request.Request(
            f"{http.url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(answer.value.read())["error"]
    finally:
        http.stop()
        manager.engine.close()
    assert answer.value.code == 400 and error["param"] == "messages"
    assert error["message"] == (
        "messages: the worker's tokenizer has no chat template: restart the worker with --tokenizer naming one that "
        "has (the instruct model's), or send the rendered prompt to /v1/completions"
    )


# (c) a GPU flag on a CPU torch


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.version.cuda is not None,
    reason="checks the message of a CPU-only torch build (a CUDA build without a GPU says so instead)",
)
@pytest.mark.parametrize(
    ("flags", "instead"),
    [(["--gpu", "0"], "drop --gpu to run on the CPU"), (["--device", "cuda"], "run on --device cpu")],
)
def test_a_gpu_flag_on_a_cpu_torch(capsys, no_model_loads, flags, instead):
    assert worker_error(capsys, [*flags, *BIND]) == (
        f"{' '.join(flags)}: torch {torch.__version__} (a CPU-only build) sees no CUDA device: install a CUDA build of "
        f"torch (https://pytorch.org/get-started/locally/) on a machine with a GPU, or {instead}"
    )


# (d) a port in use


@pytest.mark.parametrize("flag", ["--bind", "--http", "--metrics-port"])
def test_a_port_in_use_names_the_flag_and_what_to_do(capsys, no_model_loads, flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = {"--bind": f"tcp://127.0.0.1:{port}", "--http": f"127.0.0.1:{port}", "--metrics-port": str(port)}[flag]
        line = worker_error(capsys, [flag, value, *([] if flag == "--bind" else BIND)])
    free = "tcp://HOST:*" if flag == "--bind" else "0"
    assert line == (
        f"{flag} {value}: cannot bind, port {port} is already in use: stop what listens there or pick another port "
        f"({free} picks a free one)"
    )


# (e) a missing optional extra


def test_the_http_api_without_fastapi_and_uvicorn(capsys, monkeypatch, no_model_loads):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # an import of a module mapped to None fails
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    line = worker_error(capsys, ["--http", "127.0.0.1:0", *BIND])
    assert line == "--http 127.0.0.1:0 needs fastapi and uvicorn, which are not installed: pip install 'rollout[http]'"


def test_rollout_ray_without_ray(monkeypatch):
    from rollout.cli.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "rollout.ray", raising=False)
    with pytest.raises(ImportError) as refused:
        importlib.import_module("rollout.ray")
    assert isinstance(refused.value, MissingExtra) and refused.value.__cause__ is None
    assert str(refused.value) == "rollout.ray needs ray, which is not installed: pip install 'rollout[ray]'"


def test_the_fleet_benchmark_without_ray(monkeypatch, capsys):
    from rollout.benchmarks import cli
    from rollout.benchmarks.service import fleet

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setattr(fleet, "run", lambda args: pytest.fail("the benchmark ran without Ray"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fleet"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-2]  # the last line points at --help
        .endswith("rollout-bench fleet needs ray, which is not installed: pip install 'rollout[ray]'")
    )


def test_the_grpo_toy_example_without_matplotlib_stops_before_training(capsys, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # the example sets it; restored after
    stub_module(monkeypatch, "trainer_bridge.trl", RolloutGRPOTrainer=None)
    module = example("grpo_toy")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(module, "start_worker", lambda *a: pytest.fail("a worker started before the check"))
    with pytest.raises(SystemExit) as stop:
        module.main([])
    assert stop.value.code == 2
    assert error_line(capsys) == (
        "examples/grpo_toy.py (its reward plot) needs matplotlib, which is not installed: pip install "
        "'rollout[examples]'"
    )


def test_every_extra_named_installs_the_modules_it_is_checked_by():
    """The pip command each message names installs what was missing (pyproject's extras hold those packages)."""
    from rollout.cli.extras import EXTRA_MODULES

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRA_MODULES.items():
        names = {Requirement(requirement).name for requirement in extras[extra]}  # the extras' module names
        assert set(modules) <= names, (extra, modules, names)


def test_a_leftover_folder_is_not_an_installed_extra(monkeypatch, tmp_path):
    """A bare folder of the module's name (what an uninstall can leave) would import as an empty namespace package."""
    from rollout.cli import extras

    (tmp_path / "rollout_leftover_module").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(extras.EXTRA_MODULES, "leftover", ("rollout_leftover_module",))
    with pytest.raises(extras.MissingExtra, match=r"^x needs rollout_leftover_module, which is not installed"):
        extras.require_extra("leftover", "x")


def test_an_ipv6_loopback_http_address_is_probed_as_ipv6():
    """`--http [::1]:PORT` reaches the port check as `::1`, which an IPv4 probe could not bind."""
    import argparse

    from rollout.service.address_checks import check_bind

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
        port = probe.getsockname()[1]
    check_bind(argparse.ArgumentParser(), f"tcp://::1:{port}", flag="--http", shown=f"[::1]:{port}")  # no error


def test_stats_from_a_worker_that_is_not_running_names_its_address():
    """`RolloutGRPOTrainer` reads the workers' stats first: with no worker at the address, the error names it and
    asks whether rollout-worker runs there (it said only that "a worker did not answer stats in time")."""
    import socket

    from trainer_bridge import RolloutClient, RolloutError

    with socket.socket() as reserved:  # bound, never listening: no other test's worker can take the port meanwhile
        reserved.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{reserved.getsockname()[1]}"
        with RolloutClient(address) as client, pytest.raises(RolloutError) as refused:
            client.stats(timeout=0.5)
    assert refused.value.code == "timeout"
    assert f"no answer from {address}. Is rollout-worker running at that address and port?" in str(refused.value)


@pytest.mark.parametrize("version", ["4001", 2.0, True, -1])
def test_a_push_version_that_is_no_integer_is_refused_by_name(version):
    """`push_weights(..., version="4001")` failed deep inside with a bare TypeError comparing versions."""
    from rollout.presets import tiny_model
    from trainer_bridge import push_weights

    with pytest.raises(FieldError, match="^version: must be a non-negative integer"):
        push_weights(None, tiny_model(), version=version)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-port", "99999"], "--metrics-port 99999: a TCP port is 0 to 65535 (0 picks a free one)"),
        (
            ["--metrics-host", "0.0.0.0"],
            "--metrics-host 0.0.0.0: has no effect without --metrics-port (metrics are off)",
        ),
        (["--metrics-port", "0", "--metrics-host", "a/b"], "--metrics-host 'a/b': not a host name or IP address"),
        (["--metrics-port", "0", "--metrics-host", "127.0.0.1:80"], "--metrics-host '127.0.0.1:80': not a host"),
        (["--metrics-port", "0", "--metrics-host", "[::1]"], "--metrics-host '[::1]': not a host name or IP address"),
        (["--metrics-host", "127.0.0.1"], "--metrics-host 127.0.0.1: has no effect without --metrics-port"),
    ],
)
def test_metrics_flags_that_cannot_work_name_themselves(capsys, no_model_loads, flags, message):
    """A port out of range was reported as a ZeroMQ address (suggesting :*), a host under --metrics-port, and
    --metrics-host alone was ignored."""
    assert worker_error(capsys, [*flags, *BIND]).startswith(message)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--cuda-graphs", "on"],
            "--cuda-graphs on: CUDA graphs need a CUDA device (--gpu N); this worker serves on cpu",
        ),
        (["--attention-backend", "triton"], "--attention-backend triton: the kernels run on CUDA (--gpu N); this"),
        (["--gpu", "-1"], "--gpu -1: a CUDA device index is 0 or more (nvidia-smi lists them)"),
    ],
)
def test_gpu_only_flags_on_a_cpu_worker_are_refused_before_the_model_loads(
    capsys, monkeypatch, no_model_loads, flags, message
):
    """They were refused after the model loaded and the cache was allocated, one as '--cuda-graphs: True needs...'
    (the Triton kernels run on a CPU only in Triton's interpreter, which the tests turn on)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = flags if "--gpu" in flags else [*flags, "--device", "cpu"]
    assert worker_error(capsys, [*argv, *BIND]).startswith(message)


def test_a_multimodal_model_serves_text_and_refuses_its_media_placeholder_by_name():
    """limits.md: multimodal models serve text only. A text prompt gets transformers' greedy tokens; a prompt holding
    the image placeholder (no pixels can come with it) is refused by name instead of being read as a plain token."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration

    from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch

    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)  # fmt: skip
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=255))
    model.eval()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=())
    config = ContinuousBatchingConfig(num_blocks=64)
    out = generate_batch(model, [[1, 2, 3, 4]], sampling=greedy, continuous_batching_config=config, progress_bar=False)
    expected = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert out["req_0"].generated_tokens == expected[0, 4:].tolist()
    with pytest.raises(FieldError, match=r"input_ids: token 255 at position 1 .*\(image_token_id\).*text only"):
        generate_batch(model, [[1, 255, 3]], sampling=greedy, continuous_batching_config=config, progress_bar=False)
    # A text model whose config kept such a field (a text-only conversion) names no media: its token is text
    language_model = LlamaForCausalLM(text).eval()
    language_model.config.image_token_id = 255
    out = generate_batch(language_model, [[1, 255, 3]], sampling=greedy, continuous_batching_config=config,
                         progress_bar=False)  # fmt: skip
    assert len(out["req_0"].generated_tokens) == 6


def test_speculative_settings_without_speculative_are_named(monkeypatch):
    """A speculative setting without `speculative`: refused where it was typed (--batch-config, as rollout-worker's
    flags are; no warning first), a warning naming it from Python, once a process (one config toggled by
    `speculative` alone is common, and configs are copied)."""
    import dataclasses

    from rollout import config as config_module
    from rollout.cli.batch_config_flags import batch_config_from_pairs
    from rollout.config import ContinuousBatchingConfig

    monkeypatch.setattr(config_module, "_WARNED", set())  # other tests in this process may have been warned
    logger = logging.getLogger("rollout.config")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        with pytest.raises(FieldError, match="num_speculative_tokens: has no effect without speculative"):
            batch_config_from_pairs(["num_speculative_tokens=8"])
        assert batch_config_from_pairs(["num_speculative_tokens=8", "speculative=suffix"]).num_speculative_tokens == 8
        assert not records
        config = ContinuousBatchingConfig(speculative_disable_by_batch_size=2)
        dataclasses.replace(config, num_blocks=64)
        ContinuousBatchingConfig(speculative="suffix", speculative_disable_by_batch_size=2)
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == [
        "ContinuousBatchingConfig: speculative_disable_by_batch_size has no effect while speculative is None"
    ]


def test_a_vllm_spelling_in_generation_kwargs_is_named_as_typed():
    """GRPOConfig(generation_kwargs={"max_tokens": "7"}): the error names max_tokens, the key the user typed."""
    from types import SimpleNamespace

    from trainer_bridge.grpo_sampling import grpo_sampling

    args = SimpleNamespace(generation_kwargs={"max_tokens": "7"}, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                           repetition_penalty=1.0, max_completion_length=16)  # fmt: skip
    with pytest.raises(FieldError, match=r"generation_kwargs\['max_tokens'\] \(max_new_tokens\): '7' is invalid"):
        grpo_sampling(args, [2])


def test_a_misspelt_generation_kwargs_key_names_the_key_it_resembles():
    """GRPOConfig(generation_kwargs={"max_new_token": 7, "repetiton_penalty": 1.1}): refused, with the keys meant."""
    from types import SimpleNamespace

    from trainer_bridge.grpo_sampling import grpo_sampling

    typos = {"max_new_token": 7, "repetiton_penalty": 1.1, "ignore_eso": True, "zzz": 1}
    args = SimpleNamespace(generation_kwargs=typos, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                           repetition_penalty=1.0, max_completion_length=16)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"\['ignore_eso', 'max_new_token', 'repetiton_penalty', 'zzz'\] are not"
    ) as error:
        grpo_sampling(args, [2])
    assert str(error.value).endswith(
        "; did you mean 'ignore_eos' (for 'ignore_eso'), 'max_new_tokens' (for 'max_new_token'), "
        "'repetition_penalty' (for 'repetiton_penalty')?"
    )


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"seed": 2**64}, "sampling.seed", "in [-2**63, 2**64) on the wire"),  # what msgpack carries
        ({"seed": -(2**63) - 1}, "sampling.seed", "in [-2**63, 2**64) on the wire"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "sampling.min_new_tokens", "at most max_new_tokens (2)"),
    ],
)
def test_sampling_values_no_run_could_honour_are_refused_by_name(fields, field, reason):
    from rollout import SamplingParams

    with pytest.raises(FieldError, match=re.escape(reason)) as refused:
        SamplingParams.from_fields(fields)
    assert refused.value.field == field
    SamplingParams.from_fields({"seed": 2**64 - 1, "min_new_tokens": 2, "max_new_tokens": 2})  # the edges are fine
    assert SamplingParams(seed=2**70).seed == 2**70  # in-process, any integer seeds (the engine hashes it)
    with pytest.raises(FieldError, match=re.escape("at most max_new_tokens (16, the generation config's)")):
        SamplingParams(min_new_tokens=100).with_defaults(SamplingParams(max_new_tokens=16))


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("max_tokens", "vLLM's name; rollout's is 'max_new_tokens'"),
        ("ignore_eos", "stop_token_ids=[] (no stop tokens) generates past the EOS"),
        ("temprature", "did you mean 'temperature'?"),
    ],
)
def test_another_tools_name_or_a_typo_for_a_sampling_field_is_answered_with_ours(name, hint):
    """Over the wire (SamplingParams.from_fields), in-process (generate_batch, a dict or keywords) and over HTTP (the
    same words, the OpenAI fields as candidates), an unknown field names the one it stands for."""
    from rollout import SamplingParams, generate_batch
    from rollout.presets import tiny_model
    from rollout.service.http.api.openai_fields import check_fields
    from rollout.service.http.errors import APIError

    with pytest.raises(FieldError, match=re.escape(hint)) as refused:
        SamplingParams.from_fields({name: 1})
    assert refused.value.field == f"sampling.{name}"
    with pytest.raises(FieldError, match=re.escape(hint)):
        generate_batch(tiny_model(0), [[1, 2, 3]], sampling={name: 1}, max_new_tokens=2, progress_bar=False)
    with pytest.raises(FieldError, match="a sampling field's name is a string, got 1"):  # a msgpack map's key
        SamplingParams.from_fields({1: 2, 2: 3})
    with pytest.raises(APIError, match=re.escape("did you mean 'max_tokens'?")):
        check_fields({"max_token": 3}, {"model", "messages", "max_tokens"})


def test_generate_batch_takes_sampling_fields_as_a_dict_over_the_generation_config():
    """A dict of SamplingParams fields (as a RolloutClient takes them) is applied over the model's generation config,
    as keyword fields are; the tokens equal those of the SamplingParams it makes."""
    from transformers import GenerationConfig

    from rollout import SamplingParams, generate_batch
    from rollout.presets import tiny_model

    model = tiny_model(0)
    model.generation_config = GenerationConfig(do_sample=True, top_k=5, max_new_tokens=6)
    fields = {"temperature": 0.7, "seed": 3}
    as_dict = generate_batch(model, [[1, 2, 3], [4, 5]], sampling=fields, progress_bar=False)
    made = SamplingParams(do_sample=True, top_k=5, max_new_tokens=6, **fields)
    as_params = generate_batch(model, [[1, 2, 3], [4, 5]], sampling=made, progress_bar=False)
    assert [o.generated_tokens for o in as_dict.values()] == [o.generated_tokens for o in as_params.values()]
    assert all(len(o.generated_tokens) == 6 for o in as_dict.values())
    plain = generate_batch(
        model, [[1, 2, 3]], sampling=SamplingParams(temperature=0.7, seed=3, max_new_tokens=6), progress_bar=False
    )
    assert plain["req_0"].generated_tokens != as_dict["req_0"].generated_tokens  # top_k=5 came from the config


@pytest.mark.parametrize("script", ["stream_client.py", "grpo_toy.py"])
def test_ctrl_c_in_an_example_waiting_for_a_worker_ends_without_a_traceback(script):
    """Both examples wait for a worker (the stream client for one at --worker, the GRPO example for the one it
    starts); Ctrl-C there printed a KeyboardInterrupt traceback through the client's internals."""
    import os
    import signal
    import subprocess
    import time

    from service_helpers import free_port

    examples = Path(__file__).resolve().parents[1] / "examples"
    argv = ["--worker", f"tcp://127.0.0.1:{free_port()}"] if script == "stream_client.py" else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, str(examples / script), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # the signal goes to this process group only, as a terminal's Ctrl-C does
    )
    try:
        if script == "stream_client.py":
            assert "tiny model" in process.stdout.readline()  # past its imports, waiting for the worker
        else:  # past its imports once it has started its worker (accelerate, which TRL needs, brings psutil)
            import psutil

            deadline = time.monotonic() + 120
            while not psutil.Process(process.pid).children() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1)  # the worker loading
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "Traceback" not in err, err
    assert process.returncode == 130 and err.endswith(f"{script.removesuffix('.py')}: interrupted\n"), err


def test_a_near_miss_of_a_name_we_know_is_answered_with_it(capsys, unreachable_hub):
    """torch's name for another tool's dtype spelling, the built-in model a typo'd --model is close to (after the hub
    error it gets, as a hub id), the --batch-config field a key is close to."""
    from rollout.cli.batch_config_flags import batch_config_from_pairs
    from rollout.cli.hub import HubUnreachable
    from rollout.service.launch.cli import build_parser
    from rollout.service.launch.loading import load_model

    for typed, meant in (("fp16", "float16"), ("half", "float16"), ("bf16", "bfloat16"), ("float64", "float32")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--dtype", typed])
        assert f"invalid choice: '{typed}'" in (err := capsys.readouterr().err) and f"did you mean {meant}?" in err
    with pytest.raises(HubUnreachable, match="cannot be reached.*; or did you mean the built-in model 'tiny-moe'"):
        load_model("tiny-mo", torch.float32, "cpu")
    with pytest.raises(HubUnreachable) as far:  # nothing close: the hub's error alone
        load_model("someone/some-model", torch.float32, "cpu")
    assert "did you mean" not in str(far.value)
    with pytest.raises(FieldError, match="num_block: is not .* field settable here; did you mean num_blocks?"):
        batch_config_from_pairs(["num_block=64"])


@pytest.mark.parametrize("inputs", ["hello", ["hello", "world"]])
def test_text_given_to_generate_batch_says_to_tokenize_it(inputs):
    """`generate_batch(model, "hello")` was read as five one-character prompts, refused as "prompt 0 of the batch:
    expected a list of token ids, got str" (about "h"): a text is named as a list of texts is, with what to do."""
    from rollout import FieldError, generate_batch
    from rollout.presets import tiny_model

    with pytest.raises(FieldError, match=r"input_ids: .*got str: tokenize it first"):
        generate_batch(tiny_model(), inputs)
