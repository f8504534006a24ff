"""Usage checks of the addresses a worker listens on (ZeroMQ, HTTP, metrics), made before the model loads: a
malformed address or a port in use is a one-line usage error, an address anyone can reach a warning."""

from __future__ import annotations

import argparse
import logging
import socket

from rollout.service.sockets import check_address, is_loopback

logger = logging.getLogger("rollout.worker")


def check_bind(parser: argparse.ArgumentParser, address: str, flag: str = "--bind") -> None:
    """A usage error when the address is malformed, or is a TCP port already in use, before the model loads."""
    problem = check_address(address)
    if problem is not None:
        parser.error(f"{flag} {problem}")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or port == "*":
        return
    probe = socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no conflict
    try:
        probe.bind(("" if host in ("*", "") else host.strip("[]"), int(port)))
    except (OSError, ValueError) as error:
        parser.error(f"{flag} {address}: cannot bind ({error})")
    finally:
        probe.close()


def check_metrics_address(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--metrics-port's address is free (a usage error if not); a warning when it is not loopback (the metrics
    server has no key: anyone who can reach it reads them)."""
    if args.metrics_port is None:
        return
    address = f"tcp://{args.metrics_host}:{args.metrics_port}"
    if args.metrics_port:
        check_bind(parser, address, flag="--metrics-port")
    if not is_loopback(address):
        logger.warning("--metrics-host %s: the metrics are readable by anyone who can reach it", args.metrics_host)
