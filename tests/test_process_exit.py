"""A console script's process ends at once when its command is done (`rollout.cli.process_exit`), and still does what
the interpreter's exit does that anyone can see: its other threads finish, its exit hooks run, its output is flushed,
and its status is the command's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from rollout.cli.process_exit import run_console_script

    def main(argv):
        def late_write():
            time.sleep(0.3)
            with open(argv[0], "w") as file:
                file.write("written")

        threading.Thread(target=late_write).start()  # not a daemon: the exit waits for it
        pool = ThreadPoolExecutor(2)  # left open, its workers idle: the exit wakes and joins them
        pool.submit(time.sleep, 0.01).result()
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


def test_a_closed_standard_output_is_no_error(tmp_path):
    """A command started with its standard output closed (`>&-`: sys.stdout is None) ends with its own status."""
    marker = tmp_path / "marker"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace('sys.stdout.write("unflushed output")', "pass"), str(marker), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.close(1),
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`rollout-eval ... | head`: the command's next print meets a closed pipe; it ends with status 1 and no
    traceback, as a shell tool does."""
    script = textwrap.dedent(
        """
        from rollout.cli.process_exit import run_console_script

        def main(argv):
            for _ in range(100_000):
                print("a line of output", flush=True)
            return 0

        run_console_script(main)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.readline()
    process.stdout.close()  # the reader goes away
    assert process.wait(timeout=60) == 1
    assert process.stderr.read() == b""
    process.stderr.close()
