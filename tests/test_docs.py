"""The documentation site: the generated reference tables hold every flag and field the code has, and the guides'
blocks run as written. `mkdocs build --strict` (no broken link, no missing reference, no unknown generated table)
runs in CI (.ci/run) beside the suite: a dozen seconds the suite's time budget does not have."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from rollout.config import ContinuousBatchingConfig
from rollout.eval.cli import build_parser as eval_parser
from rollout.eval.cli import main as eval_main
from rollout.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
pytest.importorskip("mkdocs")


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs_tools" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_hold_every_field_and_flag():
    module = hooks()
    for cls in (SamplingParams, ContinuousBatchingConfig):
        table = module.render("fields", cls.__name__)
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in table, field.name
    table = module.render("fields", "SamplingParams")
    assert (
        "| `top_p` | <code>float</code> | <code>1.0</code> | Keep the smallest set of tokens whose probability" in table
    )
    assert "| `seed` | <code>int &#124; None</code> | <code>None</code> |" in table
    options = module.render("options", "rollout-eval")
    for action in eval_parser()._actions:
        for flag in action.option_strings:
            assert flag == "-h" or flag == "--help" or f"`{flag}`" in options, flag
    bench = module.render("options", "rollout-bench")
    assert "### `rollout-bench throughput`" in bench and "### `rollout-bench gpu-report`" in bench
    with pytest.raises(ValueError, match="unknown generated marker: fields Nothing"):
        module.render("fields", "Nothing")


def test_the_evaluation_guide_runs_as_written(tmp_path, monkeypatch, capsys, request):
    """Its Python blocks that start with `# NAME.py` are that file (written where the commands run), and each
    `rollout-eval` command runs from a checkout's root (here with the repository's examples linked)."""
    text = (DOCS / "guides" / "evaluation.md").read_text()
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    written: list[str] = []
    request.addfinalizer(lambda: [sys.modules.pop(module, None) for module in written])  # imported for this test only
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        name = re.match(r"# (\w+\.py)\n", block)
        assert name, "a guide's Python block names the file it is"
        (tmp_path / name.group(1)).write_text(block)
        written.append(name.group(1).removesuffix(".py"))
    commands = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if b.startswith("rollout-eval ")]
    assert len(commands) >= 3
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = shlex.split(command.replace("\\\n", " "))[1:]
        assert eval_main(argv) == 0, (command, capsys.readouterr().err[-2000:])
        out = capsys.readouterr().out
        assert "samples in" in out and "finish reasons:" in out
    assert len((tmp_path / "sampled.jsonl").read_text().splitlines()) == 12 * 4
