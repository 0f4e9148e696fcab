"""A run directory is written by one run: a Recorder refuses a directory that already holds
a run of the same id unless told to overwrite, and then removes exactly the old run's files; or,
told to resume, continues it after a committed step (:func:`resume`).

One writer per run and rank: a writer claims its rank by an exclusive create of
``.claims/rank-R.json`` (O_CREAT | O_EXCL locally, a conditional PUT on object storage) holding a
nonce of its own (:class:`Claim`), and checks before every file it writes that the claim still holds
that nonce. Of writers that create one run and rank at the same instant exactly one gets it, the
others are refused (RunExistsError naming the holder). The claim stays after close() and after a
kill: a later plain create of the run id is refused; ``overwrite=True`` and ``resume=K`` take the
claim over (:func:`_take_over`: of jobs taking over one claim at once, one wins), and a writer whose
claim was taken over stops at its next write (:class:`ClaimLostError`). Claims are hidden files:
no reader lists them.

Each rank checks only its own files (``*/rank=R/*``, ``ranks/rank-R.json``), so ranks never race:
rank 0 also owns run.json, the compacted parts and the files of ranks >= world_size (an earlier run
with more ranks). Works on any storage.Location (local directory or s3://).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from .run_info import utc_now

_RANK = re.compile(r"^rank=(\d+)$|^rank-(\d+)\.json$")
_STEP = re.compile(r"^step=(\d+)$")
_COMPACTED_COMMIT = re.compile(r"^compacted/steps/steps-(\d+)-(\d+)\.parquet$")  # compact.py's commit of LO..HI
CLAIMS = ".claims"  # hidden: storage.Location.files (every reader's listing) leaves it out
_CLAIM_NAME = re.compile(r"^rank-(\d+)\.json$")
_READ_TRIES, _READ_WAIT_S = 50, 0.02  # a claim file being created is read again until whole (~1 s at most)
_WHAT_TO_DO = (
    "pass resume=K to continue it after its step K (a checkpoint's last step), overwrite=True (CLI: "
    "--overwrite) to replace it (its files are deleted), or another run id (the default id is new each "
    "time)"
)


class RunExistsError(ValueError):
    """The run directory already holds a run of this id (pass overwrite=True / --overwrite)."""


class ClaimLostError(RuntimeError):
    """This writer's claim of its run and rank is gone: another job took the run over (overwrite=True,
    resume=K) or removed it. The writer writes nothing more into the run."""


def runs_exist_message(runs_dir, existing: list[str]) -> str:
    """The demo's refusal to mix new runs into old ones of the same ids (the CLI's early check and
    :func:`entropylens.demo.runner.run_demo` say it alike)."""
    return (
        f"{runs_dir} already holds run(s) {', '.join(existing)}; use --overwrite to replace them "
        "or --out for a new directory"
    )


def claim_path(run_dir, rank: int):
    """The claim file of ``rank`` in ``run_dir`` (a storage.Location)."""
    return run_dir / CLAIMS / f"rank-{rank}.json"


@dataclass(frozen=True)
class Claim:
    """One writer's claim of one rank of a run: the bytes of its claim file (run, rank, world size,
    a nonce new per writer, pid, host, start time) and where that file is."""

    run_dir: Any  # storage.Location
    rank: int
    nonce: str
    data: bytes

    @classmethod
    def new(cls, run_dir, rank: int, world_size: int) -> Claim:
        nonce = secrets.token_hex(16)
        data = {
            "run": run_dir.name,
            "rank": rank,
            "world_size": world_size,
            "nonce": nonce,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": utc_now(),
        }
        return cls(run_dir, rank, nonce, (json.dumps(data) + "\n").encode())

    @property
    def path(self):
        return claim_path(self.run_dir, self.rank)

    def check(self) -> None:
        """Raise ClaimLostError unless the claim file still holds this writer's nonce: one read of a
        file of ~200 bytes (a GET on object storage), before each file the writer writes."""
        try:
            held = _read_local(self.path.path) if not self.path.remote else self.path.read_bytes()
        except FileNotFoundError:
            held = None
        if held is not None and self.nonce.encode() in held:
            return
        where = f"run {self.run_dir.name!r} (rank {self.rank}) in {self.run_dir}"
        why = (
            f"another writer took it over ({_who(held)}: overwrite=True or resume=K)"
            if held is not None
            else f"its claim file {self.path} is gone (the run was removed, or taken over by a job of fewer ranks)"
        )
        raise ClaimLostError(
            f"{where} is no longer this writer's: {why}; this writer stopped and writes nothing more into it"
        )


def _read_local(path: str) -> bytes:
    """A small local file's bytes through one descriptor (no pathlib object: the check runs before every file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _who(held: bytes | None) -> str:
    """'pid P on host H, started T' of a claim file's bytes."""
    if held is None:  # no claim file
        return "a writer whose claim file is unreadable"
    try:
        c = json.loads(held)
        return f"pid {c['pid']} on host {c['host']}, started {c['started_at']}"
    except (TypeError, ValueError, KeyError):
        return "a writer whose claim file is unreadable"


def _whole(held: bytes) -> bool:
    try:
        return "nonce" in json.loads(held)
    except (TypeError, ValueError):
        return False


def _read_claim(path) -> bytes | None:
    """A claim file's bytes (None: no claim). Locally a claim is empty for a moment after its exclusive
    create (its bytes follow): read again until whole, for about a second at most."""
    held = b""
    for _ in range(_READ_TRIES):
        try:
            held = path.read_bytes()
        except FileNotFoundError:
            return None
        if _whole(held):
            break
        time.sleep(_READ_WAIT_S)
    return held


def _claim_ranks(run_dir) -> list[int]:
    """The ranks that have a claim file in ``run_dir`` (one listing of the hidden claims folder)."""
    d = run_dir / CLAIMS
    try:
        if d.remote:
            d.fs.invalidate_cache(d.path)
            names = [posixpath.basename(p) for p in d.fs.ls(d.path, detail=False)]
        else:
            names = os.listdir(d.path)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _CLAIM_NAME.match(n)))


def _owner(rel: str) -> int | None:
    """The rank a file belongs to (None: run-level, e.g. run.json, compacted/...)."""
    for part in rel.split("/"):
        m = _RANK.match(part)
        if m:
            return int(m.group(1) or m.group(2))
    return None


def old_files(run_dir, rank: int, world_size: int, listing: list[str] | None = None) -> list[str]:
    """Files under ``run_dir`` (a storage.Location) that an earlier run left for this rank to own
    (``listing``: run_dir's files, when the caller has listed them already)."""
    out = []
    for path in sorted(run_dir.files()) if listing is None else listing:
        owner = _owner(posixpath.relpath(path, run_dir.path))
        if owner == rank or (rank == 0 and (owner is None or owner >= world_size)):
            out.append(path)
    return out


def _shown(run_dir, old: list[str]) -> str:
    if not old:
        return "no file written yet"
    shown = ", ".join(posixpath.relpath(p, run_dir.path) for p in old[:2]) + (", ..." if len(old) > 2 else "")
    return f"{len(old)} file(s): {shown}"


def claim(run_dir, rank: int, world_size: int, overwrite: bool, writer: Claim | None = None) -> int:
    """Claim ``rank`` of the run in ``run_dir`` for ``writer`` (a new :class:`Claim` if None): an
    exclusive create of its claim file. Refused (RunExistsError, one line) where the rank is claimed
    already (by a running, finished or killed job), where an earlier run without claim files left
    files for this rank, or where the run's other claims disagree on the ranks (:func:`_check_ranks`).
    With ``overwrite`` the claim is taken over (:func:`_take_over`), then the old run's files of this
    rank are removed (rank 0: also the claims of ranks >= world_size). Returns the number of files removed."""
    mine = writer or Claim.new(run_dir, rank, world_size)
    if overwrite:
        _take_over(mine)
        _drop_claims_beyond(run_dir, rank, world_size)
        old = old_files(run_dir, rank, world_size)
        for p in old:
            run_dir.at(p).remove()
        return len(old)
    if not mine.path.create_exclusive(mine.data):
        held = _read_claim(mine.path)
        raise RunExistsError(
            f"{run_dir} already holds a run (rank {rank} claimed by {_who(held)}; "
            f"{_shown(run_dir, old_files(run_dir, rank, world_size))}); {_WHAT_TO_DO}"
        )
    try:
        _check_ranks(run_dir, rank, world_size)
        old = old_files(run_dir, rank, world_size)
        if old:  # a run recorded before claim files existed
            raise RunExistsError(f"{run_dir} already holds a run ({_shown(run_dir, old)}); {_WHAT_TO_DO}")
    except RunExistsError:
        if mine.nonce.encode() in (_read_claim(mine.path) or b""):
            mine.path.remove()  # the claim of a refused writer
        raise
    return 0


def _check_ranks(run_dir, rank: int, world_size: int) -> None:
    """A new run's claims agree on its ranks: rank 0 finds no claim of a rank >= its world size, and
    any other rank finds rank 0's claim (if made already) naming the same world size. Two jobs that
    each think they hold ranks of the run (two "nodes" both rank 0 of world_size 1, a job of 2 ranks
    beside one of 1) are refused."""
    if rank == 0:
        beyond = [r for r in _claim_ranks(run_dir) if r >= world_size]
        if beyond:
            held = _read_claim(claim_path(run_dir, beyond[0]))
            raise RunExistsError(
                f"{run_dir} already holds a run: rank {beyond[0]} is claimed by {_who(held)}, "
                f"beyond world_size {world_size}; {_WHAT_TO_DO}"
            )
        return
    held = _read_claim(claim_path(run_dir, 0))
    try:
        theirs = json.loads(held)["world_size"] if held is not None else world_size
    except (TypeError, ValueError, KeyError):
        theirs = None
    if theirs != world_size:
        raise RunExistsError(
            f"{run_dir} already holds a run: its rank 0 is claimed by {_who(held)} with world_size "
            f"{theirs}, not {world_size}; {_WHAT_TO_DO}"
        )


def _take_over(mine: Claim) -> None:
    """Replace this rank's claim (whichever writer holds it: running, finished or killed) by ``mine``.
    Of jobs taking over one claim at once exactly one wins: the takeover is an exclusive create of
    ``rank-R.after-<hash of the claim it replaces>.json`` (or of the claim itself where there is
    none), then the claim is rewritten; the others are refused, naming the winner. A writer that
    held the claim stops at its next write (Claim.check)."""
    held = _read_claim(mine.path)
    if held is None:
        theirs = mine.path
        won = theirs.create_exclusive(mine.data)
    else:
        theirs = _takeover_path(mine.path, held)
        won = theirs.create_exclusive(mine.data)
        if won:
            mine.path.write_bytes(mine.data, fsync=True)
    if not won:
        raise RunExistsError(
            f"{mine.run_dir}: rank {mine.rank} was taken over at the same moment by another job "
            f"({_who(_read_claim(theirs))}); one job takes a run over, this one stops"
        )


def _takeover_path(path, held: bytes):
    """Where the takeover of the claim file ``path`` holding ``held`` is made (one per claim replaced)."""
    name = posixpath.basename(path.path).removesuffix(".json")
    return path.parent / f"{name}.after-{hashlib.sha256(held).hexdigest()[:16]}.json"


def _drop_claims_beyond(run_dir, rank: int, world_size: int) -> None:
    """Rank 0 of a run overwritten or resumed on fewer ranks removes the claims of the ranks it no
    longer has (their writers, if still running, stop at their next write)."""
    if rank == 0:
        for r in _claim_ranks(run_dir):
            if r >= world_size:
                claim_path(run_dir, r).remove()


def _step_of(rel: str) -> int | None:
    for part in rel.split("/"):
        m = _STEP.match(part)
        if m:
            return int(m.group(1))
    return None


def resume(run_dir, rank: int, world_size: int, after: int, writer: Claim | None = None) -> list[int]:
    """Continue the run in ``run_dir`` after step ``after`` (>= 0). This rank's files of later steps
    are removed: a killed job's uncommitted leftovers, and the steps after a checkpoint that the
    resumed job records again. Returns the committed steps removed. A job resumed on fewer ranks:
    rank 0 also removes the later steps of the ranks it no longer has (their steps up to ``after``
    stay); on more ranks, a new rank has nothing to remove. Compacted steps (entropylens compact,
    whose parts span steps and ranks) must all lie at or before ``after``: they stay as they are.
    Refused with one line: no run there, compacted steps after ``after``, or ``after`` beyond this
    rank's last committed step. Once these checks pass, ``writer`` (a new :class:`Claim` if None)
    takes the rank's claim over (:func:`_take_over`; a killed job's claim is taken over as any
    other), before any file is removed; a refused resume leaves the claim as it was."""
    claim_as = writer or Claim.new(run_dir, rank, world_size)
    listing = sorted(run_dir.files())
    mine = [(p, posixpath.relpath(p, run_dir.path)) for p in old_files(run_dir, rank, world_size, listing)]
    compacted = [
        (int(m.group(1)), int(m.group(2)))
        for p in listing
        if (m := _COMPACTED_COMMIT.match(posixpath.relpath(p, run_dir.path)))
    ]
    if not listing:
        raise ValueError(f"resume: {run_dir} holds no run to resume")
    if not any(_owner(rel) == rank for _, rel in mine) and rank > 0 and not compacted:
        _take_over(claim_as)
        return []  # a rank the earlier job did not have (the job resumed on more ranks): nothing to remove
    if compacted and max(hi for _, hi in compacted) > after:
        lo, hi = max(compacted, key=lambda r: r[1])
        raise ValueError(
            f"resume={after}: steps {lo}-{hi} of {run_dir} were compacted (entropylens compact) and "
            f"reach past step {after}; compacted steps cannot be removed: resume after step {hi} or "
            "later, or continue into a new run id"
        )
    committed = [
        _step_of(rel)
        for _, rel in mine
        if rel.startswith("steps/") and _owner(rel) == rank and rel.endswith("/steps.parquet")
    ]
    last = max([s for s in committed if s is not None] + [hi for _, hi in compacted], default=-1)
    if after > last and rank > 0:  # rank 0's check guards K; this rank missed steps (absent, or killed first)
        import warnings

        warnings.warn(
            f"entropylens: resume={after}: rank {rank} has no steps {last + 1}-{after} on disk in {run_dir} "
            "(the rank did not take part in them, or its job was killed before writing them); the run "
            "has none of them for this rank",
            stacklevel=3,
        )
    elif after > last:
        raise ValueError(
            f"resume={after}: step {after} of rank {rank} is not on disk in {run_dir} (its last "
            f"written step is {last}); resume from a checkpoint at or before step {last}, and call "
            "commit() when saving one (then every step up to it is on disk)"
        )
    _take_over(claim_as)
    _drop_claims_beyond(run_dir, rank, world_size)
    gone = {o for _, rel in mine if (o := _owner(rel)) is not None and o >= world_size}  # rank 0: ranks the
    # earlier job had and this one has not (resumed on fewer ranks): their later steps go too
    for path, rel in mine:
        step = _step_of(rel)
        if step is not None and step > after and (_owner(rel) == rank or _owner(rel) in gone):
            run_dir.at(path).remove()
        elif step is None and _owner(rel) in gone and rel.startswith("ranks/"):
            run_dir.at(path).remove()  # its status file: a rank that is gone is not running (or failed) any more
    _remove_leftovers(run_dir, {rank} | gone, after)
    return sorted(s for s in committed if s is not None and s > after)


def _remove_leftovers(run_dir, ranks: set[int], after: int) -> None:
    """Local runs: the killed job's hidden temporaries of these ranks (a file it was writing when killed:
    ``.NAME.PID.TID.tmp``, never read) and their directories of steps > ``after`` left empty (one walk).
    Object stores have neither (a file appears whole in one PUT; no directories)."""
    if run_dir.remote:
        return
    import os

    for dirpath, _dirnames, filenames in os.walk(run_dir.path, topdown=False):
        rel = posixpath.relpath(dirpath.replace(os.sep, "/"), run_dir.path.replace(os.sep, "/"))
        owner = _owner(rel)
        if owner not in ranks:
            continue
        for f in filenames:
            if f.startswith(".") and f.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(dirpath, f))
                except FileNotFoundError:
                    pass
        step = _step_of(rel)
        if step is not None and step > after and rel.split("/")[-1] == f"rank={owner}":
            try:
                os.rmdir(dirpath)  # only if empty
            except OSError:
                pass
