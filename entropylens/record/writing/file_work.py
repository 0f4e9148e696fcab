"""What each message does on the writer thread: the step table, the token buffer and the Parquet files.

:class:`FileWork` holds the writer thread's state (steps rows in the making, token rows waiting for
their file, inputs rejected once on the host) and one method per message kind (messages.py);
WriterThread's loop hands it each message in queue order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...storage import Location
from ..device import packed_block
from ..device.host_copy import DeferredBlock
from ..training.inputs import NonFiniteInput, duplicate_rows, duplicates_error
from . import parquet
from .messages import Close, Probes, Rewards, Scalars, Sequences, Summary, Update
from .step_table import StepTable
from .token_buffer import TokenBuffer


class FileWork:
    def __init__(
        self,
        run_dir: Path | Location,
        rank: int,
        *,
        rows_per_file: int,
        fsync: bool,
        histograms: bool,
        table_every: int,
        claim=None,
    ):
        self.run_dir, self.rank = run_dir, rank
        # run_claim.Claim: checked before each file (a writer whose run was taken over raises ClaimLostError)
        self._check_claim = claim.check if claim is not None else (lambda: None)
        # fsync: every file (and its directory) reaches the disk before the steps file that commits its
        # step is renamed into place, and that steps file before the next one: safe against power loss
        self.fsync = fsync
        # for the trackers (Recorder(log_histograms=, log_table_every=)): each update's tokens counted into
        # the step's histograms; on steps divisible by table_every (> 0) a sample of its token rows
        self.histograms, self.table_every = bool(histograms), int(table_every)
        self.rejected: list[ValueError] = []  # bad inputs found once the block reached the host
        self.committed: int | None = None  # the last step whose steps file is written (its rows all on disk)
        self._steps = StepTable()
        self._tokens = TokenBuffer(rows_per_file)

    def handlers(self) -> dict:
        """Message type -> the method that handles it."""
        return {
            Update: self.update,
            Scalars: self.scalars,
            Rewards: self.rewards,
            Sequences: self.sequences,
            Probes: self.probes,
            Close: self.close,
            Summary: self.summary,
        }

    def update(self, m: Update) -> None:
        block = m.copy.wait()  # a DeferredBlock builds it here (CPU): aggregates and packing off the caller
        assert m.copy.layout is not None  # an update's block: its layout is known once wait() returned it
        host = packed_block.unpack(block, m.copy.layout)
        bad = [name for name, ok in host.finite.items() if not ok]
        if bad:  # the update is dropped; the caller raises this at its next call
            self.rejected.append(NonFiniteInput(bad[0], m.step, m.update))
            return
        has_tokens = np.any(host.masked.reshape(host.layout.batch, host.layout.length), axis=1)  # [B]
        if not isinstance(m.copy, DeferredBlock):  # a device update's seq ids reach the host only here
            dup = duplicate_rows(host.seq, has_tokens)  # (a CPU update's were checked at the call)
            if len(dup):
                self.rejected.append(duplicates_error(f"step {m.step} update {m.update}", dup))
                return
        self._steps.add_trained(m.step, host.seq[has_tokens])
        self._steps.add_aggregates(m.step, m.update, host.aggregates)
        ratios = host.entropy_ratios()
        if ratios is not None:
            self._steps.add_entropy_ratios(m.step, ratios)
        if self.histograms:  # counts per update (bincount): no token arrays kept for them
            self._steps.add_histograms(m.step, ratios, *host.importance_ratios())
        if self.table_every > 0 and m.step % self.table_every == 0:
            self._steps.add_sample(m.step, m.update, host)
        # its rows are selected when its file is complete, with the file's other updates (token_buffer.py)
        for file_step, updates, arrays in self._tokens.add(m.step, m.update, host):
            self._check_claim()
            parquet.write_tokens(self.run_dir, file_step, self.rank, updates, arrays, fsync=self.fsync)

    def scalars(self, m: Scalars) -> None:
        values = m.values
        if isinstance(values, tuple):  # (floats, names, HostCopy of device scalars [k] float64)
            floats, names, copy = values
            values = {**floats, **dict(zip(names, copy.wait().tolist()))}
        if m.update is None:
            self._steps.add_step_scalars(m.step, values)
        else:
            self._steps.add_update_scalars(m.step, m.update, values)

    def rewards(self, m: Rewards) -> None:
        self._steps.add_rewards(m.step, m.total, m.count)

    def sequences(self, m: Sequences) -> None:
        self._check_claim()
        parquet.write_sequences(self.run_dir, m.step, self.rank, m.part, m.arrays, fsync=self.fsync)
        self._steps.add_sequence_rows(m.step, m.arrays["seq"])

    def probes(self, m: Probes) -> None:
        self._check_claim()
        parquet.write_probes(self.run_dir, m.step, self.rank, m.update, m.rows, fsync=self.fsync)

    def close(self, m: Close) -> None:
        for file_step, updates, arrays in self._tokens.flush(m.upto):
            self._check_claim()
            parquet.write_tokens(self.run_dir, file_step, self.rank, updates, arrays, fsync=self.fsync)
        for step, rows in self._steps.close(m.upto):
            self._check_claim()
            parquet.write_steps(self.run_dir, step, self.rank, rows, fsync=self.fsync)
            self.committed = step

    def untrained(self) -> tuple[list[tuple[int, int]], int]:
        """(step, seq id) of the sequences rows no update at their step or later trained, and how many more."""
        return self._steps.untrained(), self._steps.untrained_over

    def summary(self, m: Summary) -> None:
        m.reply.set(self._steps.summary(m.step, m.names))
