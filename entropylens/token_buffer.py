"""Token rows waiting for their Parquet file.

Small updates share a file: rows are buffered until ``rows_per_file`` or the end of their step
(one file per update at scale, a handful of files per step for small batches). Pure host
bookkeeping; the writer thread owns one buffer and writes what :meth:`add` / :meth:`flush` return.
"""

from __future__ import annotations

import numpy as np

# (step, (first update, last update), column arrays) of one file to write
FileRows = tuple[int, tuple[int, int], dict[str, np.ndarray]]


class TokenBuffer:
    def __init__(self, rows_per_file: int):
        self.rows_per_file = max(1, int(rows_per_file))
        self._step = -1
        self._updates: list[tuple[int, dict[str, np.ndarray]]] = []  # (update, rows) of self._step
        self._n_rows = 0

    def add(self, step: int, update: int, rows: dict[str, np.ndarray]) -> list[FileRows]:
        """Buffer one update's rows; returns the files that are complete now."""
        done = self.flush() if self._updates and self._step != step else []
        self._step = step
        self._updates.append((update, rows))
        self._n_rows += len(rows["seq"])
        if self._n_rows >= self.rows_per_file:
            done += self.flush()
        return done

    def flush(self, upto: int | None = None) -> list[FileRows]:
        """The buffered rows as one file, if their step is <= upto (any step when None)."""
        if not self._updates or (upto is not None and self._step > upto):
            return []
        buffered, self._updates, self._n_rows = self._updates, [], 0
        first, last = buffered[0][0], buffered[-1][0]
        if len(buffered) == 1:
            rows = buffered[0][1]
        else:
            rows = {name: np.concatenate([r[name] for _, r in buffered]) for name in buffered[0][1]}
        return [(self._step, (first, last), rows)]
