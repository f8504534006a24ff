"""The running requests' block tables, kept in one persistent host table: a step gathers its rows.

Each request that runs through the model gets a row at its first step and keeps it until it finishes; the row is
rewritten only when the request's blocks change (`Request.blocks_version`: once per `block_size` tokens while it
decodes), so a step's block table costs one pass over its requests plus one gather, whatever their context length.

Invariant: a row's entries past the request's `len(block_ids)` are stale (blocks it held before a preemption, or
zero) and never read: attention reads only the blocks that hold positions before a sequence's end, and every entry
is a valid block index.
"""

from __future__ import annotations

import torch

from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import Request


class BlockTables:
    """Persistent host block tables, one row per running request (see the module docstring)."""

    def __init__(self, rows: int = 64, columns: int = 16):
        """
        Args:
            rows: rows allocated at first; the table doubles when a request finds none free.
            columns: columns allocated at first; the table doubles when a request holds more blocks.
        """
        self._table = torch.zeros(rows, columns, dtype=torch.int32)
        self._numpy = self._table.numpy()  # the same memory: element writes through numpy cost far less
        self._versions = [-1] * rows  # blocks_version each row was written at
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_live(self) -> int:
        """Rows held by requests that have not finished."""
        return len(self._versions) - len(self._free)

    def gather(self, requests: list[Request]) -> torch.Tensor:
        """The requests' block tables as one (len(requests), widest) int32 CPU tensor (a fresh tensor: the caller
        may hand it to an asynchronous copy), writing the rows whose blocks changed first.

        Args:
            requests: the step's requests, in row order.
        """
        rows = []
        width = 1
        versions = self._versions
        for request in requests:
            row = request.block_table_row
            if row < 0 or versions[row] != request.blocks_version:
                row = self._write(request)
            rows.append(row)
            if len(request.block_ids) > width:
                width = len(request.block_ids)
        return self._table[:, :width].index_select(0, to_device(rows, torch.long, "cpu"))

    def release(self, request: Request) -> None:
        """Give back a finished request's row (no-op when it never had one)."""
        row = request.block_table_row
        if row >= 0:
            request.block_table_row = -1
            self._versions[row] = -1
            self._free.append(row)

    def _write(self, request: Request) -> int:
        row = request.block_table_row
        if row < 0:
            if not self._free:
                self._grow_rows()
            row = request.block_table_row = self._free.pop()
        block_ids = request.block_ids
        if len(block_ids) > self._table.shape[1]:
            self._grow_columns(len(block_ids))
        self._numpy[row, : len(block_ids)] = block_ids
        self._versions[row] = request.blocks_version
        return row

    def _grow_rows(self) -> None:
        old = self._table.shape[0]
        self._table = torch.cat([self._table, torch.zeros_like(self._table)])
        self._numpy = self._table.numpy()
        self._versions += [-1] * old
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_columns(self, needed: int) -> None:
        columns = self._table.shape[1]
        while columns < needed:
            columns *= 2
        grown = torch.zeros(self._table.shape[0], columns, dtype=torch.int32)
        grown[:, : self._table.shape[1]] = self._table
        self._table, self._numpy = grown, grown.numpy()
