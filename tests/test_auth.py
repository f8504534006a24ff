"""CurveZMQ authentication and roles against one real worker: an unknown key cannot connect (and is told so at
once), a generate-only key cannot push weights (outputs unchanged), a trainer key can; a non-loopback bind
without keys is refused unless --insecure; a wrong port fails fast, naming the address."""

from __future__ import annotations

import time

import pytest
import torch

from rollout import protocol as p
from rollout.presets import tiny_model
from rollout.protocol.auth import keygen_main
from rollout.service.launch import cli, startup
from service_helpers import Client, Worker, free_port
from trainer_bridge import PromptGroup, RolloutClient, RolloutError, push_weights, unload_adapter

pytestmark = pytest.mark.timeout(120)

GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 10}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    for name, folder in (("worker", "own"), ("client", "clients"), ("trainer", "trainers"), ("stranger", "strangers")):
        assert keygen_main([str(root / folder), name]) == 0
    return root


@pytest.fixture(scope="module")
def worker(keys):
    server = Worker(
        "--curve-secret-key",
        str(keys / "own" / "worker.key_secret"),
        "--authorized-keys",
        str(keys / "clients"),
        "--trainer-keys",
        str(keys / "trainers"),
        secure=(keys / "trainers" / "trainer.key_secret", keys / "own" / "worker.key"),
    )
    yield server
    server.close()


def _client(worker, keys, name: str, folder: str, **options) -> RolloutClient:
    return RolloutClient(
        worker.address,
        timeout=60,
        curve_secret_key=keys / folder / f"{name}.key_secret",
        server_public_key=keys / "own" / "worker.key",
        **options,
    )


def test_keygen_writes_a_pair_and_refuses_to_overwrite(keys, capsys):
    assert (keys / "clients" / "client.key").is_file() and (keys / "clients" / "client.key_secret").is_file()
    assert (keys / "clients" / "client.key_secret").stat().st_mode & 0o077 == 0
    with pytest.raises(SystemExit):
        keygen_main([str(keys / "clients"), "client"])
    assert "refusing to overwrite" in capsys.readouterr().err


def test_keygen_writes_the_secret_owner_only_from_its_creation(tmp_path, monkeypatch):
    """The secret was written with the umask's mode (0644) and only then chmod-ed: another user could open it first.
    Its mode is read the moment pyzmq has written it, before keygen goes on."""
    import os

    import zmq.auth

    created = zmq.auth.create_certificates
    modes: dict[str, int] = {}

    def recording(directory, name):
        public, secret = created(directory, name)
        modes.update(public=os.stat(public).st_mode & 0o777, secret=os.stat(secret).st_mode & 0o777)
        return public, secret

    monkeypatch.setattr(zmq.auth, "create_certificates", recording)
    umask = os.umask(0o022)
    try:
        assert keygen_main([str(tmp_path), "fresh"]) == 0
    finally:
        os.umask(umask)
    assert modes["secret"] & 0o077 == 0, oct(modes["secret"])
    assert (tmp_path / "fresh.key").stat().st_mode & 0o777 == 0o644  # the public key stays readable
    assert (tmp_path / "fresh.key_secret").stat().st_mode & 0o777 == 0o600


def test_the_workers_secret_key_file_is_refused_as_a_clients_server_key(keys):
    """zmq's certificate loader takes a public key from a secret file too: a client configured with the worker's
    secret file would work, and spread the secret to every client machine. Refused, naming the public file."""
    with pytest.raises(ValueError, match=r"is the worker's secret key file: give its public one \(worker.key\)"):
        RolloutClient(
            "tcp://127.0.0.1:1",
            curve_secret_key=keys / "clients" / "client.key_secret",
            server_public_key=keys / "own" / "worker.key_secret",
        )


def test_an_unknown_key_cannot_connect_and_is_told_so(worker, keys):
    started = time.monotonic()
    with _client(worker, keys, "stranger", "strangers") as stranger:
        with pytest.raises(RolloutError) as error:
            stranger.generate(PromptGroup([1, 2, 3], sampling=GREEDY))
        assert stranger.live_workers() == []
    assert error.value.code == "no_workers" and "refused this client's key" in str(error.value)
    assert "every rollout worker refused this client" in str(error.value)
    assert "Is rollout-worker running" not in str(error.value)  # it is: it answered, and refused the key
    assert time.monotonic() - started < 15
    assert "refused a connection: DENIED" in worker.output()  # the worker's log says so too (pyzmq: at debug)


def test_a_client_without_keys_cannot_connect(worker):
    with RolloutClient(worker.address, timeout=30, connect_timeout=3) as plain:
        with pytest.raises(RolloutError) as error:
            plain.generate(PromptGroup([1, 2, 3], sampling=GREEDY))
    assert error.value.code == "no_workers" and worker.address in str(error.value)


def test_a_keys_connections_are_one_client(keys):
    """--max-groups-per-client 1 with keys: a second connection of a key with a group in flight is refused "busy";
    another key's is not (the worker hands each message's CurveZMQ key to its group desk)."""
    public = keys / "own" / "worker.key"
    client_key, trainer_key = keys / "clients" / "client.key_secret", keys / "trainers" / "trainer.key_secret"
    server = Worker(
        *("--curve-secret-key", str(keys / "own" / "worker.key_secret"), "--authorized-keys", str(keys / "clients")),
        *("--trainer-keys", str(keys / "trainers"), "--max-groups-per-client", "1"),
        secure=(client_key, public),
    )
    short = {"max_new_tokens": 2}
    try:
        first, second, other = (
            Client(server.address, (client_key, public)),
            Client(server.address, (client_key, public)),
            Client(server.address, (trainer_key, public)),
        )
        first.send(p.Generate("long", [4, 5, 6], sampling={"max_new_tokens": 2000, "stop_token_ids": []}, stream=True))
        assert isinstance(first.receive(), p.Delta)  # in flight
        refused = second.ask(p.Generate("more", [4, 5, 6], sampling=short))
        assert isinstance(refused, p.Error) and refused.code == "busy", refused
        assert "--max-groups-per-client" in refused.message
        other.send(p.Generate("theirs", [4, 5, 6], sampling=short))
        assert isinstance(other.until_result("theirs")[1], p.GroupResult)
        first.send(p.Cancel("long"))
        assert isinstance(first.until_result("long")[1], p.GroupResult)
    finally:
        server.close()


def test_a_generate_only_key_cannot_push_weights_a_trainer_key_can(worker, keys):
    prompt = PromptGroup([4, 5, 6, 7], sampling=GREEDY)
    changed = tiny_model()
    with torch.no_grad():
        for parameter in changed.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    with _client(worker, keys, "client", "clients") as client:
        before = client.generate(prompt).completions[0].token_ids
        with pytest.raises(RolloutError) as error:
            push_weights(client, changed)
        assert error.value.code == "unauthorized" and "trainer key" in str(error.value)
        with pytest.raises(RolloutError) as error:  # a version the workers would refuse too: the key comes first
            push_weights(client, changed, version=0)
        assert error.value.code == "unauthorized"
        assert client.generate(prompt).completions[0].token_ids == before
        assert client.stats()[0]["policy_version"] == 0
        assert client.stats()[0]["weight_updates_rejected"] == 2  # counted as the slot's refusals are
    assert "refused weight update" in worker.output()
    with _client(worker, keys, "trainer", "trainers") as trainer:
        assert push_weights(trainer, changed).version == 1
        assert trainer.generate(prompt).completions[0].token_ids != before


def test_a_generate_only_key_cannot_unload_an_adapter(worker, keys):
    """adapter_unload is a trainer's (it ends other clients' groups): refused by role before the engine looks."""
    with _client(worker, keys, "client", "clients") as client:
        with pytest.raises(RolloutError) as error:
            unload_adapter(client, "any")
        assert error.value.code == "unauthorized" and "adapter_unload needs a trainer key" in str(error.value)
    with _client(worker, keys, "trainer", "trainers") as trainer:  # a trainer's reaches the engine: none served
        with pytest.raises(RolloutError) as error:
            unload_adapter(trainer, "any")
        assert (error.value.code, error.value.field) == ("bad_request", "adapter_name")


def test_a_refused_weight_message_names_its_update_whatever_its_id(worker, keys):
    """The role's refusal comes from a glance at the header (no decode of a large one); an id too long for the glance
    leaves the header to the decode, which refuses an id over 1024 characters, so the refusal still names the update
    (a client's reply channel is keyed by it), and a 2-byte character counts as two."""
    client = Client(worker.address, secure=(keys / "clients" / "client.key_secret", keys / "own" / "worker.key"))
    try:
        for update_id, code in (
            ("u-short", "unauthorized"),
            ("L" * 20_000, "bad_request"),
            ("\u00e9" * 9_000, "bad_request"),
        ):
            client.send(p.WeightsBegin(update_id, [p.TensorSpec("w", "float32", [2])]))
            reply = client.receive()
            assert (reply.TYPE, reply.code, reply.update_id) == ("error", code, update_id)
    finally:
        client.close()


def test_the_key_files_are_read_before_the_model_loads(keys, tmp_path, monkeypatch):
    """`start_worker(..., keys_read=...)` reads the key files first and says so before the model loads: a Ray
    fleet's actor deletes its key files then, so one killed while it loads leaves no secret key on disk."""
    import shutil

    copied = tmp_path / "keys"
    shutil.copytree(keys, copied)

    class Loading(Exception):
        pass

    def load_model(*args):
        assert not copied.exists(), "the model loads while the key files are still on disk"
        raise Loading

    monkeypatch.setattr(startup, "load_model", load_model)
    parser = cli.build_parser()
    args = parser.parse_args(
        ["--model", "tiny", "--device", "cpu", "--bind", "tcp://127.0.0.1:*"]
        + ["--curve-secret-key", str(copied / "own" / "worker.key_secret"), "--trainer-keys", str(copied / "trainers")]
    )
    with pytest.raises(Loading):
        startup.start_worker(parser, args, keys_read=lambda: shutil.rmtree(copied))


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "needs authentication"),
        (["--curve-secret-key", "/nonexistent/worker.key_secret", "--authorized-keys", "/tmp"], "no such file"),
        (["--authorized-keys", "/tmp"], "need --curve-secret-key"),
    ],
)
def test_a_non_loopback_bind_needs_keys_or_insecure(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(startup, "load_model", lambda *a: pytest.fail("the model was loaded before the security check"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["--bind", "tcp://0.0.0.0:*", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_insecure_allows_a_non_loopback_bind(monkeypatch):
    """--insecure passes the security check (the model load is where this test stops)."""

    class Loaded(Exception):
        pass

    def stop(*args):
        raise Loaded

    monkeypatch.setattr(startup, "load_model", stop)
    with pytest.raises(Loaded):
        cli.main(["--bind", "tcp://0.0.0.0:*", "--insecure"])


def test_a_wrong_port_fails_fast_naming_the_address():
    """No worker at the address: the call fails after connect_timeout (not the 300 s call timeout), naming it, and
    live_workers() does not count a worker that never answered."""
    address = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with RolloutClient(address, connect_timeout=2) as client:
        assert client.live_workers() == []
        with pytest.raises(RolloutError) as error:
            client.generate(PromptGroup([1, 2], sampling=GREEDY))
        assert client.live_workers() == []
    assert error.value.code == "no_workers" and address in str(error.value) and "connect_timeout" in str(error.value)
    assert time.monotonic() - started < 10
