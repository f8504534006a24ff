"""Every Python and shell block of the README and of the documentation site runs as written, page by page in the
site's order, against one rollout-worker started with the flags of the README's quick-start command (through
`service_helpers.Worker`, with the test's log level; `rollout-worker` is that module's console script).

- A Python block runs in its page's namespace (a page's blocks share one, in order), from a scratch directory where
  `examples/` is the repository's. A block whose first line is `# NAME.py` is that file: it is written there, not
  run (a later command imports it). A later page may find the worker changed by an earlier one (pushed weights).
- A shell command runs if it is `curl` (its JSON answer must hold no error), `rollout-eval` (in-process; exit 0 and
  its summary) or `rollout-keygen`. `rollout-worker` commands are parsed and put through every check the worker
  makes before it loads a model (addresses, keys, limits, engine settings; a port is not probed, since the fixture
  holds the docs' ports); `rollout-bench` commands are parsed (running them takes minutes;
  `tests/test_benchmarks.py` runs the benchmarks small).
- Everything else is in `SHOWN_NOT_RUN`, the one list of what is shown but not run, with the reason and, where
  another test runs the same thing, that test. A command matches an entry only exactly, a Python block only by a
  whole line of it, and each entry must match something the docs show, so the list cannot go stale.
- A fenced block in any other language than python, bash and text fails the test: it would go unchecked.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from rollout.benchmarks.cli import build_parser as bench_parser
from rollout.eval.cli import build_parser as eval_parser
from rollout.eval.cli import main as eval_main
from rollout.protocol.auth import build_keygen_parser, keygen_main
from rollout.service import address_checks
from rollout.service.launch.cli import build_parser as worker_parser
from rollout.service.launch.startup import check_flags
from service_helpers import Worker

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()

# What the docs show but the tests do not run. Key: a command exactly as the shell passes it on (quotes removed), or a
# whole line of a Python block. Value: (why; the test or script that runs the same thing instead, or None; what that
# file must mention to be running it).
SHOWN_NOT_RUN: dict[str, tuple[str, str | None, str | None]] = {
    "python3 -m venv .venv": ("the set-up: CI installs exactly so on a clean clone", ".ci/run", None),
    "source .venv/bin/activate": ("the set-up", ".ci/run", None),
    "pip install torch==2.13.0": ("the set-up", ".ci/run", None),
    "pip install -e .[dev]": ("the set-up", ".ci/run", None),
    "pip install -e .[http]": ("an install; the dev extra holds the http one", None, None),
    "python -m pytest -q -n 2 --dist loadfile": ("the suite itself", ".ci/run", None),
    "mkdocs build --strict": ("the site's strict build", ".ci/run", None),
    "python examples/grpo_toy.py": ("the main job, 45 s", "tests/test_trl.py", "grpo_toy.py"),
    "python examples/grpo_toy.py --bf16 --batch-invariant --steps 3": (
        "the main job in bf16, bit for bit; its colocated run is tested",
        "tests/test_trl_batch_invariant.py",
        "--batch-invariant",
    ),
    "python examples/agent_trl.py": (
        "12 GRPO steps with tools, 25 s",
        "tests/test_trl_agentic_modes.py",
        "agent_trl.py",
    ),
    "fleet = RolloutFleet.launch(": (
        "a Ray cluster of two worker actors, 18 s",
        "tests/test_ray.py",
        "RolloutFleet.launch(",
    ),
    'with httpx.Client(base_url="http://127.0.0.1:8000", headers=OPERATOR, timeout=600) as http:': (
        "needs a worker with --enable-control-routes and a checkpoint directory",
        "tests/test_http_orchestration.py",
        "/update_weights",
    ),
    "ray start --head --port 6379": ("a Ray cluster of several nodes", None, None),
    "ray start --address HEAD_IP:6379": ("a Ray cluster of several nodes", None, None),
    "python train.py": ("the user's own training script on a Ray cluster", None, None),
    "rollout-worker --gpu 0 --model Qwen/Qwen3-0.6B --dtype bfloat16": ("needs a GPU and the hub", None, None),
    "rollout-worker --gpu 0 --model Qwen/Qwen3-0.6B --dtype bfloat16 --bind tcp://127.0.0.1:5555 &": (
        "needs a GPU and the hub",
        None,
        None,
    ),
    "CUDA_VISIBLE_DEVICES=1 python examples/grpo_gpu.py --model Qwen/Qwen3-0.6B --workers tcp://127.0.0.1:5555": (
        "needs GPUs and the hub",
        None,
        None,
    ),
    "echo /.whl/ >> .git/info/exclude": ("preparing wheels for a GPU machine", None, None),
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform "
    "manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform "
    "manylinux2014_x86_64 -d .whl pyzmq==27.3.0 trl==1.16.0 datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19 "
    "xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 "
    "typing-inspection==0.4.5": (
        "fetching wheels for a GPU machine (needs the package index)",
        None,
        None,
    ),
    "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl": ("on a GPU machine", None, None),
    "export PYTHONPATH=$PWD:/tmp/site": ("on a GPU machine", None, None),
}
# Commands that are parsed, not run: the command and its parser.
PARSED = {"rollout-worker": worker_parser, "rollout-bench": bench_parser}
INLINE_PARSERS = {**PARSED, "rollout-eval": eval_parser, "rollout-keygen": build_keygen_parser}
ALIASES = {
    ("python3", "-m", "rollout.benchmarks.cli"): "rollout-bench",
    ("python", "-m", "rollout.eval"): "rollout-eval",
}


def pages() -> list[Path]:
    """The README, then every page of the site in its navigation's order."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def walk(entries: list) -> list[str]:
        found = []
        for entry in entries:
            for value in entry.values():
                found += walk(value) if isinstance(value, list) else [value]
        return found

    return [ROOT / "README.md", *(ROOT / "docs" / page for page in walk(nav))]


PAGES = pages()
# Any fenced block, indented or not (inside a list item), with ``` or ~~~ and any info string after the language.
FENCE = re.compile(r"^[ \t]*(```|~~~)[ \t]*([\w-]*)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", flags=re.S | re.M)
CHECKED_LANGUAGES = {"python", "bash"}
SHOWN_LANGUAGES = {"text", ""}  # output and diagrams


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a shell block, as argument lists: continued lines joined, comments dropped, `&&` and `;`
    split (a trailing `&` stays: it marks a server started in the background)."""
    commands: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        command: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word not in ("&&", ";"):
                command.append(word)
            elif command:
                commands.append(command)
                command = []
    return commands


def page_items(page: Path) -> list[tuple[str, str | list[str]]]:
    """A page's runnable items in order: ("python", block) and ("shell", argv)."""
    items: list[tuple[str, str | list[str]]] = []
    for _, language, block in FENCE.findall(page.read_text()):
        assert language in CHECKED_LANGUAGES | SHOWN_LANGUAGES, f"{page}: a ```{language} block would go unchecked"
        if language == "python":
            items.append(("python", textwrap.dedent(block)))
        elif language == "bash":
            items += [("shell", argv) for argv in shell_commands(textwrap.dedent(block))]
    return items


def shown_not_run(kind: str, item: str | list[str]) -> str | None:
    """The SHOWN_NOT_RUN entry an item matches: a whole line of a Python block, or a whole command."""
    keys = [line.strip() for line in item.splitlines()] if kind == "python" else [" ".join(item)]
    return next((key for key in keys if key in SHOWN_NOT_RUN), None)


def quick_start_worker() -> list[str]:
    """The README's quick-start `rollout-worker` command, started in the background (the fixture runs exactly it)."""
    workers = [
        argv
        for kind, argv in page_items(ROOT / "README.md")
        if kind == "shell" and argv[0] == "rollout-worker" and argv[-1] == "&"
    ]
    assert len(workers) == 1, workers
    return workers[0][1:-1]


@pytest.fixture(scope="module")
def worker():
    flags = quick_start_worker()
    address = flags[flags.index("--bind") + 1]
    http = flags[flags.index("--http") + 1]
    for host, port in (address.removeprefix("tcp://").rsplit(":", 1), http.rsplit(":", 1)):
        with socket.socket() as probe:  # a worker already there (a reader's quick start) would answer in its place
            if probe.connect_ex((host, int(port))) == 0:
                pytest.fail(f"{host}:{port} is taken (a rollout-worker from the quick start?): stop it, then rerun")
    rest = [flag for i, flag in enumerate(flags) if "--bind" not in (flag, flags[i - 1])]
    process = Worker(*rest, address=address)
    assert process.process.poll() is None, "the docs' worker exited: " + process.output()[-2000:]
    yield process
    process.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    directory = tmp_path_factory.mktemp("docs")
    (directory / "examples").symlink_to(ROOT / "examples")
    return directory


def run_command(argv: list[str], capsys, monkeypatch) -> None:
    """Run (or parse) one shell command of the docs, under its `VAR=value` prefixes; fail naming it."""
    command = " ".join(argv)
    while re.match(r"^\w+=", argv[0]):
        name, _, value = argv[0].partition("=")
        monkeypatch.setenv(name, value)
        argv = argv[1:]
    argv = argv[:-1] if argv[-1] == "&" else argv
    for prefix, name in ALIASES.items():
        if tuple(argv[: len(prefix)]) == prefix:
            argv = [name, *argv[len(prefix) :]]
    if argv[0] == "curl":
        answer = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
        body = json.loads(answer.stdout)
        assert "error" not in body and body["choices"], (command, body)
    elif argv[0] == "rollout-eval":
        assert eval_main(argv[1:]) == 0, (command, capsys.readouterr().err[-2000:])
        out = capsys.readouterr().out
        assert "samples in" in out and "finish reasons:" in out, out
        if "--answer-field" in argv:
            assert re.search(r"^accuracy \(.+\): \d\.\d{4} \(\d+/\d+; 95% interval", out, flags=re.M), out
        if "--compare-with-generate" in argv:  # the tiny model in fp32: every prompt as transformers' generate
            k = argv[argv.index("--compare-with-generate") + 1]
            assert f"{k}/{k} identical" in out, out
    elif argv[0] == "rollout-keygen":
        assert keygen_main(argv[1:]) == 0, command
    elif argv[0] in PARSED:
        parser = PARSED[argv[0]]()
        try:
            args = parser.parse_args(argv[1:])
            if argv[0] == "rollout-worker":
                check_flags(parser, args)
        except SystemExit as exit:  # --help exits 0; a bad flag or value exits 2
            assert exit.code == 0, (command, capsys.readouterr().err)
        capsys.readouterr()
    else:
        raise AssertionError(f"a docs command neither run nor listed in SHOWN_NOT_RUN: {command}")


class UnprobedPort:
    """Stands in for the probe socket of the worker's port check: the docs' ports are the fixture's own."""

    def __init__(self, *args) -> None:
        pass

    def setsockopt(self, *args) -> None:
        pass

    def bind(self, address: tuple) -> None:
        pass

    def close(self) -> None:
        pass


UNPROBED_SOCKET_MODULE = types.SimpleNamespace(
    socket=UnprobedPort,
    AF_INET=socket.AF_INET,
    AF_INET6=socket.AF_INET6,
    SOL_SOCKET=socket.SOL_SOCKET,
    SO_REUSEADDR=socket.SO_REUSEADDR,
)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run_as_written(page, worker, scratch, monkeypatch, capsys, request):
    # The worker's port probe, in address_checks alone, binds nothing: the fixture holds the docs' ports.
    monkeypatch.setattr(address_checks, "socket", UNPROBED_SOCKET_MODULE)
    monkeypatch.chdir(scratch)
    monkeypatch.syspath_prepend(str(scratch))
    namespace: dict = {"__name__": "__docs__"}
    for kind, item in page_items(page):
        if shown_not_run(kind, item):
            continue
        if kind == "shell":
            run_command(item, capsys, monkeypatch)
        elif name := re.match(r"# (\w+)\.py\n", item):  # a file the page's commands use
            module = name.group(1)
            (scratch / f"{module}.py").write_text(item)
            request.addfinalizer(lambda module=module: sys.modules.pop(module, None))
        else:
            exec(compile(item, str(page), "exec"), namespace)  # noqa: S102 - our own docs


def test_every_shown_not_run_entry_is_shown_and_run_elsewhere():
    """Each entry matches a block or command of the docs, and the test or script it names runs the same."""
    matched = {shown_not_run(kind, item) for page in PAGES for kind, item in page_items(page)}
    assert not set(SHOWN_NOT_RUN) - matched, f"entries no page shows: {set(SHOWN_NOT_RUN) - matched}"
    for key, (_, ran_by, mention) in SHOWN_NOT_RUN.items():
        if ran_by == ".ci/run":
            assert any(set(key.split()) <= set(shlex.split(line, comments=True)) for line in CI.splitlines()), key
        elif ran_by:
            assert mention in (ROOT / ran_by).read_text(), (key, ran_by, mention)


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of a parser and of its subcommands."""
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                flags |= parser_flags(subparser)
    return flags


def test_commands_in_prose_name_real_flags():
    """An inline `rollout-worker --flag ...` (or rollout-bench, rollout-eval, rollout-keygen) in any page's prose
    names flags its command has: prose drifts as easily as a block."""
    known = {command: parser_flags(build()) for command, build in INLINE_PARSERS.items()}
    checked = 0
    for page in PAGES:
        prose = re.sub(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", "", page.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", prose):
            words = span.split()
            if len(words) > 1 and words[0] in known:
                flags = {word.split("=")[0] for word in words[1:] if word.startswith("--") and "..." not in word}
                assert flags <= known[words[0]], f"{page.relative_to(ROOT)}: `{span}` names {flags - known[words[0]]}"
                checked += 1
    assert checked > 40, checked  # the docs mention commands in prose often; a parse that finds none is broken
