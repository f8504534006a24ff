"""Usage checks of the addresses a worker listens on (ZeroMQ, HTTP, metrics), made before the model loads: a
malformed address or a port in use is a one-line usage error, an address anyone can reach a warning."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import socket

from rollout.protocol.sockets import check_address, is_loopback

logger = logging.getLogger("rollout.worker")


def check_bind(parser: argparse.ArgumentParser, address: str, flag: str = "--bind", shown: str | None = None) -> None:
    """A usage error when the address is malformed, or is a TCP port already in use, before the model loads.

    Args:
        parser: its `error` reports the problem (exit status 2).
        address: a ZeroMQ address (tcp://HOST:PORT for the HTTP and metrics servers too).
        flag: the flag that gave it, for the message.
        shown: the flag's value as the user gave it, for the message of a port in use (default: `address`).
    """
    shown = address if shown is None else shown
    problem = check_address(address)
    if problem is not None:
        parser.error(f"{flag} {problem}")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or port == "*":
        return
    bare_host = host.strip("[]")
    probe = socket.socket(socket.AF_INET6 if ":" in bare_host else socket.AF_INET)  # an IPv6 host has colons
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no conflict
    try:
        probe.bind(("" if host in ("*", "") else bare_host, int(port)))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            free = "tcp://HOST:* picks" if flag == "--bind" else "0 picks"
            parser.error(
                f"{flag} {shown}: cannot bind, port {port} is already in use: stop what listens there or pick "
                f"another port ({free} a free one)"
            )
        parser.error(f"{flag} {address}: cannot bind ({error.strerror or error})")
    except ValueError as error:
        parser.error(f"{flag} {address}: cannot bind ({error})")
    finally:
        probe.close()


METRICS_HOST = "127.0.0.1"  # --metrics-host's default: loopback


def check_metrics_address(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--metrics-port's address is free (a usage error if not); a warning when it is not loopback (the metrics
    server has no key: anyone who can reach it reads them)."""
    if args.metrics_port is None:
        if args.metrics_host is not None:  # it would serve nothing, silently
            parser.error(f"--metrics-host {args.metrics_host}: has no effect without --metrics-port (metrics are off)")
        return
    if args.metrics_host is None:
        args.metrics_host = METRICS_HOST
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port {args.metrics_port}: a TCP port is 0 to 65535 (0 picks a free one)")
    if not _host_name_or_address(args.metrics_host):
        parser.error(
            f"--metrics-host {args.metrics_host!r}: not a host name or IP address (an IPv6 address goes without "
            "brackets, the port in --metrics-port)"
        )
    host = f"[{args.metrics_host}]" if ":" in args.metrics_host else args.metrics_host
    address = f"tcp://{host}:{args.metrics_port}"
    if args.metrics_port:
        check_bind(parser, address, flag="--metrics-port", shown=str(args.metrics_port))
    if not is_loopback(address):
        logger.warning("--metrics-host %s: the metrics are readable by anyone who can reach it", args.metrics_host)


def _host_name_or_address(host: str) -> bool:
    """Whether `host` is a host name or an IP address (no port, no brackets, no path)."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    return bool(host) and not any(character in host for character in "/ []@")
