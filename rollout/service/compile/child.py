"""A child of the compile server (server.py): forked from it, so xgrammar, torch and the tokenizer are
loaded already, it compiles the specs the server hands it one at a time, each under the memory budget, and answers
whether each compiled; then, for a grammar that took a while, the grammar itself as xgrammar's JSON (the worker reads
it instead of compiling again), or None. The server kills it past a job's deadline, or when the JSON takes longer
than compiling again would (xgrammar's serialization of some grammars grows with the square of their rules); it
exits by itself after a job ran out of memory (its heap may be left fragmented) and after RECYCLE_AFTER jobs, and
when the server is gone.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from rollout.service.compile.frames import read_frame, write_frame

RECYCLE_AFTER = 256  # jobs one child compiles before it exits (what a compile leaves behind cannot pile up)
# A grammar compiled faster than this is compiled again by the worker: cheaper than its JSON's round trip.
SEND_AFTER_S = 0.02
MAX_GRAMMAR_CHARS = 32 << 20  # a grammar's JSON longer than this is not sent (the worker compiles it again)


def serve_jobs(job_fd: int, answer_fd: int, info: Any, max_bytes: int) -> None:
    """Compile jobs read from `job_fd` ({"field", "spec"}) and write each outcome to `answer_fd`, until the server
    closes `job_fd` or a reason to exit comes.

    Args:
        job_fd: the server's jobs for this child.
        answer_fd: this child's answers to the server.
        info: the served tokenizer's xgrammar TokenizerInfo.
        max_bytes: each compile's memory budget, past the data segment the child has when the job starts.
    """
    import xgrammar

    from rollout.engine.grammar.constraints import compile_error_message, compile_spec

    # One thread: a compile takes one core, and no thread's stack or malloc arena counts against its budget.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    inbox = bytearray()
    for _ in range(RECYCLE_AFTER):
        job = read_frame(job_fd, inbox)
        if job is None:
            return
        field, spec = job["field"], job["spec"]
        start = time.monotonic()
        compiled = None
        _limit_data(max_bytes, hard)
        try:
            compiled = compile_spec(compiler, field, tuple(spec) if field == "choice" else spec)
            answer: dict[str, Any] = {"status": "ok"}
        except MemoryError:
            answer = {"status": "memory"}
        except Exception as error:  # noqa: BLE001 - xgrammar's own errors name what is wrong with the spec
            message = compile_error_message(error)
            answer = {"status": "memory"} if "bad_alloc" in message else {"status": "error", "message": message}
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
        answer["seconds"] = round(time.monotonic() - start, 4)
        write_frame(answer_fd, answer)
        if answer["status"] == "memory":
            return
        if compiled is not None:
            write_frame(answer_fd, {"grammar": _grammar_json(compiled, answer["seconds"], max_bytes, hard)})
            del compiled


def _grammar_json(compiled: Any, seconds: float, max_bytes: int, hard: int) -> str | None:
    """A compiled grammar as xgrammar's JSON, under the memory budget (None: quick to compile again, too long, or
    out of memory)."""
    if seconds < SEND_AFTER_S:
        return None
    _limit_data(max_bytes, hard)
    try:
        text = compiled.serialize_json()
    except Exception:  # noqa: BLE001 - std::bad_alloc: the worker compiles it again
        return None
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    return text if len(text) <= MAX_GRAMMAR_CHARS else None


def _limit_data(max_bytes: int, hard: int) -> None:
    """Let the data segment grow by at most `max_bytes` from here. RLIMIT_DATA counts the heap and private
    writable mappings (not reserved address space, nor shared pages): allocations past it fail, which xgrammar
    reports as std::bad_alloc."""
    limit = _data_bytes() + max_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _data_bytes() -> int:
    """This process's data segment (Linux's VmData: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0
