"""rollout-keygen never writes into a file planted at its name (pyzmq opens the key files without O_EXCL: a file
another user created at the secret's name after keygen's check would have received the secret), with hard links or
without.

rollout-keygen on a file system without hard links (FAT, some FUSE and network mounts: os.link fails with EPERM,
EXDEV or ENOTSUP there). keygen writes the pair in a private folder and links it into place; where no link can be
made it failed with a traceback and wrote no key. The pair must still be written there, loadable by pyzmq, the secret
owner-only, and a file planted at the secret's name still never written into."""

from __future__ import annotations

import errno
import os

import pytest
import zmq.auth

from rollout.protocol.auth import keygen_main


def _refuse(source, destination, *args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted", os.fspath(source), None, os.fspath(destination))


@pytest.fixture
def no_hard_links(monkeypatch):
    monkeypatch.setattr(os, "link", _refuse)


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_keygen_writes_the_pair_without_hard_links(tmp_path, monkeypatch, no_hard_links, relative):
    monkeypatch.chdir(tmp_path)
    directory = "keys" if relative else str(tmp_path / "keys")
    assert keygen_main([directory, "fresh"]) == 0
    folder = tmp_path / "keys"
    assert sorted(path.name for path in folder.iterdir()) == ["fresh.key", "fresh.key_secret"]  # no temp folder
    public, secret = zmq.auth.load_certificate(folder / "fresh.key_secret")
    assert secret is not None and zmq.auth.load_certificate(folder / "fresh.key") == (public, None)
    assert (folder / "fresh.key_secret").stat().st_mode & 0o777 == 0o600
    assert (folder / "fresh.key").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_keygen_never_writes_into_a_file_planted_at_its_name(tmp_path, monkeypatch, capsys, links):
    if not links:
        monkeypatch.setattr(os, "link", _refuse)
    created = zmq.auth.create_certificates
    planted = tmp_path / "fresh.key_secret"

    def racing(directory, name):
        planted.write_text("planted")  # between keygen's check and its writing
        return created(directory, name)

    monkeypatch.setattr(zmq.auth, "create_certificates", racing)
    with pytest.raises(SystemExit) as exited:
        keygen_main([str(tmp_path), "fresh"])
    assert exited.value.code == 2 and "refusing to overwrite a key" in capsys.readouterr().err
    assert planted.read_text() == "planted"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fresh.key_secret"]  # no half pair, no temp folder
