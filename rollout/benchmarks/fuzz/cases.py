"""`FuzzCase`: one malformed (or hostile) message, and what answer the worker owes it (from the real codec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from rollout import protocol as p
from rollout.benchmarks.fuzz.values import OVERSIZED_ITEMS


@dataclass
class FuzzCase:
    """One malformed (or hostile) message.

    Attributes:
        seed, index: `fuzz_case(seed, index)` rebuilds it.
        frames: what goes on the wire (header first).
        category: which kind of damage (a key of CATEGORIES).
        message_type: the type it was built from (before damage), or None.
        target: the field it damaged ("group_id", "sampling.top_p", "tensors[0].name", "protocol", "type", "header",
            "frames", ...).
        description: what was put there, abridged.
        header_decodable: frame 0 is a msgpack map (the worker can read the header at all).
        expect: "error" when the codec refuses it, it is one of the worker's own reply types, or it carries data
            frames it takes none of; "reply" for a request the codec accepts (answered by an error or its reply).
        intended_malformed: the generator meant it to be refused by the codec (missing required field, wrong
            protocol, unknown field, ...); a case with this set and expect "reply" is one the codec lets through.
        group_id: of a generate the codec accepts (its group_result answers it), else None.
        cancels: of a cancel the codec accepts, the group id: when an accepted generate of that id is in flight on
            the same client, the cancel is answered by that group's (aborted) result.
        unloads: of an adapter_unload the codec accepts, its update_id: the engine thread answers it, maybe after
            the replies to cases sent after it.
    """

    seed: int
    index: int
    frames: list[bytes] = field(repr=False)
    category: str
    message_type: str | None
    target: str
    description: str
    header_decodable: bool = False
    expect: str = "error"
    intended_malformed: bool = True
    group_id: str | None = None
    cancels: str | None = None  # of a cancel the codec accepts: the group (answered by that group's result)
    unloads: str | None = None  # of an adapter_unload the codec accepts: its update_id (its answer carries it)
    update_id: str | None = None  # of any request the codec accepts that carries one
    nonce: int | None = None  # of a ping the codec accepts
    max_items: int = 1_000_000

    @property
    def nbytes(self) -> int:
        return sum(len(frame) for frame in self.frames)

    def repro(self, limit: int = 4096) -> str:
        """Python that rebuilds the exact frames: a bytes literal when short, else `fuzz_case(seed, index)`."""
        limit_arg = "" if self.max_items == OVERSIZED_ITEMS[-1] else f", max_items={self.max_items}"
        exact = (
            "from rollout.benchmarks.fuzz import fuzz_case\n"
            f"frames = fuzz_case({self.seed}, {self.index}{limit_arg}).frames"
        )
        if self.nbytes > limit:
            return f"{exact}  # {self.category} {self.target}: {self.description} ({self.nbytes} bytes)"
        return f"frames = {self.frames!r}  # {self.category} {self.target}: {self.description}"

    def summary(self) -> dict[str, Any]:
        """A JSON-able description (no frames)."""
        return {
            "index": self.index,
            "category": self.category,
            "type": self.message_type,
            "target": self.target,
            "value": self.description,
            "bytes": self.nbytes,
            "expect": self.expect,
        }


# Cases whose header frame is larger than this are not decoded here (the codec may take seconds on them): they only
# need some reply.
_LOCAL_DECODE_LIMIT = 64 << 10


def _classify(case: FuzzCase) -> None:
    """Whether the header is a readable msgpack map, and what answer the worker owes (from the real codec)."""
    try:
        header = msgpack.unpackb(case.frames[0], raw=False, strict_map_key=True)
        case.header_decodable = isinstance(header, dict)
    except Exception:  # noqa: BLE001 - undecodable on purpose
        case.header_decodable = False
    if len(case.frames[0]) > _LOCAL_DECODE_LIMIT:
        case.expect = "reply"
        if case.header_decodable and header.get("type") == "generate" and isinstance(header.get("group_id"), str):
            case.group_id = header["group_id"]  # the worker may accept it: then its group_result answers it
        return
    try:
        message = p.decode(case.frames)
    except Exception:  # noqa: BLE001 - ProtocolError, or whatever else the codec trips on: the worker owes an error
        case.expect = "error"
        return
    if message.TYPE not in p.REQUEST_TYPES or (len(case.frames) > 1 and not isinstance(message, p.WeightsBucket)):
        case.expect = "error"
        return
    case.expect = "reply"
    case.update_id = getattr(message, "update_id", None)
    if isinstance(message, p.AdapterUnload):
        case.unloads = message.update_id  # answered by the engine thread, maybe after the sentinel
    if isinstance(message, p.Generate):
        case.group_id = message.group_id
    elif isinstance(message, p.Cancel):
        case.cancels = message.group_id
    elif isinstance(message, p.Ping):
        case.nonce = message.nonce
