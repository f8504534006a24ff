"""The torch.distributed weight transport: a process group of its own between one trainer process (rank 0) and
the workers (ranks 1..W), so bucket bytes go by broadcast (NCCL between GPUs, gloo on CPU) while begin, commit and
their deadlines stay on the ZeroMQ control plane.

The group never touches torch.distributed's default group: the trainer may already use that one for its own data
parallelism. It rendezvouses through a TCPStore that the trainer hosts.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_DIST_FIELDS = {"host": str, "port": int, "world_size": int, "rank": int, "backend": str, "group": str}


def check_dist_fields(fields: dict[str, Any]) -> str | None:
    """The name of the first missing or mistyped rendezvous field of a weights_begin's `dist`, or None."""
    for name, kind in _DIST_FIELDS.items():
        if type(fields.get(name)) is not kind:
            return f"dist.{name}"
    if fields["backend"] not in BACKENDS:
        return "dist.backend"
    if not 0 < fields["rank"] < fields["world_size"]:
        return "dist.rank"
    return None


def host_towards(addresses: list[str]) -> str:
    """An IP address of this machine that every worker at `addresses` ("tcp://host:port") can connect back to: the
    address of the interface that routes to the first worker on another host, else loopback (workers on this
    machine's loopback, ipc://). A worker on this machine accepts this machine's own addresses too.

    Raises:
        ValueError: a worker host that does not resolve, or no route to it (naming it).
    """
    for address in addresses:
        if not address.startswith("tcp://"):
            continue
        host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        try:
            family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            if ipaddress.ip_address(target[0].split("%")[0]).is_loopback:
                continue
            probe = socket.socket(family, socket.SOCK_DGRAM)
            try:
                probe.connect(target)  # a UDP "connect" only picks the route (and keeps an IPv6 scope)
                return probe.getsockname()[0].split("%")[0]
            finally:
                probe.close()
        except OSError as error:
            raise ValueError(f"no route to worker {address} to choose dist_host by ({error}); give dist_host") from None
    return "127.0.0.1"


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store; the trainer hosts it (`is_master`, port 0 picks a free port: read `store.port`).

    The trainer's store listens on `host` only (torch's own would listen on every interface): its socket is bound
    here and handed over."""
    listen_fd = None
    if is_master:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
        listen_fd = listener.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def make_process_group(store: dist.Store, group: str, rank: int, world_size: int, backend: str, timeout_s: float):
    """Join a process group of `world_size` ranks (blocks until every rank joined, or raises at the timeout).

    Args:
        store: the rendezvous store (`make_store`).
        group: a key unique to this group, so successive groups on one store do not mix.
        rank: this process's rank (the trainer is 0).
        world_size: trainer + workers.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        timeout_s: deadline of the rendezvous and of every later broadcast.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(group, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) to every rank of `group`, in place, and wait."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


RETRY_S = 0.25  # between connection attempts to a trainer's store that is not listening yet
MAX_RENDEZVOUS = 4  # rendezvous threads alive at once (an abandoned one may wait for its timeout)
CONNECT_S = 10.0  # for the store to answer once something accepts connections at its address
# torch's TCPStore client opens with these bytes (query VALIDATE + its magic number, then PING + a nonce) and then
# waits for the nonce with no timeout at all: a listener that accepts and stays silent would hold the joining
# thread forever. `_wait_for_store` sends them first, with a deadline.
_STORE_PROBE = bytes([0x00]) + (0x3C85F7CE).to_bytes(4, "little") + bytes([0x0D]) + (0x524F4C4C).to_bytes(4, "little")


def _wait_for_store(host: str, port: int, timeout_s: float, cancelled: Callable[[], bool]) -> bool:
    """Wait until something accepts TCP connections at host:port and answers a store client's opening (any reply,
    or closing the connection, counts: torch's own client then says what is wrong). False when cancelled first.

    Raises:
        TimeoutError: nothing accepted within `timeout_s`, or what accepted stayed silent for `CONNECT_S`.
    """
    deadline = time.monotonic() + timeout_s
    while not cancelled():
        try:
            probe = socket.create_connection((host, port), timeout=RETRY_S)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepts connections at {host}:{port} (the trainer's store)") from None
            time.sleep(RETRY_S)
            continue
        with probe:
            probe.sendall(_STORE_PROBE)
            silent_until = time.monotonic() + min(CONNECT_S, timeout_s)
            while not cancelled():
                try:
                    probe.recv(16)
                    return True  # an answer, or the connection closed
                except TimeoutError:
                    if time.monotonic() > silent_until:
                        raise TimeoutError(
                            f"{host}:{port} accepts connections but does not answer as a torch.distributed store"
                        ) from None
                except OSError:
                    return True  # reset: torch's client will say what is wrong
        return False
    return False


def shutdown_group(group: Any) -> None:
    """Shut a process group down now (best effort: a peer may be gone already); None is nothing to do. Left to a
    garbage collection, a group's sockets to peers that died keep the process waiting up to a minute at exit."""
    if group is not None:
        with contextlib.suppress(Exception):
            group.shutdown()


class DistReceiver:
    """The worker's side. Rendezvous run on threads of their own, at most `MAX_RENDEZVOUS` at once, so no number of
    begun and abandoned updates can pile up threads: further joins wait their turn, and one whose update ended
    before its turn is dropped. A join waiting for the store gives up within `RETRY_S` of its update ending; what
    accepts at the store's address must answer as a store within `CONNECT_S`. What can still take up to its
    update's `timeout_s` is a store whose process group never forms (an abandoned push): it holds one of the slots
    meanwhile. Receives are blocking calls that the update's own job thread makes (updates.py), so the serving
    thread keeps answering while bytes arrive."""

    def __init__(self):
        self._lock = threading.Lock()
        self._group: Any = None  # the process group of the newest join that completed, if still wanted
        self._group_key: str | None = None
        self._wanted_key: str | None = None  # the newest join asked for
        self._stores: dict[str, dist.TCPStore] = {}
        self._buffer: torch.Tensor | None = None  # receive buffer (NCCL into host staging), reused while large
        self._stream: Any = None  # NCCL: a stream of its own, so engine kernels never queue behind a broadcast
        self._joining = 0  # rendezvous threads alive
        self._waiting: list[tuple[Callable[[], None], Callable[[], bool]]] = []  # (join, cancelled), oldest first

    def join(
        self,
        fields: dict[str, Any],
        timeout_s: float,
        done: Callable[[BaseException | None], None],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Join the group `fields` describes (at once when it is the current one); then call `done` (None, or the
        error), unless `cancelled()` became true first (its update ended: nobody waits for the answer).
        """
        key = fields["group"]
        with self._lock:
            if cancelled():
                return  # its update ended (a newer one may have asked for its own group already: leave it wanted)
            self._wanted_key = key
            if self._group_key == key and self._group is not None:
                done(None)
                return

        def rendezvous() -> None:
            if cancelled():
                return
            try:
                if not _wait_for_store(fields["host"], fields["port"], timeout_s, cancelled):
                    return
                store = make_store(
                    fields["host"], fields["port"], fields["world_size"], False, min(timeout_s, CONNECT_S)
                )
                store.set_timeout(datetime.timedelta(seconds=timeout_s))
                group = make_process_group(
                    store, key, fields["rank"], fields["world_size"], fields["backend"], timeout_s
                )
            except Exception as error:  # noqa: BLE001 - reported to the update, which is rejected
                done(error)
                return
            with self._lock:
                stale = self._wanted_key != key or cancelled()  # its update ended, or a newer one asked meanwhile
                if not stale:
                    self._abort(self._group)
                    self._group, self._group_key, self._stores = group, key, {key: store}
            if stale:
                self._abort(group)
            done(RuntimeError("a newer weight update replaced this group") if stale else None)

        with self._lock:
            self._waiting = [entry for entry in self._waiting if not entry[1]()]
            if self._joining >= MAX_RENDEZVOUS:
                self._waiting.append((rendezvous, cancelled))
                return
            self._joining += 1
        threading.Thread(target=self._run_joins, args=(rendezvous,), name="rollout-weights-join", daemon=True).start()

    def _run_joins(self, job: Callable[[], None] | None) -> None:
        """Run `job`, then the oldest waiting join still wanted, until none is left."""
        while job is not None:
            try:
                job()
            except Exception:  # noqa: BLE001 - `done` callbacks report errors; anything else is logged
                logger.exception("torch.distributed rendezvous failed")
            with self._lock:
                job = None
                while self._waiting and job is None:
                    candidate, cancelled = self._waiting.pop(0)
                    job = None if cancelled() else candidate
                if job is None:
                    self._joining -= 1

    def receive(self, targets: list[torch.Tensor], device: torch.device) -> None:
        """Receive one broadcast per target, in order, into the targets (through a reused buffer on `device` when
        a target lives elsewhere, e.g. NCCL into CPU staging). Blocks the calling thread.

        Raises:
            Exception: the collective failed (the group is dropped: the next update makes a new one).
        """
        with self._lock:
            group = self._group
        if group is None:
            raise RuntimeError("no torch.distributed group joined")
        try:
            for target in targets:
                self._receive_one(group, target, device)
        except Exception:
            self.forget()  # a failed collective leaves the group unusable
            raise

    def _receive_one(self, group: Any, target: torch.Tensor, device: torch.device) -> None:
        if device.type != "cuda":
            broadcast(group, target)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        buffer = self._buffer
        if buffer is None or buffer.device != device or buffer.numel() < target.numel():
            buffer = self._buffer = torch.empty(target.numel(), dtype=torch.uint8, device=device)
        with torch.cuda.stream(self._stream):
            broadcast(group, buffer[: target.numel()])
            target.copy_(buffer[: target.numel()], non_blocking=False)
        self._stream.synchronize()  # blocks this thread only

    def forget(self) -> None:
        """Drop (and abort, where the backend can) the current group, after a failure or when its update ended
        uncleanly; the next update makes a new one."""
        with self._lock:
            group, self._group, self._group_key, self._stores = self._group, None, None, {}
            self._buffer = None
        self._abort(group)

    @staticmethod
    def _abort(group: Any) -> None:
        abort = getattr(group, "abort", None)  # NCCL: unblocks a collective stuck on a vanished trainer
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - best effort
                logger.warning("could not abort a torch.distributed group", exc_info=True)

    def close(self) -> None:
        """Drop the joins that wait for their turn (running ones end with their update)."""
        with self._lock:
            self._waiting.clear()
