"""Every Python and shell block of the README and of the documentation site runs as written, page by page in the
site's order, against one rollout-worker started with the README's own quick-start command.

- A Python block runs in its page's namespace (a page's blocks share one, in order), from a scratch directory where
  `examples/` is the repository's. A block whose first line is `# NAME.py` is that file: it is written there, not
  run (a later command imports it).
- A shell command runs if it is `curl` (its JSON answer must hold no error), `rollout-eval` (in-process; exit 0 and
  its summary) or `rollout-keygen`. `rollout-worker` and `rollout-bench` commands are parsed by their own parsers
  (every flag and value checked): running them means a second server or minutes of benchmark;
  `tests/test_benchmarks.py` runs the benchmarks small, and the fixture runs the quick start's worker.
- Everything else is in `SHOWN_NOT_RUN`, with the reason and, where another test runs the same thing, that test.
  Each entry must match a block or command of the docs, so the list cannot go stale.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout.benchmarks.cli import build_parser as bench_parser
from rollout.eval.cli import main as eval_main
from rollout.service.auth import keygen_main
from rollout.service.cli import build_parser as worker_parser
from service_helpers import Worker

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()

# The one list of what the docs show but the tests do not run. Key: text the block or command starts with (a Python
# block: a line it holds; a command: as the shell passes it on, quotes removed). Value: (why, the test or script that runs the same thing instead, or None).
SHOWN_NOT_RUN: dict[str, tuple[str, str | None]] = {
    "python3 -m venv .venv": ("the set-up: CI installs exactly so on a clean clone", ".ci/run"),
    "source .venv/bin/activate": ("the set-up", ".ci/run"),
    "pip install torch==2.13.0": ("the set-up", ".ci/run"),
    "pip install -e .[dev]": ("the set-up", ".ci/run"),
    "pip install -e .[http]": ("an install; the dev extra holds the http one", None),
    "python -m pytest -q": ("the suite itself", ".ci/run"),
    "mkdocs build --strict": ("the site's strict build", ".ci/run"),
    "python examples/grpo_toy.py": ("the main job, 45 s", "tests/test_trl.py"),
    "python examples/agent_trl.py": ("12 GRPO steps with tools, 25 s", "tests/test_trl_agentic_modes.py"),
    "fleet = RolloutFleet.launch(": ("a Ray cluster of two worker actors, 18 s", "tests/test_ray.py"),
    "ray start": ("a Ray cluster of several nodes", None),
    "python train.py": ("the user's own training script on a Ray cluster", None),
    "CUDA_VISIBLE_DEVICES=": ("needs GPUs", None),
    "echo /.whl/": ("fetching wheels for a GPU machine (needs the package index)", None),
    "python3 -m pip download": ("fetching wheels for a GPU machine (needs the package index)", None),
    "python3 -m pip install": ("installing on a GPU machine", None),
    "export PYTHONPATH": ("installing on a GPU machine", None),
}
# Commands that are parsed, not run: the command and its parser.
PARSED = {"rollout-worker": worker_parser, "rollout-bench": bench_parser}
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
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```", flags=re.S | re.M)


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
    for language, block in FENCE.findall(page.read_text()):
        items += [("python", block)] if language == "python" else [("shell", argv) for argv in shell_commands(block)]
    return items


def shown_not_run(kind: str, item: str | list[str]) -> str | None:
    """The SHOWN_NOT_RUN entry an item matches: a line a Python block holds, or the start of a command."""
    for key in SHOWN_NOT_RUN:
        if (kind == "python" and key in item) or (kind == "shell" and " ".join(item).startswith(key)):
            return key
    return None


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
    rest = [flag for i, flag in enumerate(flags) if "--bind" not in (flag, flags[i - 1])]
    process = Worker(*rest, address=address)
    yield process
    process.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    directory = tmp_path_factory.mktemp("docs")
    (directory / "examples").symlink_to(ROOT / "examples")
    return directory


def run_command(argv: list[str], capsys) -> None:
    """Run (or parse) one shell command of the docs; fail naming it."""
    command = " ".join(argv)
    while re.match(r"^\w+=", argv[0]):  # VAR=value prefixes
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
        if "--compare-with-generate" in argv:  # the tiny model in fp32: every prompt as transformers' generate
            k = argv[argv.index("--compare-with-generate") + 1]
            assert f"{k}/{k} identical" in out, out
    elif argv[0] == "rollout-keygen":
        assert keygen_main(argv[1:]) == 0, command
    elif argv[0] in PARSED:
        try:
            PARSED[argv[0]]().parse_args(argv[1:])
        except SystemExit as exit:  # --help exits 0; a bad flag or value exits 2
            assert exit.code == 0, (command, capsys.readouterr().err)
        capsys.readouterr()
    else:
        raise AssertionError(f"a docs command neither run nor listed in SHOWN_NOT_RUN: {command}")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run_as_written(page, worker, scratch, monkeypatch, capsys, request):
    monkeypatch.chdir(scratch)
    monkeypatch.syspath_prepend(str(scratch))
    namespace: dict = {"__name__": "__docs__"}
    for kind, item in page_items(page):
        if shown_not_run(kind, item):
            continue
        if kind == "shell":
            run_command(item, capsys)
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
    for key, (_, ran_by) in SHOWN_NOT_RUN.items():
        if ran_by == ".ci/run":
            assert any(set(key.split()) <= set(shlex.split(line, comments=True)) for line in CI.splitlines()), key
        elif ran_by:
            assert Path(key.split()[-1]).name in (ROOT / ran_by).read_text(), (key, ran_by)
