"""`FuzzReport`, what `send_fuzz` saw (JSON-able with `to_dict`), and `format_report`, a few lines of it for a
terminal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.benchmarks.fuzz.cases import FuzzCase


@dataclass
class FuzzReport:
    """What `send_fuzz` saw. Every case is owed a reply (an error, or the answer to a request the codec accepts)."""

    address: str
    seed: int
    sent: int = 0
    bytes_sent: int = 0
    answered: int = 0  # cases that got at least one reply
    error_replies: int = 0  # cases answered by an error
    other_replies: int = 0  # cases answered by something else (pong, hello_reply, group_result, ...)
    unanswered: int = 0
    stray_replies: int = 0  # results that came after their case was concluded unanswered
    unsolicited_pongs: int = 0  # pongs that answer no case (the worker's liveness probes)
    header_decodable: int = 0  # cases whose header is a msgpack map
    header_decodable_errors: int = 0  # of those, answered by an error
    expected_error: int = 0  # cases the codec refuses (or reply types, or stray frames): an error is owed
    expected_error_answered_ok: int = 0  # of those, answered by something other than an error
    decodable_owed_error: int = 0  # cases with a readable header that the codec refuses
    decodable_owed_error_answered: int = 0  # of those, answered by an error
    accepted_requests: int = 0  # cases the codec accepts (valid, or valid but hostile)
    lenient: int = 0  # cases meant to be malformed that the codec accepts
    identities: int = 0
    seconds: float = 0.0
    send_seconds: float = 0.0  # until every case was past its sentinel (then: waiting for accepted generates)
    max_latency_s: float = 0.0
    worker_stopped: bool = False  # the worker stopped answering (died or stalled past every wait)
    stalls: int = 0  # waits that ended without a reply while cases were in flight
    by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    error_codes: dict[str, int] = field(default_factory=dict)
    unanswered_cases: list[FuzzCase] = field(default_factory=list)
    wrong_answer_cases: list[FuzzCase] = field(default_factory=list)  # an error was owed, something else came
    lenient_cases: list[FuzzCase] = field(default_factory=list)
    # Answered by code "internal": an exception the worker did not anticipate (should be a "bad_request").
    internal_cases: list[tuple[FuzzCase, str]] = field(default_factory=list)
    slow_cases: list[tuple[float, FuzzCase]] = field(default_factory=list)  # (seconds, case), slowest first
    suspects: list[FuzzCase] = field(default_factory=list)  # in flight when the worker stopped answering
    serving: dict[str, Any] = field(default_factory=dict)  # check_serving() after the fuzz

    def to_dict(self, cases: int = 5) -> dict[str, Any]:
        """JSON-able figures, with the first `cases` cases of each list (summaries and repros)."""

        def listed(items: list[FuzzCase]) -> list[dict[str, Any]]:
            return [{**c.summary(), "repro": c.repro(512)} for c in items[:cases]]

        return {
            "address": self.address,
            "seed": self.seed,
            "sent": self.sent,
            "bytes_sent": self.bytes_sent,
            "answered": self.answered,
            "error_replies": self.error_replies,
            "other_replies": self.other_replies,
            "unanswered": self.unanswered,
            "stray_replies": self.stray_replies,
            "unsolicited_pongs": self.unsolicited_pongs,
            "header_decodable": self.header_decodable,
            "header_decodable_errors": self.header_decodable_errors,
            "expected_error": self.expected_error,
            "expected_error_answered_ok": self.expected_error_answered_ok,
            "decodable_owed_error": self.decodable_owed_error,
            "decodable_owed_error_answered": self.decodable_owed_error_answered,
            "accepted_requests": self.accepted_requests,
            "lenient": self.lenient,
            "identities": self.identities,
            "seconds": round(self.seconds, 2),
            "send_seconds": round(self.send_seconds, 2),
            "max_latency_s": round(self.max_latency_s, 3),
            "stalls": self.stalls,
            "worker_stopped": self.worker_stopped,
            "error_codes": self.error_codes,
            "by_category": self.by_category,
            "unanswered_cases": listed(self.unanswered_cases),
            "wrong_answer_cases": listed(self.wrong_answer_cases),
            "lenient_cases": listed(self.lenient_cases),
            "internal_cases": [
                {**c.summary(), "message": message, "repro": c.repro(512)} for c, message in self.internal_cases[:cases]
            ],
            "slow_cases": [{"seconds": round(s, 3), **c.summary()} for s, c in self.slow_cases[:cases]],
            "suspects": listed(self.suspects),
            "serving": self.serving,
        }


def format_report(report: FuzzReport) -> str:
    """A few lines for a terminal."""
    lines = [
        f"fuzz {report.address}, seed {report.seed}: {report.sent} messages ({report.bytes_sent / 1e6:.1f} MB) from "
        f"{report.identities} identities in {report.seconds:.1f} s",
        f"  answered {report.answered} (errors {report.error_replies}, other {report.other_replies}), "
        f"unanswered {report.unanswered}; decodable headers {report.header_decodable}, answered by an error "
        f"{report.header_decodable_errors}",
        f"  an error owed {report.expected_error} (readable header {report.decodable_owed_error}, answered by an error "
        f"{report.decodable_owed_error_answered}), something else came {report.expected_error_answered_ok}; accepted "
        f"by the codec {report.accepted_requests} (of which meant malformed {report.lenient})",
        f"  slowest {report.max_latency_s:.2f} s, {len(report.slow_cases)} slow, {report.stalls} stalls, worker "
        f"{'STOPPED ANSWERING' if report.worker_stopped else 'still answering'}",
    ]
    if report.serving:
        s = report.serving
        lines.append(
            f"  after: hello {'ok' if s.get('hello') else 'FAILED'}, greedy generate "
            f"{'ok' if s.get('greedy_tokens') else 'FAILED: ' + str(s.get('generate_error'))}, update slot "
            f"{ {True: 'free', False: 'HELD', None: 'unknown'}[s.get('update_slot_free')] }"
        )
    for title, items in (
        ("unanswered", report.unanswered_cases),
        ("an error owed, got", report.wrong_answer_cases),
        ("suspects", report.suspects),
        ("internal error", [c for c, _ in report.internal_cases]),
    ):
        for case in items[:5]:
            lines.append(
                f"  {title}: #{case.index} {case.category} {case.message_type}.{case.target} = {case.description}"
            )
    return "\n".join(lines)
