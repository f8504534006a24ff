"""Helpers for service tests: a real rollout-worker subprocess and a raw protocol client."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import zmq

from rollout.service import protocol as p

TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """A rollout-worker subprocess; stopped (SIGTERM, then SIGKILL) by `close`."""

    def __init__(self, *flags: str, address: str | None = None):
        self.address = address or f"tcp://127.0.0.1:{free_port()}"
        command = [
            sys.executable,
            "-m",
            "rollout.service.cli",
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
            *flags,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        client = Client(self.address)
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                assert self.process.poll() is None, self.process.stdout.read().decode()
                client.send(p.Ping(1))
                if client.socket.poll(500):
                    assert isinstance(client.receive(), p.Pong)
                    return
            raise TimeoutError("the worker did not answer ping")
        finally:
            client.close()

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

    def __init__(self, address: str):
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, message: p.Message) -> None:
        self.socket.send_multipart(p.encode(message))

    def receive(self, timeout_s: float = TIMEOUT_S) -> p.Message:
        if not self.socket.poll(timeout_s * 1000):
            raise TimeoutError("no reply from the worker")
        return p.decode(self.socket.recv_multipart())

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
