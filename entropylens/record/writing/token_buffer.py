"""Token rows waiting for their Parquet file.

Small updates share a file: rows are buffered until ``rows_per_file`` or the end of their step
(one file per update at scale, a handful of files per step for small batches). An update arrives
as its unpacked block (packed_block.HostUpdate) and its rows are selected when its file is
complete, together with the other updates of the file (packed_block.rows_of: one selection for a
step's same-shaped mini-batches instead of one per update); ready rows (a dict of columns) are
taken as they are. The blocks held so are bounded: past 2 x ``rows_per_file`` positions their
rows are selected at once (a sparse sample keeps few rows of many positions). Pure host
bookkeeping; the writer thread owns one buffer and writes what :meth:`add` / :meth:`flush` return.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np

from ..device.packed_block import HostUpdate, rows_of

# (step, (first update, last update), column arrays) of one file to write
FileRows = tuple[int, tuple[int, int], dict[str, np.ndarray]]
Rows: TypeAlias = HostUpdate | dict[str, np.ndarray]


class TokenBuffer:
    def __init__(self, rows_per_file: int):
        self.rows_per_file = max(1, int(rows_per_file))
        self._step = -1
        self._updates: list[tuple[int, int, Rows]] = []  # (first update, last update, rows) of self._step
        self._n_rows = 0
        self._held = 0  # positions of the HostUpdates in _updates

    def add(self, step: int, update: int, rows: Rows) -> list[FileRows]:
        """Buffer one update's rows (a HostUpdate: its selected rows; a dict: these columns, with
        their ``update`` column); returns the files that are complete now."""
        done = self.flush() if self._updates and self._step != step else []
        self._step = step
        if isinstance(rows, HostUpdate):
            positions = rows.flags.size
            if self._held and self._held + positions > 2 * self.rows_per_file:
                self._updates = [(self._updates[0][0], self._updates[-1][1], self._rows())]
                self._held = 0
            self._held += positions
            self._n_rows += rows.n_selected
        else:
            self._n_rows += len(rows["seq"])
        self._updates.append((update, update, rows))
        if self._n_rows >= self.rows_per_file:
            done += self.flush()
        return done

    def flush(self, upto: int | None = None) -> list[FileRows]:
        """The buffered rows as one file, if their step is <= upto (any step when None)."""
        if not self._updates or (upto is not None and self._step > upto):
            return []
        first, last = self._updates[0][0], self._updates[-1][1]
        rows = self._rows()
        self._updates, self._n_rows, self._held = [], 0, 0
        return [(self._step, (first, last), rows)]

    def _rows(self) -> dict[str, np.ndarray]:
        """The buffered rows as one set of columns, in order: runs of consecutive HostUpdates selected
        together (packed_block.rows_of)."""
        parts: list[dict[str, np.ndarray]] = []
        run: list[tuple[int, HostUpdate]] = []
        for update, _, rows in self._updates + [(0, 0, None)]:
            if isinstance(rows, HostUpdate):
                run.append((update, rows))
                continue
            if run:
                parts.append(rows_of([h for _, h in run], [u for u, _ in run]))
                run = []
            if rows is not None:
                parts.append(rows)
        return parts[0] if len(parts) == 1 else {name: np.concatenate([r[name] for r in parts]) for name in parts[0]}
