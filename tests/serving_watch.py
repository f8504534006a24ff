"""`ServingWatch`: the other clients of a worker under attack, in a process of their own (so the attacker's own work
in the test process never delays them): /health probed every 20 ms, and a ZeroMQ trainer streaming a 1,500-token
group. What they saw (the slowest probe, the longest pause of the stream) and the worker's peak RSS are checked
against thresholds."""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

STREAMED_GROUP = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 1500}


def watch_main(url: str, address: str, connection: Connection) -> None:
    """The watching process: probe and stream until told to stop, then send back what was seen."""
    import httpx2 as httpx

    from trainer_bridge import PromptGroup, RolloutClient

    stop = threading.Event()
    seen: dict[str, Any] = {"probes": [], "gaps": [], "errors": []}

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                start = time.monotonic()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as error:
                    seen["errors"].append(f"/health failed: {error!r}")
                    continue
                finally:
                    seen["probes"].append(time.monotonic() - start)
                if status != 200:
                    seen["errors"].append(f"/health answered {status}")
                time.sleep(0.02)

    def stream() -> None:
        with RolloutClient(address, timeout=60) as client:
            last = None
            for _ in client.stream(PromptGroup([3, 1, 4, 1, 5], n=1, sampling=STREAMED_GROUP)):
                now = time.monotonic()
                if last is not None:
                    seen["gaps"].append(now - last)
                last = now
                if stop.is_set():
                    return  # leaving the stream cancels the group

    threads = [threading.Thread(target=run, daemon=True) for run in (probe, stream)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while (len(seen["gaps"]) < 5 or len(seen["probes"]) < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        connection.send("ready")
        connection.recv()  # stop
    except (EOFError, OSError):  # the test process left without stopping it
        stop.set()
        return
    stop.set()
    for thread in threads:
        thread.join(60)
    connection.send(seen)


def rss_mb(pid: int) -> float:
    """A process's resident memory, in MB."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) / 1024


class ServingWatch:
    """Other clients served while an attack runs, and the worker's peak RSS meanwhile."""

    def __init__(self, url: str, address: str, pid: int):
        """
        Args:
            url: the worker's HTTP base URL.
            address: its ZeroMQ address.
            pid: its process id (its RSS is sampled every 20 ms).
        """
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=watch_main, args=(url, address, child), daemon=True)
        self._process.start()
        self._pid = pid
        self.before_mb = self.peak_mb = rss_mb(pid)
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        assert self._connection.poll(90), "the watching clients did not start"
        assert self._connection.recv() == "ready"
        self.seen: dict[str, Any] | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, rss_mb(self._pid))
            time.sleep(0.02)

    def stop(self) -> dict[str, Any]:
        """Stop watching (the stream's group is cancelled); what the clients saw."""
        if self.seen is None:
            self._stop.set()
            self._sampler.join(10)
            self._connection.send("stop")
            assert self._connection.poll(90), "the watching clients did not stop"
            self.seen = self._connection.recv()
            self._process.join(30)
        return self.seen

    def check(self, most_stall_s: float = 1.0, most_growth_mb: float = 300.0, most_pause_s: float = 1.0) -> None:
        """Stop watching; assert the thresholds: no /health probe waited `most_stall_s` or more, the stream never
        paused `most_pause_s` or more, and the worker's RSS grew less than `most_growth_mb`."""
        seen = self.stop()
        assert not seen["errors"], seen["errors"][:5]
        assert len(seen["gaps"]) >= 5 and len(seen["probes"]) >= 3, "the watching clients did not run"
        assert max(seen["probes"]) < most_stall_s, f"/health waited {max(seen['probes']):.2f} s"
        assert max(seen["gaps"]) < most_pause_s, f"the trainer's stream paused {max(seen['gaps']):.2f} s"
        growth = self.peak_mb - self.before_mb
        assert growth < most_growth_mb, f"the worker's RSS grew {growth:.0f} MB"


@contextlib.contextmanager
def watches(worker: Any) -> Iterator[Callable[[], ServingWatch]]:
    """Yields a function that starts watching `worker`'s other clients (a `ServingWatch`); every watch started is
    stopped at exit, even after a failed test (a watch left running would keep its trainer's group in flight for the
    tests after). `worker`: a `service_helpers.Worker` serving HTTP (its `url`)."""
    started: list[ServingWatch] = []

    def start() -> ServingWatch:
        started.append(ServingWatch(worker.url, worker.address, worker.process.pid))
        return started[-1]

    try:
        yield start
    finally:
        for each in started:
            each.stop()
