"""`weights_spec`'s answer: the tensors a weight update may target (names, dtypes, shapes; built once, kept in their
wire form: a 20k-tensor MoE model's took 40 ms to convert each time), the policy version, the base's names and the
served adapters. Any client may ask, often."""

from __future__ import annotations

from typing import Any

from rollout import protocol as p
from rollout.engine.engine import Engine
from rollout.protocol.codec import to_plain
from rollout.service.weights.served_base import ServedBase


class SpecAnswers:
    """Answers `weights_spec` for one engine."""

    def __init__(self, engine: Engine):
        """
        Args:
            engine: the worker's engine (its weight table and adapters are read).
        """
        self.engine = engine
        self._table: tuple[list[p.TensorSpec], list[dict[str, Any]]] | None = None

    def reply(self, update_id: str, base: ServedBase) -> p.WeightsSpecReply:
        """The answer to `weights_spec` `update_id`.

        Args:
            update_id: the id the question carried.
            base: the names of the base weights served.
        """
        engine = self.engine
        if self._table is None:  # names, dtypes and shapes never change: built once, sent as built
            specs = [p.TensorSpec(n, d, list(s)) for n, (d, s) in engine.weight_table.specs().items()]
            self._table = specs, to_plain(specs)
        specs, plain_specs = self._table
        adapters = {name: ref.version for name, ref in list(engine.runner.adapters.refs.items())}
        reply = p.WeightsSpecReply(update_id, specs, engine.policy_version, base.base_id, adapters, list(base.aliases))
        reply.plain_fields = {"tensors": plain_specs}
        return reply
