"""A console script's process ends at once when its command is done (`rollout.cli.process_exit`), and still does what
the interpreter's exit does that anyone can see: its other threads finish, its exit hooks run, its output is flushed,
and its status is the command's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from rollout.cli.process_exit import run_console_script

    def main(argv):
        def late_write():
            time.sleep(0.3)
            with open(argv[0], "w") as file:
                file.write("written")

        threading.Thread(target=late_write).start()  # not a daemon: the exit waits for it
        atexit.register(lambda: print("exit hook ran"))
        sys.stdout.write("unflushed output")  # no newline: held in the buffer
        outcome = argv[1]
        if outcome == "usage":
            raise SystemExit("prog: error: a usage error")
        if outcome == "sys.exit(None)":
            sys.exit()
        return int(outcome)

    run_console_script(main, sys.argv[1:])
    print("never printed: the process ended")
    """
)


@pytest.mark.parametrize(
    "outcome, status, stderr",
    [("0", 0, ""), ("3", 3, ""), ("usage", 1, "prog: error: a usage error\n"), ("sys.exit(None)", 0, "")],
)
def test_the_process_ends_with_the_status_after_its_threads_and_exit_hooks(tmp_path, outcome, status, stderr):
    marker = tmp_path / "marker"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker), outcome], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed outputexit hook ran\n"
    assert done.stderr == stderr
    assert marker.read_text() == "written"
