"""A child of the compile server (compile_server.py): forked from it, so xgrammar, torch and the tokenizer are
loaded already, it compiles the specs the server hands it one at a time, each under the memory budget, and answers
whether each compiled. The server kills it past a job's deadline; it exits by itself after a job ran out of memory
(its heap may be left fragmented) and after RECYCLE_AFTER jobs, and when the server is gone.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from rollout.service.compile_frames import read_frame, write_frame

RECYCLE_AFTER = 256  # jobs one child compiles before it exits (what a compile leaves behind cannot pile up)


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

    from rollout.engine.grammar import compile_spec

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
        # RLIMIT_DATA counts the heap and private writable mappings (not reserved address space, nor shared
        # pages): allocations past the budget fail, which xgrammar reports as std::bad_alloc.
        limit = _data_bytes() + max_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        try:
            compile_spec(compiler, field, tuple(spec) if field == "choice" else spec)
            answer: dict[str, Any] = {"status": "ok"}
        except MemoryError:
            answer = {"status": "memory"}
        except Exception as error:  # noqa: BLE001 - xgrammar's own errors name what is wrong with the spec
            message = str(error).strip()
            answer = {"status": "memory"} if "bad_alloc" in message else {"status": "error", "message": message[:500]}
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
        answer["seconds"] = round(time.monotonic() - start, 4)
        write_frame(answer_fd, answer)
        if answer["status"] == "memory":
            return


def _data_bytes() -> int:
    """This process's data segment (Linux's VmData: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0
