"""What an operator reads when CurveZMQ keys are wrong: a client given a server_public_key that is not the worker's is
told so (the worker drops its greeting without a word), not sent looking for a wrong address; a worker whose key
directories hold no key names those directories' flags, not --curve-secret-key."""

from __future__ import annotations

import time

import pytest
import zmq

from rollout.protocol.auth import WorkerKeys, keygen_main
from service_helpers import free_port
from trainer_bridge import PromptGroup, RolloutClient, RolloutError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    for name in ("worker", "other", "client"):
        assert keygen_main([str(root), name]) == 0
    return root


def test_a_wrong_server_key_is_named_not_a_wrong_address(keys):
    """A real CURVE server (what a keyed worker binds) with the client encrypting for another server's key: libzmq
    reports only a handshake cut short; the client used to say 'no answer within 2 s' like for a wrong port."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    public, secret = zmq.auth.load_certificate(keys / "worker.key_secret")
    server.curve_secretkey, server.curve_publickey, server.curve_server = secret, public, True
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        started = time.monotonic()
        with RolloutClient(
            f"tcp://127.0.0.1:{port}",
            timeout=30,
            connect_timeout=2,
            curve_secret_key=keys / "client.key_secret",
            server_public_key=keys / "other.key",  # not the worker's
        ) as client:
            with pytest.raises(RolloutError) as error:
                client.generate(PromptGroup([1, 2, 3], sampling={"max_new_tokens": 2}))
        assert error.value.code == "no_workers"
        assert "server_public_key" in str(error.value) and "handshake" in str(error.value)
        assert time.monotonic() - started < 10
    finally:
        server.close(linger=0)
        context.term()


def test_a_wrong_port_with_keys_says_nothing_of_keys(keys):
    """Nothing listens: no handshake ever started, so the hint about the server key must not appear."""
    port = free_port()  # (a ZeroMQ socket's close is asynchronous: it may still accept a connection meanwhile)
    with RolloutClient(
        f"tcp://127.0.0.1:{port}",
        connect_timeout=1,
        curve_secret_key=keys / "client.key_secret",
        server_public_key=keys / "worker.key",
    ) as client:
        with pytest.raises(RolloutError) as error:
            client.generate(PromptGroup([1, 2, 3], sampling={"max_new_tokens": 2}))
    assert error.value.code == "no_workers" and "server_public_key" not in str(error.value)


def test_key_directories_without_keys_are_named(keys, tmp_path):
    """An empty --authorized-keys directory: the message starts with the flags at fault (rollout-worker prints a
    message that starts with '--' as is, any other prefixed with --curve-secret-key)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as error:
        WorkerKeys.read(keys / "worker.key_secret", authorized_keys=tmp_path / "empty")
    message = str(error.value)
    assert message.startswith("--authorized-keys") and str(tmp_path / "empty") in message


@pytest.mark.parametrize(
    "name, message",
    [
        ("../evil", "NAME '../evil' holds a path separator"),
        ("sub/x", "NAME 'sub/x' holds a path separator"),
        ("", "NAME is empty"),
        (".key", "NAME '.key' starts with a dot: the key files would be hidden"),
        ("  ", "NAME is empty"),
        ("k" * 300, f"NAME {'k' * 40!r}... is too long"),
    ],
)
def test_keygen_refuses_a_name_that_is_not_a_file_name_stem_and_writes_nothing(capsys, tmp_path, name, message):
    """`rollout-keygen DIR ../evil` wrote the pair beside DIR, then said it existed; `sub/x` ended in a traceback;
    "" wrote hidden `.key` files; a name too long for the file system ended in a traceback."""
    folder = tmp_path / "keys"
    with pytest.raises(SystemExit) as exited:
        keygen_main([str(folder), name])
    assert exited.value.code == 2
    assert f"rollout-keygen: error: {message}" in capsys.readouterr().err
    assert list(tmp_path.rglob("*")) == []


def test_keygen_refuses_a_folder_it_cannot_use_by_name(capsys, tmp_path):
    """A file given as DIR, and a DIR that cannot be created (under a file), ended in tracebacks."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    for folder, message in ((a_file, f"DIR {a_file} is not a directory"), (a_file / "x", f"DIR {a_file / 'x'}")):
        with pytest.raises(SystemExit) as exited:
            keygen_main([str(folder), "worker"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"rollout-keygen: error: {message}" in err and "Traceback" not in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]
