"""The README's Python examples run as written (against a real rollout-worker on the README's address)."""

from __future__ import annotations

import re
from pathlib import Path

from service_helpers import Worker

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    """Every ```python block of the README executes without error (they share one namespace, in order)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README should show runnable Python usage"
    worker = Worker(address="tcp://127.0.0.1:5555")
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    finally:
        worker.close()
