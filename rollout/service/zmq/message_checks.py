"""`MessageChecks`: a message's way into the worker. Its frames are decoded under the worker's limits and its sender's
role is checked (with keys on); whatever fails is answered by name, with the ids the message carried so its client
can tell which group or update it was, and a malformed weight message drops its update (`UpdateSlot.on_malformed`).

Invariant: every message either comes out decoded, with the sender's key, or is answered here; none is dropped
silently.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout import protocol as p
from rollout.protocol.auth import SecurityLog, WorkerAuth
from rollout.protocol.header_glance import glance, glance_ids, oversized
from rollout.service.weights.update_slot import UpdateSlot


class MessageChecks:
    """Decodes and checks what a client sent, answering what it refuses (the worker's serving thread's)."""

    def __init__(
        self,
        max_lengths: dict[str, int],
        auth: WorkerAuth | None,
        updates: UpdateSlot,
        send: Callable[[bytes, p.Message], None],
        security_log: SecurityLog,
        group_refused: Callable[[], None] = lambda: None,
    ):
        """
        Args:
            max_lengths: the longest lists a header may hold, by field (checked before their items are looked at).
            auth: the worker's keys and roles; None: no keys, every client is a trainer.
            updates: the weight-update slot, told of malformed weight messages (their update is dropped).
            send: answers a client (its identity, the reply).
            security_log: where refused weight updates are logged, rate-limited.
            group_refused: counts a generate request refused here (as the group desk counts its own refusals).
        """
        self.max_lengths, self.auth, self.updates, self.send = max_lengths, auth, updates, send
        self.security_log = security_log
        self.group_refused = group_refused

    def decode(self, identity: bytes, frames: list, key: str | None) -> p.Message | None:
        """The message, or None when it was refused (and answered): malformed, over a limit, or of a kind the
        sender's key may not send.

        Args:
            identity: its sender's routing id.
            frames: the message's frames (its header first).
            key: its sender's z85 CurveZMQ public key with keys on (the "User-Id" property), else None.
        """
        if self.auth is not None and frames:  # a role's refusal costs no decode (a weights_begin may be 22 MB)
            seen = glance_ids(frames[0])
            if seen is not None and not self.auth.may(key, seen["type"]):
                self._refuse_role(identity, seen["type"], seen.get("group_id"), seen.get("update_id"))
                return None
        try:
            junk = oversized(frames[0]) if frames else None
            if junk is not None:
                raise p.ProtocolError("header", junk)
            message = p.decode(frames, max_lengths=self.max_lengths, accept=p.REQUEST_TYPES)
            if len(frames) > 1 and not isinstance(message, p.WeightsBucket):
                raise p.ProtocolError("frames", f"a {message.TYPE} message carries no data frames")
        except p.ProtocolError as error:
            if error.group_id is None and error.update_id is None and frames:  # refused before its ids were built
                seen = glance(frames[0])  # (a string over the limit): the first entries may still name them
                error.group_id, error.update_id = seen.get("group_id"), seen.get("update_id")
                error.kind = error.kind or seen.get("type")
            reply = p.Error("bad_request", str(error), error.field, error.group_id, error.update_id)
            self._answer(identity, reply, error.update_id, error.kind)
            return None
        if self.auth is not None and not self.auth.may(key, message.TYPE):
            ids = getattr(message, "group_id", None), getattr(message, "update_id", None)
            self._refuse_role(identity, message.TYPE, *ids)  # a header the glance could not read, or a second "type"
            return None
        return message

    def refuse_cut(self, identity: bytes, frames: list, reason: str) -> None:
        """Answer a message that had more frames or bytes than any may have (its header names its ids: a glance
        at its first entries, or else a decode).

        Args:
            identity: its sender.
            frames: what was kept of it (its header first).
            reason: what it was over.
        """
        seen = glance_ids(frames[0]) if frames else None
        if seen is not None:
            group_id, update_id, kind = seen.get("group_id"), seen.get("update_id"), seen.get("type")
        else:
            group_id = update_id = kind = None
            try:
                message = p.decode(frames[:1], max_lengths=self.max_lengths, accept=p.REQUEST_TYPES)
                group_id, update_id = getattr(message, "group_id", None), getattr(message, "update_id", None)
                kind = message.TYPE
            except p.ProtocolError as error:
                group_id, update_id, kind = error.group_id, error.update_id, error.kind
        self._answer(identity, p.Error("bad_request", reason, "frames", group_id, update_id), update_id, kind)

    def _answer(self, identity: bytes, reply: p.Error, update_id: str | None, kind: str | None) -> None:
        """A refusal: a malformed weight message drops its update, whose owner the slot answers; else `reply` (a
        generate request's counted as refused, whichever check refused it)."""
        if kind == p.Generate.TYPE:
            self.group_refused()
        if not self.updates.on_malformed(identity, update_id, reply, kind):
            self.send(identity, reply)

    def _refuse_role(self, identity: bytes, kind: str, group_id: str | None, update_id: str | None) -> None:
        reason = f"{kind} needs a trainer key (this client's key is not in the worker's --trainer-keys)"
        if kind == p.WeightsBegin.TYPE:  # an update refused: counted and logged as the slot's refusals are
            self.updates.counts.refused()
            self.security_log.warn("refused weight update %s: the client's key is not in --trainer-keys", update_id)
        elif kind == p.Generate.TYPE:
            self.group_refused()
        self.send(identity, p.Error("unauthorized", reason, "type", group_id, update_id))
