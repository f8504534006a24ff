"""Socket plumbing shared by the worker and the client: address checks, the poll waker, bounded message reads."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any

import zmq

ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_address(address: Any) -> str | None:
    """Why `address` is no ZeroMQ endpoint a worker can bind or a client connect to (None when it looks right)."""
    if not isinstance(address, str) or not address.startswith(ADDRESS_SCHEMES):
        return f"{address!r} is not a ZeroMQ address: expected e.g. tcp://127.0.0.1:5555 (tcp://, ipc:// or inproc://)"
    if address.startswith("tcp://"):
        host, colon, port = address.removeprefix("tcp://").rpartition(":")
        if not colon:
            return f"{address!r} has no port: expected e.g. tcp://127.0.0.1:5555"
        if not host:
            return f"{address!r} has no host: expected e.g. tcp://127.0.0.1:5555"
        if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
            return f"{address!r} has no valid port: expected e.g. tcp://127.0.0.1:5555 (or :* for any free one)"
    elif address in ("ipc://", "inproc://"):
        return f"{address!r} names no endpoint"
    return None


def is_ipv6_literal(address: str) -> bool:
    """Whether a tcp:// address names its host by an IPv6 address in brackets (tcp://[::1]:5555): the socket then
    needs ZeroMQ's IPV6 option, which is left off otherwise (with it, a name such as localhost may resolve to ::1
    alone)."""
    return isinstance(address, str) and address.startswith("tcp://[")


def is_loopback(address: str) -> bool:
    """True when a bind address only accepts connections from this machine (ipc://, inproc://, tcp to 127.0.0.0/8,
    ::1 or localhost); "*", 0.0.0.0 and every other interface are not."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: reachable from elsewhere
        return False


def bound_ipc_file(endpoint: str) -> tuple[str, int] | None:
    """The socket file an ipc:// endpoint just bound made (its path and inode), which libzmq leaves behind when the
    socket closes; None for any other endpoint (tcp, inproc, an abstract ipc://@name) or when there is no such file.

    Args:
        endpoint: the bound socket's LAST_ENDPOINT.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    path = endpoint.removeprefix("ipc://")
    try:
        status = os.stat(path)
    except OSError:
        return None
    return (path, status.st_ino) if stat.S_ISSOCK(status.st_mode) else None


def remove_ipc_file(bound: tuple[str, int] | None) -> None:
    """Remove the socket file `bound_ipc_file` found, after its socket closed, unless it is gone or is another
    socket's now (libzmq replaces the file of a path bound again: that file is the new binder's).

    Args:
        bound: what `bound_ipc_file` returned.
    """
    if bound is None:
        return
    path, inode = bound
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:  # gone already (libzmq removes the files of ipc://* itself), or not ours to remove
        pass


class Waker:
    """Wakes a thread blocked in `zmq.Poller.poll` from any other thread (register `reader` for POLLIN).

    Both the worker's serving thread and the client's I/O thread own their ZeroMQ sockets alone; other threads leave
    work in a queue and call `wake()` instead of touching a socket.
    """

    def __init__(self):
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def wake(self) -> None:
        """Make the next (or current) poll return. Safe from any thread; extra wake-ups are harmless."""
        try:
            self._writer.send(b"x")
        except OSError:  # buffer full (a wake-up is pending anyway) or closed
            pass

    def drain(self) -> None:
        """Consume pending wake-ups (call from the polling thread)."""
        try:
            while self.reader.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


@dataclass
class Inbound:
    """One message a ROUTER socket received."""

    identity: bytes
    frames: list  # zmq.Frame: the header, then data frames (only the header when the message was cut)
    refused: str | None = None  # why the message was cut: more frames or bytes than a message may have


class MessageReader:
    """Reads a ROUTER socket's messages part by part and keeps at most `max_frames` frames and `max_bytes` bytes of
    each. ZeroMQ bounds every frame (MAXMSGSIZE) but not how many frames one message has. A call reads at most
    `frames_per_read` frames: a message of many frames (a weight bucket of 65,536 pieces) is taken over several
    calls, and the rest of an oversized one is dropped the same way (never held), so the caller's loop keeps
    serving others meanwhile (`busy` says a message is part read).

    ZeroMQ itself delivers a message only once all of it arrived, so the sender's connection holds a whole message
    in the receiver's memory before this sees its first frame; CurveZMQ authentication (auth.py) limits who can.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        max_frames: int,
        max_bytes: int,
        frames_per_read: int = 1024,
        max_header_bytes: int | None = None,
    ):
        """
        Args:
            socket: a ROUTER socket (the first part of each message is its sender's identity).
            max_frames: the most frames a message may have after the identity.
            max_bytes: the most bytes those frames may hold together (with `max_header_bytes`: the frames after the
                header, its data).
            frames_per_read: frames read (kept or dropped) per `read` at most (1,024: a few milliseconds).
            max_header_bytes: the most bytes of a message's first frame, its header, bounded apart from its data
                (None: it counts with the others).
        """
        self._socket = socket
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes
        self.frames_per_read = frames_per_read
        self._reading: Inbound | None = None  # a message whose frames are still being read ...
        self._bytes = 0  # ... and the bytes of its frames so far (those after the header, with max_header_bytes)
        self._header_bytes = 0
        self._draining: Inbound | None = None  # a cut message whose remaining frames are still being dropped

    @property
    def busy(self) -> bool:
        """A message is part read (its next frames are waiting): call `read` again, without polling first."""
        return self._reading is not None or self._draining is not None

    def read(self) -> Inbound | None:
        """The next message, or None when none is waiting or one is still part read (then `busy`: call again)."""
        if self._draining is not None:
            return self._drain()
        message = self._reading
        if message is None:
            try:
                first = self._socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            message = Inbound(first.bytes, [])
            if not first.more:
                return message
            self._reading, self._bytes, self._header_bytes = message, 0, 0
        for _ in range(self.frames_per_read):
            frame = self._socket.recv(copy=False)  # the rest of a message is there once its first part is
            message.frames.append(frame)
            if self.max_header_bytes is not None and len(message.frames) == 1:
                self._header_bytes = len(frame)
            else:
                self._bytes += len(frame)
            if len(message.frames) > self.max_frames or self._bytes > self.max_bytes or self._header_too_long:
                self._reading = None
                return self._cut(message, more=frame.more)
            if not frame.more:
                self._reading = None
                return message
        return None

    def _cut(self, message: Inbound, more: bool) -> Inbound | None:
        """Refuse a message past the limits: keep its header (its ids name what was refused), drop the rest."""
        count = f"more than {self.max_frames} frames" if len(message.frames) > self.max_frames else ""
        size = f"more than {self.max_bytes} bytes" if self._bytes > self.max_bytes else ""
        if self.max_header_bytes is not None and size:
            size += " of data"
        header = f"a header of more than {self.max_header_bytes} bytes" if self._header_too_long else ""
        # Only the data bytes follow --max-message-bytes; the frame count and the header's size are fixed limits.
        shown = count or size or header
        flag = " (the worker's limit; see --max-message-bytes)" if shown == size else " (a fixed limit of the protocol)"
        message.refused = f"the message has {shown}{flag}"
        del message.frames[1:]
        if not more:
            return message
        self._draining = message
        return self._drain()

    @property
    def _header_too_long(self) -> bool:
        return self.max_header_bytes is not None and self._header_bytes > self.max_header_bytes

    def _drain(self) -> Inbound | None:
        for _ in range(self.frames_per_read):
            if not self._socket.recv(copy=False).more:
                message, self._draining = self._draining, None
                return message
        return None


def frame_property(frame: object, name: str) -> str | None:
    """A ZeroMQ message property: "Peer-Address" (the sender's IP, TCP only) or "User-Id" (its CURVE public key,
    z85); None when the transport or security mechanism has none."""
    try:
        return frame.get(name) or None  # type: ignore[attr-defined]
    except (AttributeError, zmq.ZMQError):
        return None


def frame_fd(frame: object) -> int | None:
    """The file descriptor a message came over (ZeroMQ's SRCFD), to match the socket monitor's disconnect events."""
    try:
        return frame.get(zmq.SRCFD)  # type: ignore[attr-defined]
    except (AttributeError, zmq.ZMQError):
        return None
