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
5. **Only the recorder's own names.** A run's tables are its folders ``steps/``, ``sequences/``,
   ``tokens/``, ``probes/`` (:data:`TABLE_DIRS`) and ``compacted/<table>/``; any other folder of the run
   (``select/``, ``runs/``, an export) is ignored with one note. In them only the names the recorder and
   the compactor write are read (:data:`RECORDER_NAMES`, :data:`_COMPACT_NAME`); any other ``*.parquet``
   (``update-0 (copy).parquet``, ``tokens/export.parquet``) is a bad file: left out, named.
6. **The schema contract, per file** (schema.TABLES), from each file's footer (one read of its last
   64 KiB, the same read as the PAR1 check; cached per process by path, size and mtime: :func:`_read_footers`):
   a contract column of another type, a column named ``run`` (the views' own), a ``step`` / ``rank``
   column in a file whose path holds them, or a foreign table (a key column missing, or no column of the
   table but its keys) makes the file bad: left out, named with what is wrong. A file that lacks
   some contract columns (written by an older version) is read with NULL there, for that file only;
   where the run's other files of the table have those columns, one note per run and table says so
   (:attr:`Catalog.notes`). Columns the contract does not know (a newer version) are read as they are.
7. **Step and rank** of an original file come from the recorder's own path segments below the run
   folder (``TABLE/step=S/rank=R/NAME``; :func:`step_rank`), never from a folder above the run.
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
RUN_DIRS = frozenset({*TABLE_DIRS, COMPACTED, "ranks", "tokenizer"})  # every folder the recorder makes in a run
_HIVE = re.compile(r"/step=(-?\d+)/rank=(-?\d+)/[^/]+\.parquet$")
_COMPACT_NAME = re.compile(r"steps-(\d+)-(\d+)(?:\.part-(\d+))?\.parquet$")
# the file names record/writing/parquet.py gives each table, below TABLE/step=S/rank=R/
RECORDER_NAMES = {
    "tokens": re.compile(r"update-\d+\.parquet|updates-\d+-\d+\.parquet"),
    "sequences": re.compile(r"part-\d+\.parquet"),
    "steps": re.compile(r"steps\.parquet"),
    "probes": re.compile(r"probe-\d+\.parquet"),
}
_OWN_PATH = re.compile(r"(?P<table>[a-z]+)/step=(?P<step>\d+)/rank=(?P<rank>\d+)/(?P<name>[^/]+)")
_COMPACT_PATH = re.compile(r"compacted/(?P<table>[a-z]+)/steps-(\d+)-(\d+)(\.part-\d+)?\.parquet")
_MAGIC = b"PAR1"
_GONE = "removed while listing"
FOOTER_TAIL = 64 << 10  # bytes read from the end of each file: the PAR1 magic and (nearly always) the footer


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
    footers: dict[str, Footer] = field(default_factory=dict)  # url -> its footer, of every file read


@dataclass(frozen=True)
class Footer:
    """What a reader needs from a Parquet file's footer (no data page is read)."""

    columns: tuple[tuple[str, str], ...]  # (name, dtype: schema.py's names, e.g. float32 / dict8, else Arrow's)
    rows: int
    version: str | None  # entropylens.schema_version in the file's metadata (None: not written by entropylens)

    def names(self) -> set[str]:
        return {n for n, _ in self.columns}


@dataclass
class Catalog:
    root: Location
    runs: list[RunFiles]
    bad: list[tuple[str, str]]  # (file, why it cannot be read / is left out)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (file or folder, what a reader does about it)
    info: list[tuple[str, str]] = field(default_factory=list)  # (run.json, its values of the wrong type, nulled)

    def tables(self) -> list[str]:
        return sorted(TABLE_DIRS)


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
        rel = key[len(base) :].strip("/").split("/") if key.startswith(base + "/") else []
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


def scan(path, runs: list[str] | None = None, *, storage_options: dict | None = None, check: str = "magic") -> Catalog:
    """List the runs under ``path`` and the files a reader should use (module docstring)."""
    root = location(path, storage_options)
    dirs, ids = _discover(root, runs)
    out, bad, notes, info_bad = [], [], [], []
    for d, rid in zip(dirs, ids):
        try:
            info = json.loads((d / "run.json").read_text())
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
        except Exception as e:  # noqa: BLE001 - any unreadable run.json: skip the run, say why
            bad.append((str(d / "run.json"), f"unreadable run.json ({_one_line(e)}); run skipped"))
            continue
        info, wrong, skip = checked_info(info)
        if skip:
            bad.append((str(d / "run.json"), f"{skip}; run skipped (fix the key in run.json to read it)"))
            continue
        if wrong:
            info_bad.append((str(d / "run.json"), "; ".join(wrong) + ": shown as NULL (fix them in run.json)"))
        info = with_rank_status(info, d)
        for _ in range(5):
            run, run_bad, run_notes, stable = _scan_run(d, rid, info, check)
            if stable:
                break
        out.append(run)
        bad.extend(run_bad)
        notes.extend(run_notes)
    return Catalog(root, out, bad, notes, info_bad)


_NUMBER = (int, float)
# run.json keys a reader takes as a value of the runs table: key -> (accepted JSON types, what it must be)
INFO_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    **{k: ((str,), "a string") for k in ("run", "status", "started_at", "heartbeat_at")},
    **{k: ((int,), "an integer") for k in ("seed", "world_size", "schema_version")},
    **{k: (_NUMBER, "a number") for k in ("eps_low", "eps_high", "tau", "sample", "heartbeat_s")},
    "config": ((dict,), "a JSON object"),
    "resumed": ((list,), "a list"),
}
DECIDING_KEYS = ("status", "world_size")  # they decide which files count (commit, compaction): never guessed
_DESCRIPTIONS = ("method", "model")  # free text: another JSON value is shown as its JSON


def checked_info(info: dict) -> tuple[dict, list[str], str | None]:
    """run.json's values checked against :data:`INFO_TYPES`: ``(info, problems, skip)``. A key of another
    type is nulled (``problems`` names each, its value and what it must be); a wrong :data:`DECIDING_KEYS`
    value (status, world_size: which files count) gives ``skip``, the reason to skip the run instead;
    ``method`` / ``model`` that are not strings are kept as their JSON text."""
    out, problems = dict(info), []
    for key, (types, what) in INFO_TYPES.items():
        v = out.get(key)
        if v is None or (isinstance(v, types) and not isinstance(v, bool)):
            continue
        why = f"run.json's {key!r} is {json.dumps(v, default=str)[:60]}, not {what}"
        if key in DECIDING_KEYS:
            return out, [], why
        problems.append(why)
        out[key] = None
    for key in _DESCRIPTIONS:
        if out.get(key) is not None and not isinstance(out[key], str):
            out[key] = json.dumps(out[key], sort_keys=True, default=str)
    return out, problems, None


def with_rank_status(info: dict, d: Location) -> dict:
    """Several ranks write ``ranks/rank-R.json`` (status, heartbeat_at, heartbeat_s, error) besides rank
    0's run.json. The run's status is then: ``failed`` if any rank failed; else ``running`` if any rank
    is (with that rank's heartbeat, the oldest, so a dead rank turns the run ``stale``); else rank 0's.
    A rank listed in run.json's world_size without a file yet counts as ``running`` from the start.
    ``rank_status`` lists every rank's own status. One rank (no ranks/ files): run.json as it is."""
    rdir = d / "ranks"
    try:
        ranks = (
            [json.loads(d.at(p).read_text()) for p in sorted(rdir.files()) if p.endswith(".json")]
            if rdir.exists()
            else []
        )
    except Exception:  # noqa: BLE001 - a rank file being replaced: run.json's own status stands
        return info
    if not ranks:
        return info
    out = dict(info)
    by_rank = {r["rank"]: r for r in ranks if isinstance(r, dict) and type(r.get("rank")) is int}
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
        out.update(
            status="running",
            heartbeat_at=oldest.get("heartbeat_at") or info.get("heartbeat_at"),
            heartbeat_s=oldest.get("heartbeat_s") or info.get("heartbeat_s"),
        )
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


def _scan_run(d: Location, rid: str, info: dict, check: str) -> tuple[RunFiles, list, list, bool]:
    run = RunFiles(rid, d, info)
    commits = _commits(d)  # 1. compaction commits first
    listing: dict[str, dict[str, int]] = {}
    comp = d / COMPACTED
    comp_files = comp.files() if commits and comp.exists() else {}
    tables, strays = _run_dirs(d)
    for table in ["steps"] + sorted(tables - {"steps"}):  # 2. steps before the rest
        t = d / table
        listing[table] = t.files() if t.exists() else {}
    stable = _commits(d) == commits  # 3. no compaction committed while we listed

    sizes = {p: s for f in (comp_files, *listing.values()) for p, s in f.items() if p.endswith(".parquet")}
    bad_paths = {p: why for p in sizes if (why := _unknown_name(d, p))}
    footers, unreadable = _read_footers(d, {p: n for p, n in sizes.items() if p not in bad_paths}, check)
    bad_paths.update(unreadable)
    gone = {p for p, why in bad_paths.items() if why == _GONE}
    if gone:  # removed since the listing (a compaction's clean-up): list again
        return run, [], [], False
    for p, f in footers.items():
        if p not in bad_paths and (why := contract_problem(_table_of(d, p), f, compacted=_is_compacted(d, p))):
            bad_paths[p] = why
    run.sizes = {d.url(p): n for p, n in sizes.items()}
    run.footers = {d.url(p): f for p, f in footers.items() if p not in bad_paths}
    ranges = sorted(commits)
    run.ranges = [r for r in ranges if commits[r] not in bad_paths]
    run.broken = [r for r in ranges if commits[r] in bad_paths]
    for lo, hi in run.broken:  # say what a reader sees of those steps instead
        kept = any((m := _HIVE.search(p)) and lo <= int(m.group(1)) <= hi for p in listing.get("steps", {}))
        bad_paths[commits[(lo, hi)]] += (
            f"; compaction commit of steps {lo}-{hi} unreadable: their original files are read instead (remove "
            f"this file and compacted/*/steps-{lo}-{hi}.part-* to compact them again)"
            if kept
            else f"; compaction commit of steps {lo}-{hi} unreadable and their original files are gone: those steps "
            "are NOT shown (the compacted parts are kept; restore this file from a copy)"
        )
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
    notes = [
        (
            str(d / name),
            f"run {rid}: folder {d / name}/ holds Parquet files but is not a table entropylens writes: ignored",
        )
        for name in strays
        if _holds_parquet(d / name)
    ]
    notes += [(f, note) for f, note, _ in _version_gaps(run)]
    return run, bad, notes, stable


def _rel(d: Location, p: str) -> str:
    """``p`` relative to run ``d`` (listings of some filesystems add or drop a leading '/')."""
    return p.lstrip("/")[len(d.path.strip("/")) + 1 :]


def _is_compacted(d: Location, p: str) -> bool:
    return _rel(d, p).startswith(COMPACTED + "/")


def _table_of(d: Location, p: str) -> str:
    parts = _rel(d, p).split("/")
    return parts[1] if parts[0] == COMPACTED else parts[0]


def _unknown_name(d: Location, p: str) -> str | None:
    """Why the file at ``p`` (a ``*.parquet`` under run ``d``) is not one the recorder or the compactor
    wrote (None: it is): its table folder, step / rank folders and name (rule 5)."""
    rel = _rel(d, p)
    m = _COMPACT_PATH.fullmatch(rel)
    if m and m.group("table") in TABLE_DIRS and (m.group(4) is None) == (m.group("table") == "steps"):
        return None
    m = _OWN_PATH.fullmatch(rel)
    if m and m.group("table") in RECORDER_NAMES and RECORDER_NAMES[m.group("table")].fullmatch(m.group("name")):
        return None
    return (
        "not a file entropylens writes (a copy or another tool's file?): left out of the views; move it "
        "out of the run folder"
    )


def step_rank(url: str) -> tuple[int, int]:
    """(step, rank) of an original file, from the recorder's own path segments: the last
    ``step=S/rank=R/`` of its path, the folders right above its name (never a folder above the run)."""
    m = _HIVE.search(url)
    if m is None:
        raise ValueError(f"{url}: not a recorder's file (no step=S/rank=R/ folders above its name)")
    return int(m.group(1)), int(m.group(2))


def _run_dirs(d: Location) -> tuple[set[str], list[str]]:
    """The run's table folders (of :data:`TABLE_DIRS`) and the other folders it holds (``strays``:
    ignored, rule 5; hidden ones and the recorder's own ``ranks/``, ``tokenizer/``, ``compacted/`` are
    not strays)."""
    names: set[str] = set()
    if not d.remote:
        try:
            names = {n for n in os.listdir(d.path) if os.path.isdir(os.path.join(d.path, n))}
        except OSError:
            pass
    else:
        try:
            names = {p.rstrip("/").rsplit("/", 1)[-1] for p in d.fs.ls(d.path, detail=False) if d.fs.isdir(p)}
        except OSError:
            pass
    strays = sorted(n for n in names if n not in RUN_DIRS and not n.startswith("."))
    return set(TABLE_DIRS), strays


def _holds_parquet(d: Location) -> bool:
    try:
        return any(p.endswith(".parquet") for p in d.files())
    except OSError:
        return False


# ---------------------------------------------------------------- footers and the schema contract
_FOOTERS: dict[tuple, Footer] = {}  # (url, size, mtime_ns) -> its footer: files are never rewritten in place
_FOOTERS_MAX = 1 << 20  # entries kept (~200 bytes each); the cache is cleared when full


def _footer_key(d: Location, p: str, size: int) -> tuple:
    if d.remote:
        return (d.url(p), size)  # objects are written whole, once, under their final name
    try:
        return (p, size, os.stat(p).st_mtime_ns)
    except OSError:
        return (p, size, None)


def _dtype(t) -> str:
    """schema.py's dtype name of an Arrow type (a dictionary of strings: ``dict8``), else Arrow's own name."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return "dict8" if pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type) else str(t)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return {
        "int8": "int8",
        "int16": "int16",
        "int32": "int32",
        "int64": "int64",
        "float": "float32",
        "double": "float64",
        "bool": "bool",
    }.get(str(t), str(t))


def parse_footer(tail: bytes) -> Footer:
    """The footer at the end of ``tail`` (the last bytes of a Parquet file, footer included)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = int.from_bytes(tail[-8:-4], "little")
    md = pq.read_metadata(pa.BufferReader(_MAGIC + tail[-(n + 8) :]))
    version = (md.metadata or {}).get(b"entropylens.schema_version")
    schema = md.schema.to_arrow_schema()
    columns = _COLUMNS.get(schema)
    if columns is None:  # files of one version share their schema: converted once
        columns = _COLUMNS.setdefault(schema, tuple((f.name, _dtype(f.type)) for f in schema))
    return Footer(columns, md.num_rows, version.decode(errors="replace") if version else None)


_COLUMNS: dict = {}  # Arrow schema -> Footer.columns (a few distinct schemas per process)


def _read_footers(d: Location, files: dict[str, int], check: str) -> tuple[dict[str, Footer], dict[str, str]]:
    """The footers of ``files`` (path -> size) and the files that are not whole Parquet files (path ->
    why): one read of each file's last :data:`FOOTER_TAIL` bytes (a second, exact one for a larger
    footer), none for a file whose (path, size, mtime) is in the cache. ``check="full"`` also reads
    every page (``entropylens verify``)."""
    footers, bad, todo = {}, {}, {}
    for p, size in files.items():
        f = _FOOTERS.get(_footer_key(d, p, size)) if check != "full" else None
        if f is not None:
            footers[p] = f
        elif size < 12:
            bad[p] = "empty" if size == 0 else f"truncated ({size} bytes)"
        else:
            todo[p] = size
    tails = dict(zip(todo, d.tails(todo, FOOTER_TAIL)))
    longer = {
        p: int.from_bytes(t[-8:-4], "little") + 8
        for p, t in tails.items()
        if isinstance(t, bytes) and t[-4:] == _MAGIC and int.from_bytes(t[-8:-4], "little") + 8 > len(t)
    }
    longer = {p: n for p, n in longer.items() if n + 4 <= todo[p]}
    tails.update(zip(longer, d.tails(longer, max(longer.values(), default=0))))
    for p, tail in tails.items():
        if isinstance(tail, FileNotFoundError):
            bad[p] = _GONE
        elif isinstance(tail, Exception):
            bad[p] = f"unreadable ({_one_line(tail)})"
        elif tail[-4:] != _MAGIC:
            bad[p] = "not a whole Parquet file (no PAR1 magic at the end: truncated or another format)"
        else:
            try:
                footers[p] = parse_footer(tail)
            except Exception as e:  # noqa: BLE001 - a footer that does not parse: a bad file
                bad[p] = f"unreadable Parquet footer ({_one_line(e)})"
                continue
            if len(_FOOTERS) >= _FOOTERS_MAX:
                _FOOTERS.clear()
            _FOOTERS[_footer_key(d, p, todo[p])] = footers[p]
    if check == "full":
        for p in sorted(footers):
            why = read_problem(d, p)
            if why:
                bad[p] = why
                del footers[p]
    return footers, bad


def read_problem(d: Location, p: str) -> str | None:
    """Why the file at ``p`` cannot be read to its last page (None: it can), by pyarrow."""
    import pyarrow.parquet as pq

    try:
        if d.remote:
            with d.fs.open(p, "rb") as f:
                pq.ParquetFile(f).read()
        else:
            pq.ParquetFile(p).read()
    except FileNotFoundError:
        return _GONE
    except Exception as e:  # noqa: BLE001 - any failure to read is a bad file
        return f"unreadable Parquet ({_one_line(e)})"
    return None


# key columns a file of the table cannot lack (without them it is another table)
KEY_COLUMNS = {
    "tokens": ("update", "seq", "pos"),
    "sequences": ("seq",),
    "steps": ("update",),
    "probes": ("update", "part"),
}
_VIEW_OWN = ("run",)  # the views' own column: a file column of this name would shadow it


def contract_problem(table: str, footer: Footer, *, compacted: bool = False) -> str | None:
    """What makes a file of ``table`` with this footer unusable against the contract (None: nothing; the
    rules: :func:`_contract_problem`), answered once per column list."""
    key = (table, compacted, footer.columns)
    if key not in _PROBLEMS:
        _PROBLEMS[key] = _contract_problem(table, footer, compacted)
    return _PROBLEMS[key]


_PROBLEMS: dict = {}  # (table, compacted, columns) -> contract_problem's answer


def _contract_problem(table: str, footer: Footer, compacted: bool) -> str | None:
    """What makes a file of ``table`` unusable against the contract (schema.TABLES), None if nothing:
    a contract column of another dtype, a foreign table (a key column missing, or no contract column besides
    the keys: an older version lacks some columns, never all), ``step`` / ``rank`` stored in an original file (their path holds them) or
    missing from a compacted one, a ``run`` column. Missing other columns (an older version) and
    unknown ones (a newer version) are no problem."""
    from ..schema import TABLES

    cols = dict(footer.columns)
    contract = {c.name: c.dtype for c in TABLES[table] if c.derived is None}
    keys = {"step", "rank"}
    wrong = [
        f"`{n}` is {cols[n]}, not {want}"
        for n, want in contract.items()
        if n in cols and not _same_dtype(cols[n], want) and (compacted or n not in keys)
    ]
    if wrong:
        return "column(s) of another type than the schema contract: " + ", ".join(wrong) + "; left out"
    need = KEY_COLUMNS[table] + (("step", "rank") if compacted else ())
    lacks = [n for n in need if n not in cols]
    have = sum(1 for n in contract if n in cols and n not in keys and n not in need)
    if lacks or have == 0:
        return (
            f"not an entropylens {table} file ("
            + (f"no column {', '.join(lacks)}" if lacks else f"no column of the {table} table but its keys")
            + "): another table? left out"
        )
    own = [n for n in (*_VIEW_OWN, *(() if compacted else keys)) if n in cols]
    if own:
        return (
            f"holds column(s) {', '.join(own)}, which the views take from the run "
            "(run id; step and rank from the path): left out"
        )
    return None


def _same_dtype(have: str, want: str) -> bool:
    text = ("string", "dict8")  # both read as text (DuckDB VARCHAR)
    return have == want or (have in text and want in text)


def _version_gaps(run: RunFiles) -> list[tuple[str, str, bool]]:
    """(first file, note, edited) per table of ``run`` whose files disagree on contract columns: some
    files lack columns that others of the table have: NULL there. ``edited``: another file of the same or
    an older schema version has the column, so its version wrote it: the file was edited by another tool
    or damaged (``verify`` counts it bad), not written before the column existed."""
    from ..schema import TABLES

    def version(u: str) -> int:
        v = run.footers[u].version
        if v is None:
            return 0
        try:
            return int(v)
        except ValueError:
            return 0

    out = []
    for table in TABLE_DIRS:
        urls = [*run.files.get(table, ()), *run.compacted.get(table, ())]
        names = {u: run.footers[u].names() for u in urls if u in run.footers}
        if not names:
            continue
        contract = [c.name for c in TABLES[table] if c.derived is None and c.name not in ("step", "rank")]
        # the oldest schema version of a file that has the column, for the columns some file has
        first_with = {
            c: v
            for c in contract
            if (v := min((version(u) for u, have in names.items() if c in have), default=None)) is not None
        }
        gaps: dict[tuple[tuple[str, ...], bool], list[str]] = {}
        for u, have in names.items():
            lack = [c for c in contract if c in first_with and c not in have]
            edited = tuple(c for c in lack if first_with[c] <= version(u))
            older = tuple(c for c in lack if c not in edited)
            for group, kind in ((older, False), (edited, True)):
                if group:
                    gaps.setdefault((group, kind), []).append(u)
        for (lacking, was_edited), files in sorted(gaps.items()):
            versions = ", ".join(sorted({str(run.footers[u].version or "unknown") for u in files}))
            cols = ", ".join(f"`{c}`" for c in lacking)
            if was_edited:
                note = (
                    f"run {run.id}: {len(files)} {table} file(s) lack column(s) {cols}, which other files of "
                    f"schema version {versions} or older have (edited by another tool, or damaged? e.g. "
                    f"{files[0]}): NULL there; restore the file from a copy or move it out of the run folder"
                )
            else:
                note = (
                    f"run {run.id}: {len(files)} {table} file(s) written before column(s) {cols} existed "
                    f"(schema version {versions}; e.g. {files[0]}): NULL there"
                )
            out.append((files[0], note, was_edited))
    return out


@dataclass
class Verified:
    bad: list[tuple[str, str]]  # (file, why)
    files: int  # files checked
    runs: int  # readable runs
    hidden: int  # files of uncommitted steps (normal after a crash; not errors)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (file or folder, note): not errors


def verify(path, *, storage_options: dict | None = None) -> Verified:
    """Every file under ``path`` a reader leaves out or that is wrong, with why: unreadable (footers
    parsed, pages read), against the schema contract (wrong types, a foreign table), not named by the
    recorder, run.json of the wrong types; a step whose token rows differ from its n_tokens (fewer is
    right only with sample < 1); originals a committed compaction superseded, still on disk."""
    snap = scan(path, storage_options=storage_options, check="full")
    bad = list(snap.bad) + list(snap.info)
    for r in snap.runs:
        bad += [
            (
                u,
                "superseded by a committed compaction of its step but still on disk (a compaction "
                "stopped before its clean-up): `entropylens compact` removes it",
            )
            for u in r.superseded
        ]
        left_out = {step_rank(u) for u, _ in snap.bad if u.startswith(str(r.dir / "tokens") + "/") and _HIVE.search(u)}
        bad += row_count_problems(r, {k: n for k, n in recorded_tokens(r).items() if k not in left_out}, fewer=True)
        bad += [(f, note) for f, note, edited in _version_gaps(r) if edited]
    n = sum(len(v) for r in snap.runs for v in (*r.files.values(), *r.compacted.values()))
    n += sum(len(r.hidden) + len(r.superseded) + 1 for r in snap.runs) + len(snap.bad)
    return Verified(bad, n, len(snap.runs), sum(len(r.hidden) for r in snap.runs), snap.notes)


def recorded_tokens(r: RunFiles) -> dict[tuple[int, int], int]:
    """(step, rank) -> the sum of n_tokens over its steps rows, from run ``r``'s original steps files."""
    import pyarrow.parquet as pq

    out: dict[tuple[int, int], int] = {}
    for u in r.files.get("steps", ()):
        if "n_tokens" not in r.footers.get(u, Footer((), 0, None)).names():
            continue
        try:
            if r.dir.remote:
                with r.dir.fs.open(u.split("://", 1)[-1], "rb") as f:
                    col = pq.read_table(f, columns=["n_tokens"]).column(0)
            else:
                col = pq.read_table(u, columns=["n_tokens"]).column(0)
        except Exception:  # noqa: BLE001 - unreadable since it was checked: scan names it next time
            continue
        values = [v for v in col.to_pylist() if v is not None]
        if values:
            out[step_rank(u)] = sum(values)
    return out


def row_count_problems(
    r: RunFiles, recorded: dict[tuple[int, int], int], *, fewer: bool = False
) -> list[tuple[str, str]]:
    """(first token file, why) per (step, rank) of run ``r`` whose token rows (footers of its original
    token files) exceed ``recorded`` ((step, rank) -> sum of n_tokens), or with ``fewer`` differ from it
    (fewer rows are right when the run's ``sample`` < 1)."""
    rows: dict[tuple[int, int], list] = {}
    for f in r.files.get("tokens", ()):
        if f in r.footers:
            entry = rows.setdefault(step_rank(f), [0, f])
            entry[0] += r.footers[f].rows
    sample = r.info.get("sample")
    sampled = isinstance(sample, (int, float)) and sample < 1
    if fewer:  # a step with tokens recorded but no token file left
        for key in recorded:
            rows.setdefault(key, [0, None])
    out = []
    for (step, rank), (n, first) in sorted(rows.items()):
        want = recorded.get((step, rank))
        if want is None or n == want or (n < want and (sampled or not fewer)):
            continue
        folder = first.rsplit("/", 1)[0] + "/" if first else f"{r.dir / 'tokens' / f'step={step}' / f'rank={rank}'}/"
        out.append(
            (
                folder,
                f"run {r.id}: step {step} rank {rank}: its token files ({folder}) hold {n} rows, its "
                f"steps rows say n_tokens {want}{f' (sample {sample:g})' if sampled else ''}: a copied, lost "
                "or foreign token file? `entropylens verify` names the files a reader leaves out",
            )
        )
    return out


__all__ = ["Catalog", "Footer", "RunFiles", "QueryError", "Verified", "scan", "find_runs", "run_ids", "verify"]
