"""Socket plumbing shared by the worker and the client: address checks and the poll waker."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

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
