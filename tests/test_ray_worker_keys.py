"""A fleet worker's CurveZMQ key files lie on disk (a private directory of the node's temp dir) only while the worker
reads them, not while it imports torch and transformers: the actor wrote them first, so an actor killed in its
imports (a launch's ready_timeout, a restart's kill, Ctrl-C) left the fleet's secret keys behind for seconds of each
start. Reference: the node's temp directory itself, watched from the driver while a worker starts."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from rollout.ray import RolloutFleet  # noqa: E402

CPU_WORKER = ["--device", "cpu", "--num-blocks", "64", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def node_tmp():
    """A Ray cluster whose processes use a temp directory of their own (other processes' key directories stay out)."""
    directory = tempfile.mkdtemp(prefix="rk-", dir="/tmp")  # short: Ray's socket paths go under it
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = directory
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
        yield directory
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        shutil.rmtree(directory, ignore_errors=True)


def test_key_files_lie_on_disk_only_while_the_worker_reads_them(node_tmp):
    seen: dict[str, list[float]] = {}  # key directory -> [first seen, last seen]
    modes: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for name in os.listdir(node_tmp):
                if name.startswith("rollout-worker-keys-"):
                    now = time.monotonic()
                    seen.setdefault(name, [now, now])[1] = now
                    try:
                        modes.add(stat.S_IMODE(os.stat(os.path.join(node_tmp, name)).st_mode))
                    except FileNotFoundError:
                        pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        fleet = RolloutFleet.launch(1, resources_per_worker={"CPU": 1}, worker_args=CPU_WORKER, ready_timeout=120)
        fleet.shutdown()
    finally:
        done.set()
        watcher.join()
    assert not [n for n in os.listdir(node_tmp) if n.startswith("rollout-worker-keys-")], "key files left behind"
    lifetimes = {name: last - first for name, (first, last) in seen.items()}
    # Imports take seconds here; parsing the flags and reading two small files take milliseconds.
    assert all(seconds < 1.0 for seconds in lifetimes.values()), lifetimes
    assert modes <= {0o700}, [oct(mode) for mode in modes]  # readable by the worker's user only while there
