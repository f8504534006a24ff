"""The workers' resident memory: `rss_bytes` of a process, and `RssSampler` (start, peak and last, sampled in a
thread)."""

from __future__ import annotations

import threading


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (psutil when installed, else /proc/<pid>/status VmRSS)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples the RSS of some processes every `period_s` in a thread: start (first sample), peak, last."""

    def __init__(self, pids: list[int], period_s: float = 0.2):
        self.pids = pids
        self.period_s = period_s
        self.first: dict[int, int | None] = {pid: rss_bytes(pid) for pid in pids}
        self.peak: dict[int, int] = {pid: v or 0 for pid, v in self.first.items()}
        self.last: dict[int, int | None] = dict(self.first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        for pid in self.pids:
            value = rss_bytes(pid)
            self.last[pid] = value
            if value is not None:
                self.peak[pid] = max(self.peak[pid], value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
