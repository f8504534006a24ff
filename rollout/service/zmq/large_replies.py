"""Large replies encoded over several turns of the serving loop: a group result of more than `STEPWISE_TOKENS`
tokens waits in its client's backlog as an `Encoding` (`ClientLinks`), encoded by `encode_steps` a few milliseconds
per turn, so that one client's huge result does not hold back the others' replies."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from dataclasses import dataclass

from rollout import protocol as p

logger = logging.getLogger(__name__)

# A group result of more tokens than this is encoded in steps, at most ENCODE_TURN_S of them per loop turn, so that
# one client's huge result (1,024 samples of 2,047 tokens: about 190 ms to encode) does not hold back the others'.
STEPWISE_TOKENS = 16_384
ENCODE_TURN_S = 0.005


def is_large(message: p.Message) -> bool:
    """Whether `message` is encoded in steps (a group result of more than `STEPWISE_TOKENS` tokens).

    Args:
        message: a reply.
    """
    return isinstance(message, p.GroupResult) and sum(len(c.token_ids) for c in message.completions) > STEPWISE_TOKENS


@dataclass
class Encoding:
    """A large reply being encoded over several loop turns; it holds its client's place in the backlog."""

    message: p.GroupResult
    steps: Generator[None, None, list[bytes]]
    counted: int = 0  # bytes counted for it while it waits behind replies ZeroMQ refused (an estimate)

    def estimated_bytes(self) -> int:
        """About the bytes its frames will hold once encoded (what it waits in the backlog as then): a token's id and
        log-prob take at most 14 bytes of msgpack; arrays (routes, top and prompt log-probs) travel in frames of their
        own. Not its Python objects' memory (about 80 bytes a token): the engine made them for the client's own group
        whether or not it reads, and counted so, a step's 128 groups of 16 samples of 2,048 tokens waiting to be encoded
        (333 MB) dropped a trainer that read every reply, as over the 256 MiB default."""
        completions = self.message.completions
        frames = getattr(self.message, "data_frames", ())
        return 14 * sum(len(c.token_ids) for c in completions) + 64 * len(completions) + sum(map(len, frames))

    def encoded(self, ends: float | None) -> list[bytes] | None:
        """Encode on until done (returns the frames) or until `ends` (returns None); one step at least, so that each
        turn gets it further.

        Args:
            ends: a `time.monotonic()` value; None: to the end.
        """
        try:
            next(self.steps)
            while ends is None or time.monotonic() < ends:
                next(self.steps)
            return None
        except StopIteration as done:
            return done.value
        except Exception as error:  # noqa: BLE001 - a reply that cannot be encoded must not end the serving loop
            return unencodable_reply(self.message, error)


def unencodable_reply(message: p.Message, error: Exception) -> list[bytes]:
    """The frames of the "internal" error reply sent in place of a reply that could not be encoded (logged).

    Args:
        message: the reply that could not be encoded.
        error: why.
    """
    logger.error("cannot encode a %s reply", message.TYPE, exc_info=error)
    ids = getattr(message, "group_id", None), getattr(message, "update_id", None)
    return p.encode(p.Error("internal", f"the {message.TYPE} reply could not be encoded: {error}", None, *ids))
