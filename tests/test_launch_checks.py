"""`rollout-worker`'s flags checked together before the model loads. Two of --bind, --http and --metrics-port asking
for one port each pass the probe of a free port alone, so the second bind failed only after the model had loaded
(minutes for a large one), with a traceback for the metrics server: each pair is now a usage error naming both flags.
An HTTP API flag given without --http, which the worker ignored, is refused by name."""

from __future__ import annotations

import pytest

from rollout.service.launch.cli import build_parser
from rollout.service.launch.startup import check_flags
from service_helpers import free_port


def check(argv: list[str]) -> None:
    parser = build_parser()
    check_flags(parser, parser.parse_args(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bind", "tcp://127.0.0.1:{p}", "--metrics-port", "{p}"], "--metrics-port {p}: port {p} is also --bind"),
        (
            ["--bind", "tcp://0.0.0.0:{p}", "--insecure", "--metrics-port", "{p}"],
            "--metrics-port {p}: port {p} is also --bind tcp://0.0.0.0:{p}",
        ),
        (["--http", "127.0.0.1:{p}", "--metrics-port", "{p}"], "--metrics-port {p}: port {p} is also --http"),
        (["--bind", "tcp://127.0.0.1:{p}", "--http", "127.0.0.1:{p}"], "--http 127.0.0.1:{p}: port {p} is also"),
    ],
)
def test_one_port_for_two_servers_is_a_usage_error_naming_both(argv, message, capsys):
    if "--http" in argv:
        pytest.importorskip("fastapi")
    port = free_port()  # free now (a fixed one may be another test's worker's, the other process's)
    argv, message = [arg.format(p=port) for arg in argv], message.format(p=port)
    if "--bind" not in argv:  # not the default 5555, which another process may hold
        argv += ["--bind", "tcp://127.0.0.1:*"]
    with pytest.raises(SystemExit) as exited:
        check(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") <= 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--bind", "tcp://127.0.0.1:{p}", "--metrics-port", "0"],
        ["--bind", "tcp://127.0.0.1:*", "--metrics-port", "{p}"],
        ["--bind", "tcp://127.0.0.2:{p}", "--metrics-port", "{p}"],
    ],
)
def test_distinct_or_system_picked_ports_pass(argv):
    port = free_port()
    check([arg.format(p=port) for arg in argv])


@pytest.mark.parametrize(
    "argv",
    [
        ["--http-max-body-bytes", "4096"],
        ["--http-head-timeout", "3"],
        ["--tool-call-parser", "hermes"],
        ["--trust-request-chat-template"],
    ],
)
def test_an_http_api_flag_without_http_is_a_usage_error_not_ignored(argv, capsys):
    """These flags only the HTTP API reads: given without --http, the worker served on and ignored them."""
    with pytest.raises(SystemExit) as exited:
        check(["--bind", "tcp://127.0.0.1:*", *argv])
    assert exited.value.code == 2
    assert f"{argv[0]}: has no effect without --http" in capsys.readouterr().err


def test_an_http_api_flag_set_by_the_environment_is_allowed_and_said_once(monkeypatch, capsys):
    """A deployment-wide ROLLOUT_HTTP_* variable sets the default: workers without --http still start, and say that
    it does nothing there (it was ignored silently). Typed at the variable's own value, the flag is still refused."""
    monkeypatch.setenv("ROLLOUT_HTTP_HEAD_TIMEOUT", "3")
    parser = build_parser()
    args = parser.parse_args(["--bind", "tcp://127.0.0.1:*"])
    check_flags(parser, args)
    check_flags(parser, args)  # the worker checks twice (before and after its imports): said once
    warned = "rollout-worker: warning: ROLLOUT_HTTP_HEAD_TIMEOUT is set but --http-head-timeout has no effect"
    assert capsys.readouterr().err.count(warned) == 1
    with pytest.raises(SystemExit):
        check(["--bind", "tcp://127.0.0.1:*", "--http-head-timeout", "3"])
    assert "--http-head-timeout: has no effect without --http" in capsys.readouterr().err


@pytest.mark.parametrize(
    "variables, argv, device",
    [
        ({"ROLLOUT_GPU": "0"}, ["--device", "cpu"], "cpu"),  # served on cuda:0 (or refused on a CPU machine)
        ({"ROLLOUT_GPU": "0"}, ["--device=cpu"], "cpu"),
        ({"ROLLOUT_DEVICE": "cuda:0"}, ["--device", "cpu"], "cpu"),
        ({"ROLLOUT_DEVICE": "cpu"}, [], "cpu"),
    ],
)
def test_a_typed_device_wins_over_the_environments(monkeypatch, variables, argv, device):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    parser = build_parser()
    served, *_ = check_flags(parser, parser.parse_args(["--bind", "tcp://127.0.0.1:*", *argv]))
    assert str(served) == device


def test_both_device_variables_and_no_flag_is_a_usage_error_naming_them(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_GPU", "0")
    monkeypatch.setenv("ROLLOUT_DEVICE", "cpu")
    with pytest.raises(SystemExit) as exited:
        check(["--bind", "tcp://127.0.0.1:*"])
    assert exited.value.code == 2
    assert "ROLLOUT_GPU and ROLLOUT_DEVICE are both set" in capsys.readouterr().err


@pytest.mark.parametrize("mode, warned", [(0o600, False), (0o400, False), (0o640, True), (0o644, True)])
def test_a_secret_key_others_can_read_is_warned_about(tmp_path, caplog, mode, warned):
    """rollout-keygen writes the secret 0600; a copy others can read (a chmod, a mounted secret) served silently."""
    import logging
    import os

    from rollout.service.launch.startup import warn_open_secret

    secret = tmp_path / "worker.key_secret"
    secret.write_text("x")
    os.chmod(secret, mode)
    with caplog.at_level(logging.WARNING, logger="rollout.worker"):
        warn_open_secret(str(secret))
    assert bool(caplog.records) == warned
    if warned:
        assert f"(mode {mode:04o})" in caplog.records[0].getMessage()


def test_ctrl_c_while_the_worker_starts_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C while torch imported or the model loaded printed the traceback of wherever it landed."""
    from rollout.service.launch import cli, startup

    def interrupted(parser, args):
        raise KeyboardInterrupt

    monkeypatch.setattr(startup, "start_worker", interrupted)
    assert cli.main(["--bind", "tcp://127.0.0.1:*"]) == 130
    assert capsys.readouterr().err == "rollout-worker: interrupted while starting\n"


def test_ctrl_c_that_an_import_turns_into_another_error_is_still_one_line_and_status_130(monkeypatch, capsys):
    """A SIGINT that lands inside an import leaves a module half-initialised, and the next import fails with an
    unrelated error: Ctrl-C while the worker started printed transformers' "Could not import module
    'AttentionInterface'" traceback (over numpy's RecursionError) and exited 1. C extensions may also wrap it
    (pydantic's SchemaError)."""
    import os
    import signal
    import time

    from rollout.service.launch import cli, startup

    def interrupted_inside_an_import(parser, args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)  # the SIGINT handler raises here
        except KeyboardInterrupt:
            pass  # what a half-done import does with it: the error that follows is another one
        raise ModuleNotFoundError("Could not import module 'AttentionInterface'")

    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(startup, "start_worker", interrupted_inside_an_import)
    assert cli.main(["--bind", "tcp://127.0.0.1:*"]) == 130
    assert capsys.readouterr().err == "rollout-worker: interrupted while starting\n"
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("ROLLOUT_METRICS_HOST", "0.0.0.0", "ROLLOUT_METRICS_HOST (--metrics-host) 0.0.0.0: has no effect without"),
        ("ROLLOUT_SPECULATIVE_INDEX_TOKENS", "5", "ROLLOUT_SPECULATIVE_INDEX_TOKENS (--speculative-index-tokens): has"),
        ("ROLLOUT_MAX_BATCH_TOKENS", "0", "ROLLOUT_MAX_BATCH_TOKENS (--max-batch-tokens): 0 is invalid"),
    ],
)
def test_a_usage_error_a_variable_caused_names_the_variable(monkeypatch, capsys, variable, value, message):
    """The user set the variable, not the flag: the error named only the flag, which appears nowhere they typed.
    Typed on the command line, the same value's error names the flag alone."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit):
        check(["--bind", "tcp://127.0.0.1:*"])
    assert f"rollout-worker: error: {message}" in capsys.readouterr().err
    flag = "--" + variable.removeprefix("ROLLOUT_").lower().replace("_", "-")
    with pytest.raises(SystemExit):
        check(["--bind", "tcp://127.0.0.1:*", flag, value])
    err = capsys.readouterr().err
    assert f"rollout-worker: error: {flag}" in err and variable not in err


def test_a_variable_named_later_in_a_message_is_named_too(monkeypatch, capsys):
    """Only a flag opening the message was named with its variable: here the user typed one flag and set the
    other by a variable, which the message named by its flag alone."""
    monkeypatch.setenv("ROLLOUT_HTTP_MAX_BODY_BYTES", "100000")
    with pytest.raises(SystemExit):
        check(["--bind", "tcp://127.0.0.1:*", "--http", "127.0.0.1:0", "--http-max-receiving-bytes-per-client", "2000"])
    assert (
        "--http-max-receiving-bytes-per-client 2000: must be at least ROLLOUT_HTTP_MAX_BODY_BYTES "
        "(--http-max-body-bytes) (100000)"
    ) in capsys.readouterr().err


def test_sigterm_while_the_worker_starts_is_one_line_and_status_143(monkeypatch, capsys):
    """A SIGTERM while the model loaded killed the process with no word of why: it now stops as Ctrl-C does, with
    the shell's status for SIGTERM, and the caller's handler is back."""
    import os
    import signal
    import time

    from rollout.service.launch import cli, startup

    def terminated(parser, args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises here

    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(startup, "start_worker", terminated)
    assert cli.main(["--bind", "tcp://127.0.0.1:*"]) == 143
    assert capsys.readouterr().err == "rollout-worker: interrupted while starting\n"
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.parametrize("argv", [["--device", ""], ["--device", " "], ["--device="]])
def test_an_empty_device_is_a_usage_error_not_the_cpu(argv, capsys):
    """`--device ''` read as unset: the worker served on the CPU without a word (an empty value is a mistake, e.g. an
    unset shell variable: `--device $DEVICE`)."""
    with pytest.raises(SystemExit) as exited:
        check(["--bind", "tcp://127.0.0.1:*", *argv])
    assert exited.value.code == 2
    assert "rollout-worker: error: --device" in capsys.readouterr().err


def test_an_empty_device_variable_is_named_and_a_typed_gpu_still_wins(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_DEVICE", "")
    with pytest.raises(SystemExit):
        check(["--bind", "tcp://127.0.0.1:*"])
    assert "rollout-worker: error: ROLLOUT_DEVICE (--device) '': empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (no CUDA here: refused for --gpu's own reason, not for the variable)
        check(["--bind", "tcp://127.0.0.1:*", "--gpu", "0"])
    assert "ROLLOUT_DEVICE" not in capsys.readouterr().err


def test_a_lora_hub_id_is_fetched_online_and_read_from_the_cache_offline(tmp_path, monkeypatch):
    """--lora NAME=org/name that is no directory is a hub id, which peft fetches (as --model's): accepted online,
    and offline (HF_HUB_OFFLINE) only when its adapter is in the local cache, refused before anything loads
    otherwise (peft's retries came after the model loaded). A path that is no hub id is refused either way."""
    import argparse

    import huggingface_hub.constants as constants

    from rollout.service.launch.flags import lora_specs

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--someorg--math-lora" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "adapter_config.json").write_text("{}")
    (tmp_path / "models--someorg--math-lora" / "refs").mkdir()
    (tmp_path / "models--someorg--math-lora" / "refs" / "main").write_text("0" * 40)
    parser = argparse.ArgumentParser()
    for offline, spec, accepted in [
        (False, "math=someorg/not-cached", True),
        (True, "math=someorg/math-lora", True),
        (True, "math=someorg/not-cached", False),
        (False, "math=adapters/math/v1", False),
        (False, "math=./math", False),
    ]:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        if accepted:
            assert lora_specs(parser, [spec], "m") == [tuple(spec.split("="))]
        else:
            with pytest.raises(SystemExit):
                lora_specs(parser, [spec], "m")
