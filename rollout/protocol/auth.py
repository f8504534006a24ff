"""Who may talk to a worker, and what they may do: CurveZMQ (ZeroMQ's built-in encryption and authentication,
through `zmq.auth`) with two roles.

Keys are `zmq.auth` certificate files: `NAME.key` holds a public key, `NAME.key_secret` the pair. `rollout-keygen DIR
NAME` writes both. A worker started with `--curve-secret-key worker.key_secret` only accepts clients whose public
key file lies in `--authorized-keys DIR` (generate, stream, cancel, ping, stats, hello, weights_spec) or in
`--trainer-keys DIR` (all of that, and weight updates and adapter unloads). Every connection is encrypted. Clients give
`RolloutClient(..., curve_secret_key="client.key_secret", server_public_key="worker.key")`.

Without keys a worker trusts everyone who can reach it, so it refuses to bind a non-loopback address unless
`--insecure` is given (and then warns at start).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from rollout.cli.parser import CliParser

logger = logging.getLogger(__name__)

# Message types only a trainer key may send (when authentication is on).
TRAINER_ONLY = frozenset({"weights_begin", "weights_bucket", "weights_commit", "weights_abort", "adapter_unload"})


def load_key_pair(source: str | os.PathLike | bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a `.key_secret` certificate file, or from a 40-character z85 secret key.

    Raises:
        ValueError: the file holds no secret key, or the value is no key.
    """
    if isinstance(source, bytes) and len(source) == 40:
        return zmq.curve_public(source), source
    path = Path(os.fsdecode(source))
    if not path.is_file():
        raise ValueError(f"{path}: no such key file (make one with rollout-keygen)")
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path}: holds no secret key (give the .key_secret file)")
    return public, secret


def load_public_key(source: str | os.PathLike | bytes) -> bytes:
    """A z85 public key from a `.key` or `.key_secret` certificate file, or a 40-character z85 key itself.

    Raises:
        ValueError: no such file, or no key.
    """
    if isinstance(source, bytes) and len(source) == 40:
        return source
    path = Path(os.fsdecode(source))
    if not path.is_file():
        raise ValueError(f"{path}: no such key file")
    return zmq.auth.load_certificate(path)[0]


def load_key_directory(directory: str | os.PathLike) -> set[bytes]:
    """The public keys of every `*.key` certificate file in a directory.

    Raises:
        ValueError: not a directory.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory of public keys")
    return set(zmq.auth.load_certificates(path))


@dataclass(frozen=True)
class WorkerKeys:
    """A worker's key material, read from its files at once (the files may go then: a Ray actor deletes its own)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    clients: frozenset[bytes]  # may generate
    trainers: frozenset[bytes]  # may also push weights

    @classmethod
    def read(
        cls,
        secret_key: str | os.PathLike | bytes,
        authorized_keys: str | os.PathLike | None = None,
        trainer_keys: str | os.PathLike | None = None,
    ) -> WorkerKeys:
        """Read the keys.

        Args:
            secret_key: the worker's `.key_secret` file (or z85 secret key).
            authorized_keys: directory of client public keys that may generate.
            trainer_keys: directory of trainer public keys that may also push weights.
        Raises:
            ValueError: a missing or unreadable file or directory (the message starts with its rollout-worker flag),
                or no key at all to accept.
        """
        try:
            public, secret = load_key_pair(secret_key)
        except ValueError as error:
            raise ValueError(f"--curve-secret-key: {error}") from None
        keys = {}
        directories = (("--authorized-keys", authorized_keys), ("--trainer-keys", trainer_keys))
        for flag, directory in directories:
            try:
                keys[flag] = load_key_directory(directory) if directory is not None else set()
            except ValueError as error:
                raise ValueError(f"{flag} {os.fspath(directory)}: {error}") from None
        clients, trainers = keys["--authorized-keys"], keys["--trainer-keys"]
        if not clients | trainers:  # (named by its flags: rollout-worker prints a message starting with "--" as is)
            given = [f"{flag} {os.fspath(directory)}" for flag, directory in directories if directory is not None]
            raise ValueError(
                f"{', '.join(given) or '--authorized-keys/--trainer-keys'}: no *.key file, so no client key to "
                "accept (copy each client's and trainer's public .key file there)"
            )
        return cls(public, secret, frozenset(clients), frozenset(trainers))


class WorkerAuth:
    """A worker's CurveZMQ server side: the ZAP handler thread, its accepted keys, and the trainer role."""

    def __init__(self, context: zmq.Context, keys: WorkerKeys):
        """
        Args:
            context: the worker's ZeroMQ context (the handler serves its sockets).
            keys: the worker's keys (`WorkerKeys.read`).
        """
        self.public_key, self._secret_key = keys.public_key, keys.secret_key
        self.trainers = keys.trainers
        self.context = context
        self._authenticator = ThreadAuthenticator(context, log=_DenialsWarned(logger))
        self._authenticator.start()
        self._authenticator.allow_any = False
        self._authenticator.certs["*"] = {key: True for key in keys.clients | keys.trainers}

    def secure(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it binds) a CURVE server with the worker's key."""
        socket.curve_secretkey = self._secret_key
        socket.curve_publickey = self.public_key
        socket.curve_server = True

    def may(self, user_id: str | None, message_type: str) -> bool:
        """Whether the client whose User-Id (its z85 public key) is `user_id` may send `message_type`."""
        if message_type not in TRAINER_ONLY:
            return True
        return user_id is not None and user_id.encode() in self.trainers

    def stop(self) -> None:
        """Stop the handler thread."""
        self._authenticator.stop()


class SecurityLog:
    """Warnings of refused clients, at most one per `every_s` seconds (a refused peer retrying cannot flood the log);
    each says how many were left out since the last one."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0):
        self.log, self.every_s = log, every_s
        self._last, self._left_out = -every_s, 0
        self._lock = threading.Lock()  # pyzmq's authenticator thread and the serving loop both warn

    def warn(self, message: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._left_out += 1
                return
            left_out, self._last, self._left_out = self._left_out, now, 0
        more = f" ({left_out} more since the last such warning)" if left_out else ""
        self.log.warning(message + more, *args)


class _DenialsWarned(logging.LoggerAdapter):
    """pyzmq's authenticator log, its refusals ("DENIED ...", at debug there) raised to warnings, rate-limited."""

    def __init__(self, log: logging.Logger):
        super().__init__(log, {})
        self.denials = SecurityLog(log)

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):
            text = str(msg)
        if text.startswith("DENIED"):
            self.denials.warn("refused a connection: %s", text)
        else:
            super().debug(msg, *args, **kwargs)


def secure_client_socket(
    socket: zmq.Socket, secret_key: str | os.PathLike | bytes, server_public_key: str | os.PathLike | bytes
) -> None:
    """Make a client socket (before it connects) a CURVE client of the server whose public key is given.

    Raises:
        ValueError: a key that cannot be loaded, or a server key given as the server's secret key file (a client
            needs only the public one: handing clients the worker's secret lets anyone who holds it pose as it).
    """
    if not isinstance(server_public_key, bytes) and Path(os.fsdecode(server_public_key)).is_file():
        path = Path(os.fsdecode(server_public_key))
        if zmq.auth.load_certificate(path)[1] is not None:
            raise ValueError(
                f"server_public_key {path} is the worker's secret key file: give its public one "
                f"({path.with_suffix('.key').name}); the secret stays with the worker"
            )
    public, secret = load_key_pair(secret_key)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = load_public_key(server_public_key)


def build_keygen_parser() -> CliParser:
    """`rollout-keygen`'s flags."""
    parser = CliParser(
        prog="rollout-keygen",
        description="Write a CurveZMQ key pair for a rollout worker, client or trainer: DIR/NAME.key (the public "
        "key: copy it into a worker's --authorized-keys or --trainer-keys directory, or give a worker's to clients "
        "as server_public_key) and DIR/NAME.key_secret (keep it private).",
    )
    parser.add_version_flag()
    parser.add_argument("directory", help="where to write the two files (created if missing)")
    parser.add_argument(
        "name", help="file name stem, e.g. worker, trainer or client1 (no path separator, not starting with a dot)"
    )
    return parser


def _name_refusal(name: str) -> str | None:
    """Why `name` cannot be a key pair's file name stem (None: it can): the pair goes into DIR, as two visible files."""
    if not name.strip():
        return "NAME is empty: give a file name stem, e.g. worker"
    if "/" in name or (os.altsep and os.altsep in name) or os.sep in name or "\0" in name:
        return f"NAME {name!r} holds a path separator: give a file name stem and put the folder in DIR"
    if name.startswith("."):
        return f"NAME {name!r} starts with a dot: the key files would be hidden (give e.g. worker)"
    if len(os.fsencode(f"{name}.key_secret")) > 255:  # most file systems' limit on a file name
        return f"NAME {name[:40]!r}... is too long: a key file's name holds at most 255 bytes"
    return None


def _make_directory(directory: Path) -> str | None:
    """Create DIR if missing; why it cannot hold the key pair, or None."""
    if directory.exists() and not directory.is_dir():
        return f"DIR {directory} is not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"DIR {directory} cannot be created ({error.strerror or error})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"DIR {directory} is not writable"
    return None


def _place(made: str | os.PathLike, path: Path) -> None:
    """Put the key file `made` at `path`, never into a file already there (FileExistsError instead): a hard link,
    or where the file system has none (FAT, some FUSE and network file systems), a copy into a file created
    exclusively (O_EXCL, not following a link planted at the name), owner-only (the umask is 077 here).

    Args:
        made: the file pyzmq wrote in keygen's private folder.
        path: where it goes.
    """
    try:
        os.link(made, path)
        return
    except FileExistsError:
        raise
    except OSError as error:  # EPERM, EXDEV, ENOTSUP...: no hard links here
        logger.debug("no hard link at %s (%s): copying the key file", path, error)
    data = Path(made).read_bytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def keygen_main(argv: list[str] | None = None) -> int:
    """Entry point of `rollout-keygen DIR NAME`: write DIR/NAME.key (public) and DIR/NAME.key_secret."""
    parser = build_keygen_parser()
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    refusal = _name_refusal(args.name)
    if refusal is not None:
        parser.error(refusal)
    secret_path = directory / f"{args.name}.key_secret"
    if secret_path.exists():
        parser.error(f"{secret_path} exists; refusing to overwrite a key")
    refusal = _make_directory(directory)
    if refusal is not None:
        parser.error(refusal)
    # pyzmq writes both files with the process's umask, opening them without O_EXCL. So they are written into a
    # private folder made beside them (0700, on the same file system), with the umask tightened (the secret is
    # owner-only from its creation), then linked into place: a link never replaces a file, so one another user
    # planted at the name meanwhile is refused, not written into. The public key is made readable again.
    umask = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".rollout-keygen-") as private:
            made = zmq.auth.create_certificates(private, args.name)
            paths = [directory / Path(path).name for path in made]
            try:
                for made_path, path in zip(made, paths):
                    _place(made_path, path)
            except FileExistsError as error:
                for path in paths[: paths.index(Path(error.filename2 or error.filename))]:
                    path.unlink()  # the pair is written whole or not at all
                parser.error(f"{error.filename2 or error.filename} exists; refusing to overwrite a key")
    finally:
        os.umask(umask)
    public_path, secret_path = paths
    os.chmod(secret_path, 0o600)
    os.chmod(public_path, 0o644 & ~umask)
    print(f"public key: {public_path}\nsecret key: {secret_path}")
    return 0


if __name__ == "__main__":
    sys.exit(keygen_main())
