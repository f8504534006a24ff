"""Ctrl-C while `rollout-eval` or `rollout-worker` imports torch and transformers: a KeyboardInterrupt raised inside
an import left a module half-initialised, and the next import failed with an unrelated error (transformers' "Could
not import module 'AttentionInterface'" over numpy's RecursionError: a traceback, exit 1), or, inside a C++
extension's module init, aborted the process ("terminate called after throwing an instance of
'pybind11::error_already_set'", exit -6). Both seen by sending SIGINT at 0.39 s and 0.50 s into `rollout-eval`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

REPO_DATASET = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic.jsonl"


def _sigint_turned_into_another_error(*args: object) -> None:
    """What a half-done import does with a SIGINT: swallowed, and the error that follows is another one."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)  # the SIGINT handler raises here
    except KeyboardInterrupt:
        pass
    raise ModuleNotFoundError("Could not import module 'AttentionInterface'")


def test_an_interrupt_that_an_import_turned_into_another_error_is_one_line_and_status_130(monkeypatch, capsys):
    from rollout.eval import cli, session

    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(session, "evaluate", _sigint_turned_into_another_error)
    argv = ["--model", "tiny", "--dataset", str(REPO_DATASET), "--prompt-field", "question"]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == "rollout-eval: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back


def test_a_failure_without_an_interrupt_is_still_raised(monkeypatch):
    from rollout.eval import cli, session

    def fails(*args: object) -> None:
        raise ModuleNotFoundError("a real one")

    monkeypatch.setattr(session, "evaluate", fails)
    with pytest.raises(ModuleNotFoundError, match="a real one"):
        cli.main(["--model", "tiny", "--dataset", str(REPO_DATASET), "--prompt-field", "question"])


def test_a_sigint_during_the_imports_waits_for_them_to_end_then_interrupts():
    """The imports run to their end (no module left half-initialised, no C++ init meeting a Python exception)."""
    from rollout.cli.interrupts import deferring_sigint

    handler = signal.getsignal(signal.SIGINT)
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with deferring_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # an import's work, not interrupted
            steps.append("import done")
    assert steps == ["import done"]
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_sigterm_during_the_imports_is_recorded_in_the_enclosing_record():
    """rollout-eval stops on SIGTERM as on Ctrl-C, saying which came (status 143): one that arrived while torch
    imported was recorded only by the inner block, and reported as an interrupt (130)."""
    from rollout.cli.interrupts import deferring_sigint, recording_sigint

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with recording_sigint(terminate=True) as received:
            with deferring_sigint(terminate=True, into=received):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # an import's work, not interrupted
    assert received == [signal.SIGTERM]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
