"""Which files a reader uses: one consistent listing of the runs under a path (a snapshot).

Rules (docs/design.md, "Reading"):

1. **Runs** are the directories holding a ``run.json``, found by :func:`find_runs`'s walk (which
   folders it leaves out: its docstring). An unreadable run.json skips that run (it is reported as a
   bad file); the other runs are read.
2. **Bad files** (empty, truncated, not Parquet: no ``PAR1`` magic at the end) are skipped and
   reported; everything else stays queryable. ``check="full"`` (``entropylens verify``) also parses
   each file's footer and reads its pages.
3. **Step commit.** A step's steps file is written after its token and sequence files, so a
   ``(step, rank)`` is committed when ``steps/step=S/rank=R/steps.parquet`` exists. Token and sequence
   files of an uncommitted ``(step, rank)`` are hidden (a run killed between the two shows neither).
   The steps directory is listed *before* the others, so every file of a committed step is seen.
4. **Compaction** (compact.py) writes ``compacted/<table>/steps-LO-HI.part-K.parquet`` (step and rank
   are columns there) and then ``compacted/steps/steps-LO-HI.parquet``, which commits steps LO..HI.
   For a committed range the compacted files are read and the original files of those steps are
   ignored (whether or not they were removed yet); compacted parts without their commit file (a
   compaction that died) are ignored. ``compacted/`` is listed first and again last: if a commit
   appeared meanwhile the listing is redone, so originals removed after a commit are never missed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from ..storage import Location, location

TABLE_DIRS = ("steps", "sequences", "tokens", "probes")  # Hive-partitioned tables of a run
COMMITTED_BY_STEPS = ("sequences", "tokens", "probes")  # written before the steps file of their step
COMPACTED = "compacted"
_HIVE = re.compile(r"/step=(-?\d+)/rank=(-?\d+)/[^/]+\.parquet$")
_COMPACT_NAME = re.compile(r"steps-(\d+)-(\d+)(?:\.part-(\d+))?\.parquet$")
_MAGIC = b"PAR1"
_GONE = "removed while listing"


class QueryError(ValueError):
    """A user-facing query problem (bad path, unknown analysis, bad parameter, bad SQL)."""


@dataclass
class RunFiles:
    """The files of one run that a reader uses (URLs), and what it leaves out."""

    id: str
    dir: Location
    info: dict
    files: dict[str, list[str]] = field(default_factory=dict)  # table -> Hive files (step=/rank= path)
    compacted: dict[str, list[str]] = field(default_factory=dict)  # table -> compacted files
    ranges: list[tuple[int, int]] = field(default_factory=list)  # compacted, committed step ranges
    broken: list[tuple[int, int]] = field(default_factory=list)  # ranges whose commit file is unreadable
    sizes: dict[str, int] = field(default_factory=dict)  # url -> bytes, of every file above
    hidden: list[str] = field(default_factory=list)  # uncommitted steps' files (not errors)
    superseded: list[str] = field(default_factory=list)  # originals of compacted steps


@dataclass
class Catalog:
    root: Location
    runs: list[RunFiles]
    bad: list[tuple[str, str]]  # (file, why it cannot be read)

    def tables(self) -> list[str]:
        names = set(TABLE_DIRS)
        for r in self.runs:
            names |= set(r.files) | set(r.compacted)
        return sorted(names)


def run_ids(dirs: list[Location], base: Location) -> list[str]:
    """A run's id is its directory name, or its path relative to ``base`` where names collide."""
    names = [d.name for d in dirs]
    return [d.name if names.count(d.name) == 1 or d == base else base.relative(d) for d in dirs]


# folders that never hold a run: not walked (besides hidden ones, ``.*``, and virtual environments)
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})
RUN_FILE = "run.json"
_VENV_FILE = "pyvenv.cfg"  # marks a Python virtual environment, whatever its name (venv/, env/, ...)


def find_runs(path, runs: list[str] | None = None, storage_options: dict | None = None) -> list[Location]:
    """Run directories at or under ``path`` (a directory holding run.json), sorted by path.
    ``runs`` selects by run id (see :func:`run_ids`) or directory name.

    Which folders are searched: ``path`` itself, if it holds run.json, is the one run. Otherwise every
    folder below it, except the folders that cannot hold a run:

    - a run's own folders: a folder holding run.json is a run, and nothing below it (steps/, tokens/,
      sequences/, probes/, compacted/, ranks/, ...) is searched for further runs;
    - hidden folders (``.git``, ``.venv``, ``.cache``, ...), ``__pycache__``, ``node_modules``,
      ``site-packages``, ``dist-packages``, and Python virtual environments (a folder holding
      ``pyvenv.cfg``);
    - folders that cannot be read (no permission, removed meanwhile): skipped silently; only the files
      of runs are reported (an unreadable run.json is, by :func:`scan`).

    Symbolic links to folders are not followed (no loops, no second copy of a run). On object
    storage the same rules apply to one listing of the prefix."""
    root = location(path, storage_options)
    found, _ = _discover(root, runs)
    return found


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in SKIP_DIRS


def _walk_local(top: str) -> list[str]:
    """The run directories below local ``top`` (:func:`find_runs`' rules): one scandir per folder
    searched, no stat of any file, nothing below a run."""
    found, todo = [], [top]
    while todo:
        d = todo.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:  # unreadable or gone: not a run's file, so nothing to report
            continue
        subdirs = []
        is_run = is_venv = False
        for e in entries:
            try:
                if e.name == RUN_FILE and d != top and e.is_file():
                    is_run = True
                elif e.name == _VENV_FILE and d != top and e.is_file():
                    is_venv = True
                elif not _skipped(e.name) and e.is_dir(follow_symlinks=False):
                    subdirs.append(e.path)
            except OSError:
                continue
        if is_run:
            found.append(d)
        elif not is_venv:
            todo.extend(subdirs)
    return found


def _filter_listing(root: Location, files) -> list[str]:
    """The run directories in a listing of every file under ``root`` (object storage), by the same
    rules as the local walk: the shallowest run.json on each path, none below a skipped folder.
    Returned as paths under ``root.path`` (fsspec's memory filesystem lists '/bucket/...')."""
    base = root.path.strip("/")
    dirs = sorted(p.rsplit("/", 1)[0] for p in files if p.endswith("/" + RUN_FILE))
    venvs = {p.strip("/").rsplit("/", 1)[0] + "/" for p in files if p.endswith("/" + _VENV_FILE)}
    found: dict[str, str] = {}  # "dir/" (no leading '/') -> the run's path under root.path, in order
    for d in dirs:
        key = d.strip("/")
        rel = key[len(base):].strip("/").split("/") if key.startswith(base + "/") else []
        if not rel or any(_skipped(part) for part in rel):
            continue
        parents = [base + "/" + "/".join(rel[:i]) + "/" for i in range(1, len(rel))]
        if any(p in venvs or p in found for p in parents):  # inside a virtual environment or another run
            continue
        found[key + "/"] = root.path.rstrip("/") + "/" + "/".join(rel)
    return list(found.values())


def _discover(root: Location, runs: list[str] | None) -> tuple[list[Location], list[str]]:
    try:
        exists = root.exists()
    except Exception as e:  # noqa: BLE001 - e.g. no credentials / unreachable endpoint: one line
        raise QueryError(f"cannot reach {root}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not exists:
        raise QueryError(f"path does not exist: {root}")
    if not root.isdir():
        raise QueryError(f"not a directory: {root}")
    if (root / RUN_FILE).isfile():
        found = [root]
    else:
        dirs = _walk_local(root.path) if not root.remote else _filter_listing(root, root.files())
        found = sorted({root.at(p) for p in dirs}, key=lambda d: d.path)
    if not found:
        raise QueryError(f"no entropylens run under {root} (no run.json found)")
    ids = run_ids(found, root)
    if runs:
        wanted = set(runs)
        unknown = wanted - set(ids) - {d.name for d in found}
        if unknown:
            raise QueryError(f"unknown run(s) {', '.join(sorted(unknown))}; runs here: {', '.join(ids)}")
        keep = [i for i, (d, rid) in enumerate(zip(found, ids)) if rid in wanted or d.name in wanted]
        found, ids = [found[i] for i in keep], [ids[i] for i in keep]
    return found, ids


def scan(path, runs: list[str] | None = None, *, storage_options: dict | None = None,
         check: str = "magic") -> Catalog:
    """List the runs under ``path`` and the files a reader should use (module docstring)."""
    root = location(path, storage_options)
    dirs, ids = _discover(root, runs)
    out, bad = [], []
    for d, rid in zip(dirs, ids):
        try:
            info = json.loads((d / "run.json").read_text())
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
        except Exception as e:  # noqa: BLE001 - any unreadable run.json: skip the run, say why
            bad.append((str(d / "run.json"), f"unreadable run.json ({_one_line(e)}); run skipped"))
            continue
        info = with_rank_status(info, d)
        for _ in range(5):
            run, run_bad, stable = _scan_run(d, rid, info, check)
            if stable:
                break
        out.append(run)
        bad.extend(run_bad)
    return Catalog(root, out, bad)


def with_rank_status(info: dict, d: Location) -> dict:
    """Several ranks write ``ranks/rank-R.json`` (status, heartbeat_at, heartbeat_s, error) besides rank
    0's run.json. The run's status is then: ``failed`` if any rank failed; else ``running`` if any rank
    is (with that rank's heartbeat, the oldest, so a dead rank turns the run ``stale``); else rank 0's.
    A rank listed in run.json's world_size without a file yet counts as ``running`` from the start.
    ``rank_status`` lists every rank's own status. One rank (no ranks/ files): run.json as it is."""
    rdir = d / "ranks"
    try:
        ranks = [json.loads(d.at(p).read_text()) for p in sorted(rdir.files()) if p.endswith(".json")] \
            if rdir.exists() else []
    except Exception:  # noqa: BLE001 - a rank file being replaced: run.json's own status stands
        return info
    if not ranks:
        return info
    out = dict(info)
    by_rank = {int(r.get("rank", -1)): r for r in ranks if isinstance(r, dict)}
    for k in range(int(info.get("world_size") or 0)):
        by_rank.setdefault(k, {"rank": k, "status": "running", "heartbeat_at": info.get("started_at")})
    out["rank_status"] = {k: r.get("status") for k, r in sorted(by_rank.items())}
    failed = [r for r in by_rank.values() if r.get("status") == "failed"]
    running = [r for r in by_rank.values() if r.get("status") == "running"]
    if failed:
        out["status"] = "failed"
        out["error"] = out.get("error") or "; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in failed)
    elif running:
        oldest = min(running, key=lambda r: str(r.get("heartbeat_at") or ""))
        out.update(status="running", heartbeat_at=oldest.get("heartbeat_at") or info.get("heartbeat_at"),
                   heartbeat_s=oldest.get("heartbeat_s") or info.get("heartbeat_s"))
    return out


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _commits(d: Location) -> dict[tuple[int, int], str]:
    """Committed compactions of run ``d``: (lo, hi) -> commit file."""
    c = d / COMPACTED / "steps"
    if not c.exists():
        return {}
    out = {}
    for p in c.files():
        m = _COMPACT_NAME.search(p)
        if m and m.group(3) is None:
            out[(int(m.group(1)), int(m.group(2)))] = p
    return out


def _scan_run(d: Location, rid: str, info: dict, check: str) -> tuple[RunFiles, list, bool]:
    run = RunFiles(rid, d, info)
    commits = _commits(d)  # 1. compaction commits first
    listing: dict[str, dict[str, int]] = {}
    comp = d / COMPACTED
    comp_files = comp.files() if commits and comp.exists() else {}
    for table in ["steps"] + sorted(_table_dirs(d) - {"steps"}):  # 2. steps before the rest
        t = d / table
        listing[table] = t.files() if t.exists() else {}
    stable = _commits(d) == commits  # 3. no compaction committed while we listed

    sizes = {p: s for f in (comp_files, *listing.values()) for p, s in f.items() if p.endswith(".parquet")}
    bad_paths = dict(_bad_files(d, sizes, check))
    gone = {p for p, why in bad_paths.items() if why == _GONE}
    if gone:  # removed since the listing (a compaction's clean-up): list again
        return run, [], False
    run.sizes = {d.url(p): n for p, n in sizes.items()}
    ranges = sorted(commits)
    run.ranges = [r for r in ranges if commits[r] not in bad_paths]
    run.broken = [r for r in ranges if commits[r] in bad_paths]
    for lo, hi in run.broken:  # say what a reader sees of those steps instead
        kept = any((m := _HIVE.search(p)) and lo <= int(m.group(1)) <= hi for p in listing.get("steps", {}))
        bad_paths[commits[(lo, hi)]] += (
            f"; compaction commit of steps {lo}-{hi} unreadable: their original files are read instead (remove "
            f"this file and compacted/*/steps-{lo}-{hi}.part-* to compact them again)" if kept else
            f"; compaction commit of steps {lo}-{hi} unreadable and their original files are gone: those steps "
            "are NOT shown (the compacted parts are kept; restore this file from a copy)")
    bad = [(d.url(p), why) for p, why in sorted(bad_paths.items())]

    def compacted_step(s: int) -> bool:
        return any(lo <= s <= hi for lo, hi in run.ranges)

    for p in sorted(comp_files):
        m = _COMPACT_NAME.search(p)
        table = p.rsplit("/", 2)[-2]
        if m and p not in bad_paths and (int(m.group(1)), int(m.group(2))) in run.ranges:
            run.compacted.setdefault(table, []).append(d.url(p))

    committed = set()
    for table, files in listing.items():
        for p in sorted(files):
            m = _HIVE.search(p)
            if not m or p in bad_paths:
                continue
            step, rank = int(m.group(1)), int(m.group(2))
            if compacted_step(step):
                run.superseded.append(d.url(p))
                continue
            if table == "steps":
                committed.add((step, rank))
            elif table in COMMITTED_BY_STEPS and (step, rank) not in committed:
                run.hidden.append(d.url(p))
                continue
            run.files.setdefault(table, []).append(d.url(p))
    return run, bad, stable


def _table_dirs(d: Location) -> set[str]:
    names = set(TABLE_DIRS)
    if not d.remote:
        import os

        try:
            names |= {n for n in os.listdir(d.path) if os.path.isdir(os.path.join(d.path, n))}
        except OSError:
            pass
    else:
        try:
            names |= {p.rstrip("/").rsplit("/", 1)[-1] for p in d.fs.ls(d.path, detail=False)
                      if d.fs.isdir(p)}
        except OSError:
            pass
    return {n for n in names if re.fullmatch(r"[a-z_][a-z0-9_]*", n) and n != COMPACTED}  # view names


def _bad_files(d: Location, files: dict[str, int], check: str) -> list[tuple[str, str]]:
    """(path, reason) of the files that are not whole Parquet files."""
    out, tail_check = [], []
    for p, size in files.items():
        if size < 12:
            out.append((p, "empty" if size == 0 else f"truncated ({size} bytes)"))
        else:
            tail_check.append(p)
    for p, tail in zip(tail_check, d.tails({p: files[p] for p in tail_check}, 4)):
        if isinstance(tail, FileNotFoundError):
            out.append((p, _GONE))
        elif isinstance(tail, Exception):
            out.append((p, f"unreadable ({_one_line(tail)})"))
        elif tail != _MAGIC:
            out.append((p, "not a whole Parquet file (no PAR1 magic at the end: truncated or another format)"))
    if check == "full":
        import pyarrow.parquet as pq

        done = {p for p, _ in out}
        for p in tail_check:
            if p in done:
                continue
            try:
                if d.remote:
                    with d.fs.open(p, "rb") as f:
                        pq.ParquetFile(f).read()
                else:
                    pq.ParquetFile(p).read()
            except Exception as e:  # noqa: BLE001 - any failure to read is a bad file
                out.append((p, f"unreadable Parquet ({_one_line(e)})"))
    return out


@dataclass
class Verified:
    bad: list[tuple[str, str]]  # (file, why)
    files: int  # files checked
    runs: int  # readable runs
    hidden: int  # files of uncommitted steps (normal after a crash; not errors)


def verify(path, *, storage_options: dict | None = None) -> Verified:
    """Every unreadable file under ``path`` (footers parsed and pages read, run.json parsed)."""
    snap = scan(path, storage_options=storage_options, check="full")
    n = sum(len(v) for r in snap.runs for v in (*r.files.values(), *r.compacted.values()))
    n += sum(len(r.hidden) + len(r.superseded) + 1 for r in snap.runs) + len(snap.bad)
    return Verified(snap.bad, n, len(snap.runs), sum(len(r.hidden) for r in snap.runs))


__all__ = ["Catalog", "RunFiles", "QueryError", "Verified", "scan", "find_runs", "run_ids", "verify"]
