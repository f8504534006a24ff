"""Does the worker still serve after a fuzz? `check_serving`: a raw `hello`, a greedy generate through
`RolloutClient`, and whether the weight-update slot is still free."""

from __future__ import annotations

import math
import time
from typing import Any

import zmq

from rollout import protocol as p

GREEDY_PROMPT = [7, 8, 9, 10, 11]
GREEDY_SAMPLING = {"do_sample": False, "max_new_tokens": 8, "stop_token_ids": []}


def check_serving(address: str, timeout_s: float = 60.0, update_slot: bool = True) -> dict[str, Any]:
    """A raw `hello`, a greedy generate through `RolloutClient`, and (optionally) whether a weight update can still
    be opened (begin with one real tensor, then abort). Never raises: failures are reported.

    Returns:
        {"hello": bool, "model": str, "greedy_tokens": [int] or None, "generate_error": str or None,
         "update_slot_free": bool or None, "update_slot_error": str or None, "seconds": float}.
    """
    from trainer_bridge import PromptGroup, RolloutClient, RolloutError

    start = time.monotonic()
    out: dict[str, Any] = {"hello": False, "model": None, "greedy_tokens": None, "generate_error": None}
    context = zmq.Context()
    try:
        reply = _ask(context, address, [p.encode(p.Hello())[0]], min(timeout_s, 15.0))
        if isinstance(reply, p.HelloReply):
            out.update(hello=True, model=reply.model)
        try:
            with RolloutClient(address, timeout=timeout_s) as client:
                result = client.generate(PromptGroup(list(GREEDY_PROMPT), 1, dict(GREEDY_SAMPLING)))
                out["greedy_tokens"] = list(result.completions[0].token_ids)
        except (RolloutError, OSError, ValueError) as error:
            out["generate_error"] = f"{type(error).__name__}: {error}"
        if update_slot:
            out.update(_update_slot(context, address, min(timeout_s, 15.0)))
    finally:
        context.destroy(linger=0)
    out["seconds"] = round(time.monotonic() - start, 2)
    return out


def _update_slot(context: zmq.Context, address: str, timeout_s: float) -> dict[str, Any]:
    """Open an update of one real tensor and abort it at once: is the slot free?"""
    update_id = f"fuzz-slot-check-{time.monotonic_ns()}"
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        spec = _request(sock, p.WeightsSpec(update_id), timeout_s)
        if not isinstance(spec, p.WeightsSpecReply) or not spec.tensors:
            return {"update_slot_free": None, "update_slot_error": f"weights_spec answered {spec!r:.200}"}
        smallest = min(spec.tensors, key=lambda t: math.prod(t.shape))
        begin = p.WeightsBegin(update_id, [smallest], partial=True, timeout_s=10.0)
        ready = _request(sock, begin, timeout_s)
        if not isinstance(ready, p.WeightsReady):
            return {"update_slot_free": False, "update_slot_error": f"weights_begin answered {ready!r:.300}"}
        _request(sock, p.WeightsAbort(update_id), timeout_s)
        return {"update_slot_free": True, "update_slot_error": None}
    finally:
        sock.close(linger=0)


def _request(sock: zmq.Socket, message: p.Message, timeout_s: float) -> p.Message | None:
    sock.send_multipart(p.encode(message))
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return p.decode(sock.recv_multipart())


def _ask(context: zmq.Context, address: str, frames: list[bytes], timeout_s: float) -> p.Message | None:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)
