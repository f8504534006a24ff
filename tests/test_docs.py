"""The documentation site: the generated reference tables hold every flag and field the code has (the pages' blocks
run in tests/test_docs_blocks.py). `mkdocs build --strict` (no broken link, no missing reference, no unknown generated table)
runs in CI (.ci/run) beside the suite: a dozen seconds the suite's time budget does not have."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import pytest

from rollout.config import ContinuousBatchingConfig
from rollout.eval.cli import build_parser as eval_parser
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
            (row,) = [line for line in table.splitlines() if line.startswith(f"| `{field.name}` |")]
            assert not row.endswith("|  |"), f"{field.name} has no meaning"
    assert "| `json` | <code>Any</code> | <code>None</code> | As for `regex`. |" in module.render(
        "fields", "SamplingParams"
    )
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
    # Angle brackets outside code would be taken for HTML tags and vanish; a description's list stays a list.
    assert "sized:&lt;MB&gt;" in module.render("options", "rollout-worker")
    assert "GRPOTrainer:\n\n- `rollout_colocate`:" in bench
    with pytest.raises(ValueError, match="unknown generated marker: fields Nothing"):
        module.render("fields", "Nothing")


def test_option_tables_show_the_codes_defaults_not_the_shells(monkeypatch):
    """A ROLLOUT_<FLAG> variable of the shell that builds the site (an API key) never reaches a page."""
    monkeypatch.setenv("ROLLOUT_API_KEY", "sekrit-123")
    assert "sekrit-123" not in hooks().render("options", "rollout-worker")
    assert os.environ["ROLLOUT_API_KEY"] == "sekrit-123"  # restored


def test_the_committed_tables_are_the_codes():
    """The reference pages hold their generated tables in the repository (a reader of docs/ sees every flag and
    field, not a marker), and those tables are what the code makes now."""
    module = hooks()
    pages = [path for path in sorted(DOCS.rglob("*.md")) if "<!-- generated:" in path.read_text()]
    assert {path.name for path in pages} >= {"cli.md", "config.md", "protocol.md"}
    for path in pages:
        text = path.read_text()
        assert text.count("<!-- generated:") == text.count(module.END), f"{path}: a marker without its end"
        assert module.refreshed(text) == text, (
            f"{path.relative_to(ROOT)} holds tables that differ from the code: run `python docs_tools/hooks.py`"
        )
    assert "| `--max-batch-tokens` |" in (DOCS / "reference" / "cli.md").read_text()


def test_the_architecture_page_names_every_module():
    """docs/concepts/architecture.md maps every folder of `rollout/` and `trainer_bridge/` file by file: a module
    added without its row (kept_engines.py, progress.py, route_params.py and replayed_calls.py were) goes unmapped,
    and a row whose file moved points at nothing."""
    folder, listed = None, set()
    for line in (DOCS / "concepts" / "architecture.md").read_text().splitlines():
        heading = re.match(r"^#+ `([\w/]+/)`", line)
        if heading or line.startswith("## "):
            folder = heading.group(1) if heading else None
            continue
        row = re.match(r"^\| `([\w/]+\.py)` \|", line)
        if row and folder:
            listed.add(f"{folder}{row.group(1)}")
    modules = {
        str(path.relative_to(ROOT))
        for package in ("rollout", "trainer_bridge")
        for path in (ROOT / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(modules - listed) == [], "modules the architecture page does not name"
    assert sorted(row for row in listed if not (ROOT / row).is_file()) == [], "rows naming no module"


def test_the_settings_page_names_the_engine_fields_rollout_worker_has_no_flag_for(monkeypatch):
    """docs/reference/config.md lists the `ContinuousBatchingConfig` fields a worker cannot set: exactly those its
    flags do not reach (it listed `max_model_len` after `--max-model-len` came)."""
    from rollout.service.launch import flags
    from rollout.service.launch.cli import build_parser

    set_by_flags: set[str] = set()
    monkeypatch.setattr(flags, "ContinuousBatchingConfig", lambda **fields: set_by_flags.update(fields))
    flags.engine_config(build_parser().parse_args([]))
    fields = {field.name for field in dataclasses.fields(ContinuousBatchingConfig)}
    assert set_by_flags and set_by_flags <= fields
    text = (DOCS / "reference" / "config.md").read_text()
    (sentence,) = re.findall(r"`rollout-worker` has no flag for (.*?):", text, re.S)
    assert set(re.findall(r"`(\w+)`", sentence)) == fields - set_by_flags


def test_the_settings_tables_give_the_values_of_the_constants_they_name():
    """A field's meaning that names a code constant (DEFAULT_MAX_NEW_TOKENS, MAX_LOGIT_BIAS_TOKENS) gives its value
    in the same row: a reader of the settings page cannot look the name up (the page showed names alone)."""
    from rollout import sampling_params, validation

    constants = {**vars(validation), **vars(sampling_params)}
    for cls in (SamplingParams, ContinuousBatchingConfig):
        for row in hooks().render("fields", cls.__name__).splitlines():
            for name in set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", row)) & set(constants):
                assert f"{constants[name]:g}" in row, f"{row.split('|')[1]} names {name} without its value"
