"""Compaction: a run's many small per-step files rewritten into few large ones, without a reader
ever double-counting or missing rows.

Layout and commit rule (readers: catalog.py):

    RUN/compacted/tokens/steps-LO-HI.part-K.parquet      step and rank stored as columns,
    RUN/compacted/sequences/steps-LO-HI.part-K.parquet   sorted by (step, rank, file), large row groups
    RUN/compacted/steps/steps-LO-HI.parquet              the steps rows of LO..HI: THE COMMIT

1. Only *final* steps are compacted: every step of a run that is no longer running, or, while it
   runs, a step that every rank has committed (its steps file exists) — the recorder never writes
   a committed step again.
2. The data parts are written first (each atomically: rename, or one PUT / a completed multipart
   upload), then the compacted steps file, which commits LO..HI. Before the commit readers use the
   originals; after it they use the compacted files and ignore the originals of LO..HI.
3. After ``grace_s`` seconds (queries planned on the old listing finish) the originals of LO..HI
   are removed. A reader that lists while they vanish sees the commit too (catalog lists
   ``compacted/`` before and after the originals and lists again if it changed).
4. Parts without a commit file belong to a compaction that died; the next compaction removes them.
   Parts whose commit file exists but is unreadable (truncated) are kept: with the originals gone they
   are the only copy (readers warn); with the originals still there readers use those, and the range
   is not compacted again until the unreadable commit file and its parts are removed by hand.
   One compactor per run at a time.
   A compaction killed after its commit and before removing the originals (during the grace wait) is
   finished by the next one: the originals of committed ranges still on disk (catalog: ``superseded``)
   are removed once ``grace_s`` has passed since that commit file was written.
   Hidden temporaries ``.NAME.PID.TID.tmp`` (storage.Location.write_with) of a process that died are
   removed too, when no process can still own them: the PID is not alive on this host and the file is
   in ``compacted/`` (this compactor's own folder) or the run is no longer running (closed, failed, or
   stale: no writer left on any host). A live process's temporary is never touched; one of a running
   run is kept (its writer may be on another host).
5. A step with an unreadable file (a damaged steps file, token or sequence file), or with token or
   sequence files but no steps file for some rank (its intact token files must not be taken for hidden
   ones, compacted over and deleted), is left alone: no range includes or straddles it, nothing of it is
   removed, and a :class:`StepLeftAloneWarning` names it. Only files whose rows are in the compacted
   output are ever removed.

Readers that planned on the originals before a compaction removed them re-plan once when a query
finds a file gone (entropylens/read/lockdown.py, ``replan``); the compactor keeps no registry of readers.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from ..record.writing.parquet import FILE_META, TOKEN_DICT_COLUMNS, TOKEN_FLOAT_COLUMNS, parquet_options
from ..storage import Location, location
from . import catalog as cat
from .query import UnreadableFileWarning, run_status

ROW_GROUP_ROWS = 1 << 20  # ~1M rows per row group: large sequential reads, still prunable by step
FILE_BYTES = 512 << 20  # compacted part size target (bytes of the original files it replaces)
_DICT = {"tokens": TOKEN_DICT_COLUMNS, "sequences": ("group",)}
_FLOAT = {"tokens": TOKEN_FLOAT_COLUMNS}


class StepLeftAloneWarning(UnreadableFileWarning):
    """A step was not compacted: one of its files is unreadable, or a rank of it has no steps file."""


@dataclass
class Compacted:
    run: str
    steps: tuple[int, int] | None  # the range committed by this call (None: nothing to do)
    files_in: int = 0
    files_out: int = 0
    rows: int = 0  # token rows rewritten
    removed: int = 0  # original files removed
    note: str = ""
    finished: list[tuple[int, int]] = field(default_factory=list)  # earlier compactions whose originals it removed
    temps: int = 0  # stale temporary files removed

    def summary(self) -> str:
        if self.finished:
            ranges = ", ".join(f"{lo}-{hi}" for lo, hi in self.finished)
            line = (
                f"{self.run}: finished the interrupted compaction of steps {ranges}: {self.removed} superseded "
                "originals removed"
            )
        elif self.steps is None:
            line = f"{self.run}: nothing to compact ({self.note})"
        else:
            lo, hi = self.steps
            line = (
                f"{self.run}: steps {lo}-{hi}: {self.files_in} files -> {self.files_out} "
                f"({self.rows:,} token rows), {self.removed} originals removed"
            )
        if self.temps:
            line += f"; {self.temps} stale temporary file{'s' if self.temps != 1 else ''} removed"
        return line


def compact(
    path,
    runs: list[str] | None = None,
    *,
    grace_s: float = 10.0,
    file_bytes: int = FILE_BYTES,
    row_group_rows: int = ROW_GROUP_ROWS,
    storage_options: dict | None = None,
) -> list[Compacted]:
    """Compact every run under ``path`` (or only ``runs``); see the module docstring."""
    snap = cat.scan(path, runs, storage_options=storage_options)
    out = []
    for r in snap.runs:
        _remove_orphans(r)
        temps = _remove_stale_temps(r)
        blocked = _blocked_steps(r, snap.bad)
        for u, why in cat.row_count_problems(r, cat.recorded_tokens(r)):  # a copy under a recorder's name
            m = re.search(r"/step=(-?\d+)/", u)
            assert m is not None  # u: the folder of a step's token files, .../step=S/rank=R/ (row_count_problems)
            blocked.setdefault(int(m.group(1)), why)
        final = _final_steps(r)
        for s, why in sorted(blocked.items()):
            if final and s <= max(final) or run_status(r.info) != "running":
                warnings.warn(
                    f"{r.id}: step {s} not compacted, its files are left as they are: {why}",
                    StepLeftAloneWarning,
                    stacklevel=2,
                )
        done = [_finish_interrupted(r, grace_s)] if r.superseded else []
        segments = _segments(r, set(blocked))
        done += [_compact_or_leave(r, lo, hi, grace_s, file_bytes, row_group_rows) for lo, hi in segments]
        if not done:
            done = [Compacted(r.id, None, note="no final uncompacted step")]
        done[0].temps = temps
        out += done
    return out


def _covering(r: cat.RunFiles, url: str) -> tuple[int, int]:
    step = _step_rank(url)[0]
    return next(rng for rng in r.ranges if rng[0] <= step <= rng[1])


def _written_at(loc: Location) -> float | None:
    """When the file at ``loc`` was written (seconds since the epoch), or None if the store does not say."""
    try:
        if not loc.remote:
            return os.stat(loc.path).st_mtime
        info = loc.fs.info(loc.path)
    except OSError:
        return None
    for key in ("mtime", "LastModified", "last_modified", "updated"):
        v = info.get(key)
        if hasattr(v, "timestamp"):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _commit_pairs(commit: Location) -> set[tuple[int, int]]:
    """The (step, rank) pairs whose steps rows a compaction commit file holds: the pairs it compacted."""
    cols = ["step", "rank"]
    if not commit.remote:
        t = pq.read_table(commit.path, columns=cols)
    else:
        with commit.fs.open(commit.path, "rb") as f:
            t = pq.read_table(f, columns=cols)
    return set(zip(t.column("step").to_pylist(), t.column("rank").to_pylist()))


def _finish_interrupted(r: cat.RunFiles, grace_s: float) -> Compacted:
    """Remove the originals of committed ranges still on disk (an earlier compaction was killed in its
    grace wait), once ``grace_s`` has passed since their commit (rule 4): queries planned before the
    commit had the grace to finish, as on the normal path. Only files of a (step, rank) that the commit
    holds are removed (their rows are in the compacted parts); any other is left with a warning (rule 5)."""
    ranges = sorted({_covering(r, u) for u in r.superseded})
    res = Compacted(r.id, None, finished=ranges)
    commits = [r.dir / cat.COMPACTED / "steps" / f"steps-{lo}-{hi}.parquet" for lo, hi in ranges]
    pairs = set().union(*(_commit_pairs(c) for c in commits))
    originals = [u for u in r.superseded if _step_rank(u) in pairs]
    for u in sorted(set(r.superseded) - set(originals)):
        warnings.warn(
            f"{r.id}: {u} is not removed: its step and rank are in no compacted file (its rows would "
            "be lost); move it aside or remove it by hand",
            StepLeftAloneWarning,
            stacklevel=3,
        )
    times = [_written_at(c) for c in commits]
    if grace_s > 0:
        known = [t for t in times if t is not None]
        newest = None if len(known) < len(times) else max(known)
        wait = grace_s if newest is None else min(grace_s, newest + grace_s - time.time())
        if wait > 0:
            time.sleep(wait)
    return _remove_originals(r, res, originals)


_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.(?P<tid>\d+)\.tmp$")  # storage.Location.write_with


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's process counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # exists but is not ours (or not a pid this host has): never touch its file
    return True


def _remove_stale_temps(r: cat.RunFiles) -> int:
    """Remove the run's hidden temporaries that no process can still own (module docstring, rule 4);
    returns how many. Object stores have none (a file appears whole in one PUT)."""
    if r.dir.remote:
        return 0
    running = run_status(r.info) == "running"
    n = 0
    for dirpath, _dirs, filenames in os.walk(r.dir.path):
        rel = os.path.relpath(dirpath, r.dir.path).replace(os.sep, "/")
        ours = rel == cat.COMPACTED or rel.startswith(cat.COMPACTED + "/")
        for f in filenames:
            m = _TEMP.match(f)
            if not m or _alive(int(m.group("pid"))) or (running and not ours):
                continue
            try:
                os.unlink(os.path.join(dirpath, f))
                n += 1
            except FileNotFoundError:
                pass
    return n


def _step_rank(url: str) -> tuple[int, int]:
    return cat.step_rank(url)


def _final_steps(r: cat.RunFiles) -> list[int]:
    """Committed steps that no writer will touch again (rule 1)."""
    committed: dict[int, set[int]] = {}
    for u in r.files.get("steps", []):
        s, k = _step_rank(u)
        committed.setdefault(k, set()).add(s)
    steps = sorted(set().union(*committed.values())) if committed else []
    if run_status(r.info) != "running":
        return steps
    ranks = set(range(int(r.info.get("world_size") or 1))) | set(committed)
    if any(k not in committed for k in ranks):
        return []
    upto = min(max(v) for v in committed.values())
    return [s for s in steps if s <= upto]


def _blocked_steps(r: cat.RunFiles, bad: list[tuple[str, str]]) -> dict[int, str]:
    """Steps left alone (rule 5) -> why: a file of the step is unreadable, or a (step, rank) has token /
    sequence files but no steps file (catalog: ``hidden``)."""
    out: dict[int, str] = {}
    prefix = r.dir.url().rstrip("/") + "/"
    for u, why in bad:
        m = cat._HIVE.search(u)
        if m and u.startswith(prefix):
            out.setdefault(int(m.group(1)), f"{u}: {why}")
    for u in r.hidden:
        out.setdefault(_step_rank(u)[0], f"{u} has no readable steps file for its step and rank")
    return out


def _segments(r: cat.RunFiles, blocked: AbstractSet[int] = frozenset()) -> list[tuple[int, int]]:
    """Final steps not yet compacted, as ranges that do not straddle a compacted range or a step
    left alone (``blocked``, rule 5)."""
    segs: list[list[int]] = []
    done = r.ranges + r.broken  # a broken commit's range is left alone (its parts are not overwritten)
    done = done + [(b, b) for b in blocked]
    for s in _final_steps(r):
        if any(lo <= s <= hi for lo, hi in done):
            continue
        if segs and not any(segs[-1][-1] < lo <= s for lo, _ in done):
            segs[-1].append(s)
        else:
            segs.append([s])
    return [(g[0], g[-1]) for g in segs]


def _remove_orphans(r: cat.RunFiles) -> None:
    comp = r.dir / cat.COMPACTED
    if not comp.exists():
        return
    for p in comp.files():
        m = cat._COMPACT_NAME.search(p)
        rng = (int(m.group(1)), int(m.group(2))) if m else None
        if m and rng not in r.ranges and rng not in r.broken:  # a broken commit's parts may be the only copy
            r.dir.at(p).remove()


def _read(loc: Location, url: str) -> pa.Table:
    if not loc.remote:
        return pq.ParquetFile(url).read()
    with loc.fs.open(loc.at(url.split("://", 1)[1]).path, "rb") as f:
        return pq.ParquetFile(f).read()


def _group_schema(loc: Location, urls: list[str]) -> pa.Schema:
    """The columns of ``urls`` together, from their footers, in first-seen order, step and rank first: a
    run resumed by another version has files with and without a newer column (NULL where a file lacks
    it). Files whose columns disagree on a type (the catalog leaves out a contract column of the wrong
    type, so only unknown columns can) are not compacted."""
    fields: dict[str, pa.Field] = {"step": pa.field("step", pa.int32()), "rank": pa.field("rank", pa.int16())}
    for u in urls:
        if not loc.remote:
            schema = pq.read_schema(u)
        else:
            with loc.fs.open(loc.at(u.split("://", 1)[1]).path, "rb") as f:
                schema = pq.ParquetFile(f).schema_arrow
        for f in schema:
            if f.name in ("step", "rank"):
                continue
            had = fields.setdefault(f.name, f)
            if had.type != f.type:
                raise ValueError(
                    f"files of one run disagree on the type of column {f.name!r} ({had.type} and "
                    f"{f.type}); not compacted"
                )
    return pa.schema(list(fields.values()))


def _with_keys(t: pa.Table, step: int, rank: int) -> pa.Table:
    n = t.num_rows
    t = t.drop_columns([c for c in ("step", "rank") if c in t.column_names])
    return t.add_column(0, "rank", pa.array([rank] * n, pa.int16())).add_column(
        0, "step", pa.array([step] * n, pa.int32())
    )


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """``t`` with ``schema``'s columns in order (absent ones as nulls)."""
    extra = set(t.column_names) - set(schema.names)
    if extra:
        raise ValueError(f"files of one run disagree on columns ({', '.join(sorted(extra))}); not compacted")
    cols = [t.column(f.name) if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def _write_parts(
    r: cat.RunFiles, table: str, files: list[str], lo: int, hi: int, file_bytes: int, row_group_rows: int
) -> tuple[int, int]:
    """The files of one table for steps lo..hi -> compacted parts. Returns (parts, rows)."""
    files = sorted(files, key=lambda u: (*_step_rank(u), u))
    groups: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for u in files:  # parts of about file_bytes, never splitting a (step, rank)
        if cur and size >= file_bytes and _step_rank(u) != _step_rank(cur[-1]):
            groups.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += r.sizes.get(u, 0)
    if cur:
        groups.append(cur)
    rows = 0
    for k, group in enumerate(groups):
        dest = r.dir / cat.COMPACTED / table / f"steps-{lo}-{hi}.part-{k}.parquet"

        def fill(tmp: str, group=group) -> None:
            writer, schema, buf, n = None, None, [], 0
            columns = _group_schema(r.dir, group)  # every column of the group: a run resumed by another version
            for u in group:
                t = _with_keys(_read_whole(r.dir, u), *_step_rank(u))
                if schema is None:
                    schema = columns.with_metadata({**(t.schema.metadata or {}), **FILE_META})
                    opts = parquet_options(
                        schema.names,
                        dict_columns=(*_DICT.get(table, ()), "step", "rank"),
                        float_columns=_FLOAT.get(table, ()),
                        plain_floats=True,
                    )
                    writer = pq.ParquetWriter(tmp, schema, **opts)
                assert writer is not None  # opened at the group's first file, above
                buf.append(_conform(t, schema))
                n += t.num_rows
                if n >= row_group_rows:
                    writer.write_table(pa.concat_tables(buf), row_group_size=row_group_rows)
                    buf, n = [], 0
            assert writer is not None  # a group holds at least one file (groups are made of non-empty cur)
            if buf:
                writer.write_table(pa.concat_tables(buf), row_group_size=row_group_rows)
            writer.close()

        dest.write_with(fill)
        if table == "tokens":
            rows += _rows(dest)
    return len(groups), rows


def _rows(loc: Location) -> int:
    if not loc.remote:
        return pq.read_metadata(loc.path).num_rows
    with loc.fs.open(loc.path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


class _Unreadable(Exception):
    """A file of the range could not be read to its last page (a damaged page behind an intact footer)."""

    def __init__(self, url: str, error: Exception):
        super().__init__(url)
        self.url, self.error = url, error


def _read_whole(loc: Location, url: str) -> pa.Table:
    try:
        return _read(loc, url)
    except (OSError, pa.ArrowException) as e:
        raise _Unreadable(url, e) from None


def _remove_parts(r: cat.RunFiles, lo: int, hi: int) -> None:
    """The parts of steps lo..hi written so far (their commit was not written)."""
    comp = r.dir / cat.COMPACTED
    for p in comp.files() if comp.exists() else ():
        m = cat._COMPACT_NAME.search(p)
        if m and m.group(3) is not None and (int(m.group(1)), int(m.group(2))) == (lo, hi):
            r.dir.at(p).remove()


def _compact_or_leave(
    r: cat.RunFiles, lo: int, hi: int, grace_s: float, file_bytes: int, row_group_rows: int
) -> Compacted:
    """:func:`_compact_range`, or, where a file of the range cannot be read, the range left as it is: its
    parts written so far removed (no commit was written), one warning naming the file and what to do."""
    try:
        return _compact_range(r, lo, hi, grace_s, file_bytes, row_group_rows)
    except _Unreadable as e:
        _remove_parts(r, lo, hi)
        why = str(e.error).strip().splitlines()[0] if str(e.error).strip() else type(e.error).__name__
        warnings.warn(
            f"{r.id}: steps {lo}-{hi} not compacted, their files are left as they are: reading {e.url} "
            f"fails ({why}): move it out of the run folder and compact again (`entropylens verify` lists "
            "every damaged file)",
            StepLeftAloneWarning,
            stacklevel=3,
        )
        return Compacted(r.id, None, note=f"steps {lo}-{hi} left as they are (a damaged file)")


def _compact_range(
    r: cat.RunFiles, lo: int, hi: int, grace_s: float, file_bytes: int, row_group_rows: int
) -> Compacted:
    res = Compacted(r.id, (lo, hi))
    chosen = {t: [u for u in files if lo <= _step_rank(u)[0] <= hi] for t, files in r.files.items()}
    for table in sorted(t for t in chosen if t != "steps"):  # data parts first ...
        if chosen[table]:
            parts, rows = _write_parts(r, table, chosen[table], lo, hi, file_bytes, row_group_rows)
            res.files_out += parts
            res.rows += rows
    steps = [_with_keys(_read_whole(r.dir, u), *_step_rank(u)) for u in sorted(chosen.get("steps", []), key=_step_rank)]
    commit = pa.concat_tables(steps, promote_options="default")
    commit = commit.replace_schema_metadata({**(commit.schema.metadata or {}), **FILE_META})
    (r.dir / cat.COMPACTED / "steps" / f"steps-{lo}-{hi}.parquet").write_with(
        lambda tmp: pq.write_table(commit, tmp, **parquet_options(commit.column_names))
    )  # ... the commit last
    res.files_out += 1
    originals = [u for files in chosen.values() for u in files]  # exactly the files whose rows were written
    # (never r.hidden: an uncommitted (step, rank)'s rows are in no compacted file; rule 5)
    originals += [u for u in r.superseded if lo <= _step_rank(u)[0] <= hi]
    res.files_in = sum(len(v) for v in chosen.values())
    if grace_s > 0:
        time.sleep(grace_s)  # queries planned on the old listing finish
    return _remove_originals(r, res, originals)


def _remove_originals(r: cat.RunFiles, res: Compacted, originals: list[str]) -> Compacted:
    """Remove the original files a committed compaction superseded (counted in ``res``), then the empty
    folders they leave."""
    for u in originals:
        location(u, r.dir.options).remove()
        res.removed += 1
    if not r.dir.remote:
        _prune_empty_dirs(r.dir)
    return res


def _prune_empty_dirs(d: Location) -> None:
    import os

    for table in os.listdir(d.path):
        top = os.path.join(d.path, table)
        if table == cat.COMPACTED or not os.path.isdir(top):
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda x: -len(x[0])):
            if dirpath != top:
                try:
                    os.rmdir(dirpath)  # only succeeds when empty
                except OSError:
                    pass


__all__ = ["Compacted", "compact"]
