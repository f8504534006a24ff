"""rollout's optional extras (pyproject's `[project.optional-dependencies]`): the modules each one brings, and the
one-line error that names the pip command when a feature's extra is not installed.

    require_extra("http", "--http 127.0.0.1:8000")
    # MissingExtra: --http 127.0.0.1:8000 needs fastapi, which is not installed: pip install 'rollout[http]'

Checks look modules up without importing them (cheap, before anything loads). Imports nothing of rollout.
"""

from __future__ import annotations

import importlib.util

# The importable modules of each extra that rollout's features check for, as its requirements name them
# (tests/test_newcomer_errors.py checks this against pyproject.toml).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "http": ("fastapi", "uvicorn", "orjson"),
    "ray": ("ray",),
    "lora": ("peft",),
    "structured": ("xgrammar",),
    "examples": ("matplotlib",),
    "docs": ("matplotlib",),  # `rollout-bench ... --plot`: the site's plots
}


class MissingExtra(ImportError):
    """A feature's optional extra is not installed; the message is one line naming the pip command."""


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (a module mapped to None in `sys.modules` counts as
    missing, as `import` treats it, and so does a bare folder of that name, such as one `pip uninstall` left behind:
    it would import as an empty namespace package)."""
    missing = []
    for name in EXTRA_MODULES[extra]:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a parent package missing, or a module without a spec
            spec = None
        if spec is None or (spec.origin is None and spec.submodule_search_locations is not None):
            missing.append(name)
    return missing


def require_extra(extra: str, feature: str) -> None:
    """Raise unless every module of `extra` is installed.

    Args:
        extra: the extra's name in pyproject.toml (a key of `EXTRA_MODULES`), e.g. "http".
        feature: what needs it, as the user asked for it, e.g. "--http 127.0.0.1:8000" or "rollout.ray".
    Raises:
        MissingExtra: "<feature> needs <modules>, which is/are not installed: pip install 'rollout[<extra>]'".
    """
    missing = missing_modules(extra)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtra(
            f"{feature} needs {' and '.join(missing)}, which {verb} not installed: pip install 'rollout[{extra}]'"
        )
