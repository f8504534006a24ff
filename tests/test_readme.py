"""The README's Python and curl examples run as written (against a real rollout-worker on the README's addresses)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from service_helpers import Worker

README = Path(__file__).resolve().parents[1] / "README.md"
# The blocks shown but not run here, each found by a line it holds, with the reason and the test that runs the same
# calls instead. One place lists them all; each must match exactly one block.
SHOWN_NOT_RUN = {
    "fleet = RolloutFleet.launch(": "a Ray cluster of two worker actors (18 s): tests/test_ray.py launches, pushes to, "
    "generates through and shuts down the same kind of fleet",
}


def test_readme_python_blocks_run():
    """Every ```python block of the README executes without error (they share one namespace, in order), and every
    curl command answers a JSON body without an error."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README should show runnable Python usage"
    for line in SHOWN_NOT_RUN:
        assert sum(line in block for block in blocks) == 1, f"SHOWN_NOT_RUN names no single block: {line}"
    blocks = [block for block in blocks if not any(line in block for line in SHOWN_NOT_RUN)]
    curls = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if b.startswith("curl ")]
    assert curls, "the README should show the HTTP API with curl"
    worker = Worker("--http", "127.0.0.1:8000", address="tcp://127.0.0.1:5555")
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
        for command in curls:
            answer = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True)
            body = json.loads(answer.stdout)
            assert "error" not in body and body["choices"], body
    finally:
        worker.close()
