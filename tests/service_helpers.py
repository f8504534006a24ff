"""Helpers for service tests: a real rollout-worker subprocess and a raw protocol client."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import worker_zygote
import zmq

from rollout import protocol as p

TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """A rollout-worker process; stopped (SIGTERM, then SIGKILL) by `close`. It is forked from the session's worker
    zygote (tests/worker_zygote.py), which imported torch & co. once, unless the test changed the environment since."""

    def __init__(self, *extra_flags: str, address: str | None = None, secure: tuple | None = None, wait: bool = True):
        """`secure`: (a .key_secret file, the worker's .key file) to ping a worker that wants CurveZMQ keys;
        `wait`: return once it answers a ping (else call `wait_ready`)."""
        self.address = address or f"tcp://127.0.0.1:{free_port()}"
        flags = [
            "--device",
            "cpu",
            "--bind",
            self.address,
            "--num-blocks",
            "256",
            "--block-size",
            "16",
            "--log-level",
            "WARNING",
            *extra_flags,
        ]
        # Output goes to a file, not a pipe: nobody reads a pipe while the worker runs, and a full one (64 KiB of
        # logged warnings) would block the worker mid-test.
        self.log = tempfile.NamedTemporaryFile()
        zygote = worker_zygote.zygote()
        if zygote.can_fork():  # forked from a process that imported torch & co. already: about 1 s instead of 9
            self.process = zygote.spawn(flags, self.log.name)
        else:
            command = [sys.executable, "-m", "rollout.service.launch.cli", *flags]
            self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._secure = secure
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the worker answers a ping (it loads its model first)."""
        client = Client(self.address, self._secure)
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                assert self.process.poll() is None, self.output()
                client.send(p.Ping(1))
                if client.socket.poll(500):
                    assert isinstance(client.receive(), p.Pong)
                    return
            raise TimeoutError("the worker did not answer ping")
        finally:
            client.close()

    @classmethod
    def several(cls, count: int, *flags: str) -> list[Worker]:
        """`count` workers started side by side (their model loads overlap), each answering once this returns."""
        servers = [cls(*flags, wait=False) for _ in range(count)]
        try:
            for server in servers:
                server.wait_ready()
        except BaseException:
            for server in servers:
                server.close()
            raise
        return servers

    def stats(self) -> dict:
        """The worker's `stats` reply (asked over a connection of its own)."""
        client = Client(self.address)
        try:
            return client.ask(p.Stats()).stats
        finally:
            client.close()

    def output(self) -> str:
        """Everything the worker printed so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Client:
    """A raw DEALER socket speaking the protocol; every receive has a timeout."""

    context = zmq.Context.instance()

    def __init__(self, address: str, secure: tuple | None = None, receive_hwm: int | None = None):
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if receive_hwm is not None:  # before connecting: ZeroMQ applies it to connections made afterwards
            self.socket.setsockopt(zmq.RCVHWM, receive_hwm)
        if secure is not None:
            from rollout.protocol.auth import secure_client_socket

            secure_client_socket(self.socket, *secure)
        self.socket.connect(address)

    def send(self, message: p.Message) -> None:
        self.socket.send_multipart(p.encode(message))

    def receive(self, timeout_s: float = TIMEOUT_S) -> p.Message:
        """The next reply, skipping the worker's liveness probes (unsolicited pongs, which the protocol lets a
        worker send to any client whose connection descriptor just closed and may be reused)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.socket.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError("no reply from the worker")
            message = p.decode(self.socket.recv_multipart())
            if not (isinstance(message, p.Pong) and message.nonce == p.PROBE_NONCE):
                return message

    def ask(self, message: p.Message) -> p.Message:
        self.send(message)
        return self.receive()

    def until_result(self, group_id: str) -> tuple[list[p.Delta], p.Message]:
        deltas = []
        while True:
            reply = self.receive()
            if isinstance(reply, p.Delta):
                deltas.append(reply)
            elif getattr(reply, "group_id", None) == group_id:
                return deltas, reply

    def close(self) -> None:
        self.socket.close(linger=0)


def run_ranks(script, args: list[str], world_size: int = 2, timeout: float = 180.0) -> None:
    """Run `python script *args` as `world_size` torch.distributed ranks (gloo env: MASTER_ADDR/PORT, RANK,
    LOCAL_RANK, WORLD_SIZE; one compute thread each; the repository and tests/ importable) and wait; fails with a
    rank's log when one exits non-zero."""
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    port = str(free_port())
    processes = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(repo), str(repo / "tests"), os.environ.get("PYTHONPATH", "")]),
        )
        command = [sys.executable, str(script), *args]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-4000:]
