"""Which flags the command line gave (`CliParser.typed`) counts the abbreviations argparse accepts for them, found by
an adversarial review: `--dev cpu` with ROLLOUT_GPU=0 set was refused as "ROLLOUT_GPU and ROLLOUT_DEVICE are both
set", and `--http-max-body 100` or `--tool-call hermes` without --http were ignored silently (the full spellings are
refused). Both --gpu and --device typed, at the value a ROLLOUT_GPU variable set, passed argparse's exclusion (it
sees no change from the default) and --gpu was dropped silently."""

from __future__ import annotations

import pytest

from rollout.service.launch.cli import build_parser
from rollout.service.launch.startup import check_flags

BIND = ["--bind", "tcp://127.0.0.1:*"]


@pytest.mark.parametrize("argv", [["--dev", "cpu"], ["--devi=cpu"]])
def test_an_abbreviated_device_flag_wins_over_rollout_gpu(monkeypatch, argv):
    monkeypatch.setenv("ROLLOUT_GPU", "0")
    parser = build_parser()
    args = parser.parse_args([*BIND, *argv])
    assert args.device == "cpu" and args.gpu == 0  # what argparse made of it: --device, and ROLLOUT_GPU's default
    served, *_ = check_flags(parser, args)
    assert str(served) == "cpu"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--http-max-body", "4096"], "--http-max-body-bytes"),
        (["--tool-call=hermes"], "--tool-call-parser"),
        (["--trust-request"], "--trust-request-chat-template"),
    ],
)
def test_an_abbreviated_http_api_flag_without_http_is_refused(argv, flag, capsys):
    parser = build_parser()
    args = parser.parse_args([*BIND, *argv])
    dest = flag.removeprefix("--").replace("-", "_")
    assert getattr(args, dest) != parser.get_default(dest)  # argparse took the abbreviation for the flag
    with pytest.raises(SystemExit) as exited:
        check_flags(parser, args)
    assert exited.value.code == 2
    assert f"{flag}: has no effect without --http" in capsys.readouterr().err


def test_an_ambiguous_or_unknown_prefix_is_not_taken_for_a_flag():
    parser = build_parser()
    parser.parse_args([*BIND, "--http-max-body", "4096"])
    assert parser.typed("--http-max-body-bytes")
    assert not parser.typed("--http-max-receiving-bytes")  # "--http-max-rec" would be ambiguous; this is neither
    assert not parser.typed("--device") and not parser.typed("--gpu")


def test_gpu_and_device_both_typed_are_refused_even_at_rollout_gpus_value(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_GPU", "0")
    parser = build_parser()
    args = parser.parse_args([*BIND, "--gpu", "0", "--device", "cpu"])  # argparse's exclusion does not see --gpu
    with pytest.raises(SystemExit) as exited:
        check_flags(parser, args)
    assert exited.value.code == 2
    assert "--gpu and --device exclude each other" in capsys.readouterr().err


def test_every_console_script_says_its_version(capsys):
    """`--version` on each command prints its name and the installed rollout's version (the package metadata's,
    which pip wrote from pyproject.toml), then exits 0."""
    from importlib.metadata import version

    from rollout.benchmarks.cli import build_parser as bench_parser
    from rollout.eval.cli import build_parser as eval_parser
    from rollout.protocol.auth import build_keygen_parser
    from rollout.service.launch.cli import build_parser as worker_parser

    for build in (worker_parser, eval_parser, bench_parser, build_keygen_parser):
        parser = build()
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["--version"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out == f"{parser.prog} {version('rollout')}\n"
