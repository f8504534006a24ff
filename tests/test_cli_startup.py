"""Every console script is fast and friendly (issue 49): its parser builds without torch or transformers (a proxy for
`--help` in well under a second that cannot flake: the timings themselves are measured by hand, not here), `--help`
shows every default, a typo'd flag or choice gets the closest one suggested in one error line and a hint (no usage
dump), and a bad setting names the flag that gave it, not the config field.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.cli.parser import CliParser, shows_default
from rollout.validation import FieldError

ROOT = Path(__file__).resolve().parents[1]
# Console script -> (its module, the function building its parser, how `python -m` runs it).
SCRIPTS = {
    "rollout-worker": ("rollout.service.launch.cli", "build_parser", "rollout.service.launch.cli"),
    "rollout-bench": ("rollout.benchmarks.cli", "build_parser", "rollout.benchmarks.cli"),
    "rollout-eval": ("rollout.eval.cli", "build_parser", "rollout.eval"),
    "rollout-keygen": ("rollout.protocol.auth", "build_keygen_parser", "rollout.protocol.auth"),
}
HEAVY = ("torch", "transformers")


def run_python(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def parser_of(script: str) -> CliParser:
    module, builder, _ = SCRIPTS[script]
    return getattr(importlib.import_module(module), builder)()


def every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and its subcommands' parsers."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                found += every_parser(subparser)
    return found


def test_every_console_script_is_listed_here():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(SCRIPTS)
    for script, entry in scripts.items():
        assert entry.partition(":")[0] == SCRIPTS[script][0], script


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_parser_builds_without_torch_or_transformers(script):
    """The entry point's module and its parser load nothing heavy: --help and flag errors answer at once."""
    module, builder, _ = SCRIPTS[script]
    code = f"import sys; from {module} import {builder}; {builder}(); print([m for m in {HEAVY!r} if m in sys.modules])"
    child = run_python("-c", code)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]", f"{script}'s parser loaded {child.stdout.strip()}"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_exits_0_and_shows_defaults(script):
    subcommand = ["throughput"] if script == "rollout-bench" else []  # its own --help lists the subcommands
    child = run_python("-m", SCRIPTS[script][2], *subcommand, "--help")
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith(f"usage: {' '.join([script, *subcommand])} ")
    if script != "rollout-keygen":  # two positional arguments, no defaults
        assert "(default: " in child.stdout


def test_every_flag_says_its_default():
    """Each flag taking a value shows its default, or its help says what it is (what unset means, for None)."""
    for script in SCRIPTS:
        for parser in every_parser(parser_of(script)):
            for action in parser._actions:
                if not action.option_strings or action.nargs == 0 or action.required:
                    continue
                said = shows_default(action) or "default" in (action.help or "")
                assert said, f"{parser.prog} {action.option_strings[0]}: no default shown (default {action.default!r})"


def test_defaults_are_shown_as_typed_and_only_once():
    helped = parser_of("rollout-worker").format_help()
    assert "(default: 16)" in " ".join(helped.split())  # --block-size, from the engine's own default
    assert "(default: None)" not in helped and "(default: False)" not in helped
    structured = [p for p in every_parser(parser_of("rollout-bench")) if p.prog.endswith(" structured")][0]
    assert "(default: 64 256)" in " ".join(structured.format_help().split())  # a list as it is typed


def test_an_environment_variable_default_is_the_one_shown(monkeypatch):
    monkeypatch.setenv("ROLLOUT_BLOCK_SIZE", "32")
    parser = parser_of("rollout-worker")
    assert parser.parse_args([]).block_size == 32
    assert "tokens per KV block (default: 32)" in " ".join(parser.format_help().split())


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("ROLLOUT_LOG_LEVEL", "verbose", "--log-level (choose from DEBUG, INFO, WARNING, ERROR)"),
        ("ROLLOUT_DTYPE", "fp16", "--dtype (choose from auto, float32, bfloat16, float16)"),
        ("ROLLOUT_CUDA_GRAPHS", "maybe", "--cuda-graphs (choose from auto, off, on)"),
        ("ROLLOUT_OVERLAP", "of", "--overlap (choose from auto, off, on); did you mean off?"),
    ],
)
def test_an_environment_value_outside_a_flags_choices_is_a_usage_error_naming_the_variable(
    monkeypatch, capsys, variable, value, message
):
    """A value the flag's choices do not hold was taken as the default and failed later with a traceback
    (a KeyError at start): now a usage error naming the variable, its flag and the choices."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        parser_of("rollout-worker")
    assert exited.value.code == 2
    assert f"{variable}={value!r} is not a valid value for {message}" in capsys.readouterr().err


def test_a_log_level_in_any_case_and_a_near_miss_variable_are_understood(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_LOG_LEVEL", "info")
    monkeypatch.setenv("ROLLOUT_NUM_BLOCK", "64")
    parser = parser_of("rollout-worker")
    assert (
        parser.parse_args([]).log_level == "INFO" and parser.parse_args(["--log-level", "debug"]).log_level == "DEBUG"
    )
    warned = capsys.readouterr().err
    assert "ROLLOUT_NUM_BLOCK is set but no flag reads it; did you mean ROLLOUT_NUM_BLOCKS?" in warned


def test_a_typod_flag_suggests_the_closest_without_a_usage_dump():
    child = run_python("-m", "rollout.service.launch.cli", "--num-blcoks", "3")
    assert child.returncode == 2
    lines = child.stderr.splitlines()
    assert lines == [
        "rollout-worker: error: unrecognized argument --num-blcoks; did you mean --num-blocks?",
        "Try 'rollout-worker --help' for every flag and its default.",
    ]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (
            "rollout-bench",
            ["throughput", "--workloda", "x"],
            "unrecognized argument --workloda; did you mean --workload?",
        ),
        ("rollout-bench", ["throughtput"], "did you mean throughput?"),
        ("rollout-bench", ["throughput", "--workload", "cpu-smal"], "did you mean cpu-small?"),
        (
            "rollout-eval",
            ["--model", "tiny", "--dataset", "d.jsonl", "--temprature", "1"],
            "did you mean --temperature?",
        ),
        ("rollout-eval", [], "the following arguments are required: --model, --dataset"),
        (  # a mistyped required flag: reported missing, and the typo's closest flag suggested
            "rollout-eval",
            ["--modle", "tiny", "--dataset", "d.jsonl"],
            "the following arguments are required: --model; did you mean --model (for --modle)?",
        ),
        ("rollout-keygen", ["dir"], "the following arguments are required: name"),
        ("rollout-worker", ["--dtype", "flaot32"], "did you mean float32?"),
        ("rollout-worker", ["--bnd", "x", "--mdoel", "m"], "--bind (for --bnd), --model (for --mdoel)?"),
        (  # vLLM's and SGLang's flags: what to use instead, not the closest spelling (--lora)
            "rollout-worker",
            ["--port", "5555"],
            "--port; did you mean --bind tcp://127.0.0.1:PORT (ZeroMQ clients) or --http 127.0.0.1:PORT",
        ),
        ("rollout-worker", ["--gpu-memory-utilization", "0.9"], "did you mean --max-memory-percent"),
    ],
)
def test_flag_errors_are_one_line_and_a_hint(script, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parser_of(script).parse_args(argv)
    assert stop.value.code == 2
    error, hint = capsys.readouterr().err.splitlines()
    prog = error.partition(": error: ")[0]
    assert error.startswith(f"{script}") and message in error
    assert hint == f"Try '{prog} --help' for every flag and its default."


@pytest.mark.parametrize("value, fraction", [("90", 0.9), ("100", 1.0), ("2.5", 0.025)])
def test_max_memory_percent_takes_a_percent(value, fraction):
    from rollout.service.launch.flags import engine_config

    args = parser_of("rollout-worker").parse_args(["--max-memory-percent", value])
    assert engine_config(args).max_memory_percent == pytest.approx(fraction)
    assert engine_config(parser_of("rollout-worker").parse_args([])).max_memory_percent is None  # the engine's


@pytest.mark.parametrize("value", ["0", "150", "-5", "nan", "ninety"])
def test_a_bad_max_memory_percent_names_the_flag(value, capsys):
    from rollout.service.launch import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["--max-memory-percent", value])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("rollout-worker: error: argument --max-memory-percent: ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-blocks", "0"], "rollout-worker: error: --num-blocks: 0 is invalid: must be an integer >= 1"),
        (["--client-timeout", "-1"], "rollout-worker: error: --client-timeout: must be positive, got -1.0"),
        (
            ["--max-update-phase-s", "nan"],
            "rollout-worker: error: --max-update-phase-s: must be a finite number, got nan",
        ),
        (["--client-timeout", "inf"], "rollout-worker: error: --client-timeout: must be a finite number, got inf"),
        (  # past a C long: a traceback from ZeroMQ's setsockopt once the model had loaded
            ["--max-message-bytes", str(2**63)],
            "rollout-worker: error: --max-message-bytes: must be at most 4611686018427387904",
        ),
        (  # past a C long: every structured output was refused ("ended its compile process")
            ["--max-compile-bytes", str(2**64 - 1)],
            "rollout-worker: error: --max-compile-bytes: must be at most 4611686018427387904",
        ),
        (  # past a thread's wait: every structured output failed ("internal: OverflowError"), and the shutdown too
            ["--max-compile-s", "1e300"],
            "rollout-worker: error: --max-compile-s: must be at most 10000000 seconds",
        ),
        (["--max-groups-per-client", "-1"], "rollout-worker: error: --max-groups-per-client: must be 0 (no limit) or"),
        (["--max-batch-tokens", "0"], "rollout-worker: error: --max-batch-tokens: 0 is invalid"),
        (  # the percent sized nothing: --num-blocks did, and the flag was ignored without a word
            ["--num-blocks", "100", "--max-memory-percent", "50"],
            "rollout-worker: error: --max-memory-percent 50: has no effect with --num-blocks 100",
        ),
        (  # sized the engine's per-token buffers: an overflow traceback once the model had loaded
            ["--max-batch-tokens", str(10**20)],
            "rollout-worker: error: --max-batch-tokens: 100000000000000000000 is invalid: must be an integer in [1,",
        ),
        (  # an allocation of 80 GB: a traceback once the model had loaded
            ["--max-num-seqs", str(10**10)],
            "rollout-worker: error: --max-num-seqs: 10000000000 is invalid: must be an integer in [1, 16777216]",
        ),
        (["--model", "./no/such/dir"], "rollout-worker: error: --model ./no/such/dir: no such model directory"),
        (  # a speculative setting without speculation would be ignored: refused, naming both flags
            ["--num-speculative-tokens", "3"],
            "rollout-worker: error: --num-speculative-tokens: has no effect without speculative (--speculative suffix",
        ),
        (
            ["--speculative-clear-on-weight-update"],
            "rollout-worker: error: --speculative-clear-on-weight-update: has no",
        ),
        (  # typed at the engine's own value: still no effect without speculation, still refused
            ["--num-speculative-tokens", "4"],
            "rollout-worker: error: --num-speculative-tokens: has no effect without speculative",
        ),
        (  # these came after torch and transformers loaded (5 s on 2 cores)
            ["--http", "127.0.0.1:0", "--http-max-body-bytes", "10"],
            "rollout-worker: error: --http-max-body-bytes 10: must be at least 1024",
        ),
        (["--http", "abc"], "rollout-worker: error: --http abc: expected HOST:PORT"),
        (["--lora", "x=/no/such/adapter"], "rollout-worker: error: --lora x=/no/such/adapter: no such directory"),
        (  # a relative path (no hub id: org/name): after the model loaded, peft's hub retries, then an error
            ["--lora", "x=adapters/math/v1"],
            "rollout-worker: error: --lora x=adapters/math/v1: no such directory",
        ),
        (["--lora", "tiny=/x"], "rollout-worker: error: --lora tiny=/x: 'tiny' is the served model's name"),
        (["--cuda-graphs", "on"], "rollout-worker: error: --cuda-graphs on: CUDA graphs need a CUDA device"),
    ],
)
def test_a_bad_setting_names_its_flag_before_anything_loads(argv, message, capsys):
    """The settings are checked in cli.main before startup (torch, the engine) is imported."""
    code = (
        "import sys\nfrom rollout.service.launch import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as stop:\n"
        f"    print(stop.code, [m for m in {HEAVY!r} if m in sys.modules])"
    )
    child = run_python("-c", code, *argv)
    assert child.stdout.strip() == "2 []", child.stderr
    assert child.stderr.splitlines()[0].startswith(message)


def test_a_field_error_names_flags_in_its_reason_too():
    parser = parser_of("rollout-worker")
    error = FieldError("max_memory_percent", "holds no KV block; raise max_memory_percent or set num_blocks")
    assert parser.flag_message(error) == (
        "--max-memory-percent: holds no KV block; raise --max-memory-percent or set --num-blocks"
    )
    assert parser.flag_message(FieldError("scheduler_type", "x")) == "--scheduler: x"  # the explicit map
    assert parser.flag_message(FieldError("no_such_field", "x")) == "no_such_field: x"  # no flag: the field
    assert parser.flag_message(ValueError("plain")) == "plain"


def test_a_subcommands_bad_combination_points_at_its_own_help(capsys):
    """A flag value refused after parsing (`rollout-bench throughput --time-budget -1`) is the subcommand's usage
    error: one line, and the subcommand's `--help` to read."""
    from rollout.benchmarks import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["throughput", "--time-budget", "-1"])
    assert stop.value.code == 2
    error, hint = capsys.readouterr().err.splitlines()[-2:]
    assert error == "rollout-bench throughput: error: --time-budget must be a number > 0, got -1.0"
    assert hint == "Try 'rollout-bench throughput --help' for every flag and its default."


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora", "a=/no/such/adapter"], "--lora a=/no/such/adapter: no such directory"),  # before any cache
        (["--model", "sized:abc"], "--model sized:abc: expected sized:<megabytes>, e.g. sized:512"),  # said once
        # A traceback (OverflowError), and a worker built until the out-of-memory killer ended it, unsaid:
        (["--model", "sized:inf"], "--model sized:inf: megabytes must be a finite number > 0, got inf"),
        (["--model", "sized:1e12"], "--model sized:1e12: 1e+12 MB of weights is more than the "),
    ],
)
def test_worker_settings_that_cannot_work_are_one_line_naming_the_flag_once(argv, message):
    # Any free port: the default 5555 may be held by the docs' examples running beside this file (its check comes first)
    child = run_python("-m", "rollout.service.launch.cli", "--device", "cpu", "--bind", "tcp://127.0.0.1:*", *argv)
    assert child.returncode == 2
    first = child.stderr.splitlines()[0]
    assert first.startswith(f"rollout-worker: error: {message}"), first
    if "--lora" in argv:
        assert first.endswith(" (a PEFT adapter's, as save_pretrained writes it)")
    if "sized:1e12" in argv:
        assert first.endswith(" MB available on cpu"), first


def test_a_batch_config_pair_without_a_value_names_the_pair():
    from rollout.cli.batch_config_flags import batch_config_from_pairs

    with pytest.raises(FieldError, match="^num_blocks: expected KEY=VALUE, e.g. num_blocks=512$"):
        batch_config_from_pairs(["num_blocks"])


def test_a_flag_of_several_values_reads_them_from_its_variable_as_a_shell_splits_words(monkeypatch, capsys, tmp_path):
    """ROLLOUT_CONTROL_ALLOWED_DIRS=/some/dir was walked character by character ('--control-allowed-dirs t: no such
    directory'); a repeatable flag's variable (ROLLOUT_LORA) too. Now words, quoted as in a shell; the command line's
    values, when given, replace the variable's."""
    spaced = tmp_path / "a dir"
    spaced.mkdir()
    monkeypatch.setenv("ROLLOUT_CONTROL_ALLOWED_DIRS", f"{tmp_path} '{spaced}'")
    monkeypatch.setenv("ROLLOUT_LORA", "first=/p second=/q")
    parser = parser_of("rollout-worker")
    parsed = parser.parse_args([])
    assert parsed.control_allowed_dirs == [str(tmp_path), str(spaced)]
    assert parsed.lora == ["first=/p", "second=/q"]
    assert parser.parse_args(["--lora", "third=/r"]).lora == ["third=/r"]
    assert parser.parse_args(["--control-allowed-dirs", "/x"]).control_allowed_dirs == ["/x"]
    monkeypatch.setenv("ROLLOUT_LORA", "unclosed='/p")
    with pytest.raises(SystemExit):
        parser_of("rollout-worker")
    assert 'ROLLOUT_LORA="unclosed=\'/p": No closing quotation' in capsys.readouterr().err
