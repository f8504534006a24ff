"""The CurveZMQ keys of one fleet: a key pair the workers share and one for its trainers (the fleet's clients and the
workers' peer weight copies). Made fresh per fleet on the driver, they travel to the actors as certificate text (Ray
carries actor arguments over its own authenticated channels) and are written to a private directory on each node.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq.auth


@dataclass(frozen=True)
class FleetKeys:
    """Certificate files' text: the workers' pair, the trainers' pair and public key."""

    worker_secret: str  # the workers' `.key_secret` file
    trainer_secret: str  # the trainers' `.key_secret` file
    trainer_public: str  # the trainers' `.key` file

    @classmethod
    def generate(cls) -> FleetKeys:
        """A new fleet's keys."""
        directory = tempfile.mkdtemp(prefix="rollout-fleet-keys-")
        try:
            _, worker_secret = zmq.auth.create_certificates(directory, "worker")
            trainer_public, trainer_secret = zmq.auth.create_certificates(directory, "trainer")
            return cls(
                Path(worker_secret).read_text(), Path(trainer_secret).read_text(), Path(trainer_public).read_text()
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def write(self, directory: str | os.PathLike) -> KeyFiles:
        """Write the certificates under `directory` (readable by this user only); return their paths."""
        root = Path(directory)
        trainers = root / "trainers"
        trainers.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        files = KeyFiles(str(root / "worker.key_secret"), str(trainers), str(root / "trainer.key_secret"))
        for path, text in (
            (files.worker_secret, self.worker_secret),
            (files.trainer_secret, self.trainer_secret),
            (str(trainers / "trainer.key"), self.trainer_public),
        ):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
                handle.write(text)
        return files


@dataclass(frozen=True)
class KeyFiles:
    """Where `FleetKeys.write` put the certificates."""

    worker_secret: str  # rollout-worker --curve-secret-key; the clients' server_public_key is its public half
    trainer_keys: str  # rollout-worker --trainer-keys
    trainer_secret: str  # RolloutClient(curve_secret_key=...)
