"""A run directory is written by one run: a Recorder refuses a directory that already holds
a run of the same id unless told to overwrite, and then removes exactly the old run's files; or,
told to resume, continues it after a committed step (:func:`resume`).

Each rank checks only its own files (``*/rank=R/*``, ``ranks/rank-R.json``), so ranks never race:
rank 0 also owns run.json, the compacted parts and the files of ranks >= world_size (an earlier run
with more ranks). Works on any storage.Location (local directory or s3://).
"""

from __future__ import annotations

import posixpath
import re

_RANK = re.compile(r"^rank=(\d+)$|^rank-(\d+)\.json$")
_STEP = re.compile(r"^step=(\d+)$")
_COMPACTED_COMMIT = re.compile(r"^compacted/steps/steps-(\d+)-(\d+)\.parquet$")  # compact.py's commit of LO..HI


class RunExistsError(ValueError):
    """The run directory already holds a run of this id (pass overwrite=True / --overwrite)."""


def runs_exist_message(runs_dir, existing: "list[str]") -> str:
    """The demo's refusal to mix new runs into old ones of the same ids (the CLI's early check and
    :func:`entropylens.demo.runner.run_demo` say it alike)."""
    return (f"{runs_dir} already holds run(s) {', '.join(existing)}; use --overwrite to replace them "
            "or --out for a new directory")


def _owner(rel: str) -> int | None:
    """The rank a file belongs to (None: run-level, e.g. run.json, compacted/...)."""
    for part in rel.split("/"):
        m = _RANK.match(part)
        if m:
            return int(m.group(1) or m.group(2))
    return None


def old_files(run_dir, rank: int, world_size: int, listing: "list[str] | None" = None) -> list[str]:
    """Files under ``run_dir`` (a storage.Location) that an earlier run left for this rank to own
    (``listing``: run_dir's files, when the caller has listed them already)."""
    out = []
    for path in sorted(run_dir.files()) if listing is None else listing:
        owner = _owner(posixpath.relpath(path, run_dir.path))
        if owner == rank or (rank == 0 and (owner is None or owner >= world_size)):
            out.append(path)
    return out


def claim(run_dir, rank: int, world_size: int, overwrite: bool) -> int:
    """Refuse (RunExistsError) or, with ``overwrite``, remove what an earlier run left for this rank.
    Returns the number of files removed."""
    old = old_files(run_dir, rank, world_size)
    if not old:
        return 0
    if not overwrite:
        shown = ", ".join(posixpath.relpath(p, run_dir.path) for p in old[:2]) + (", ..." if len(old) > 2 else "")
        raise RunExistsError(
            f"{run_dir} already holds a run ({len(old)} file(s): {shown}); pass resume=K to continue it after "
            "its step K (a checkpoint's last step), overwrite=True (CLI: --overwrite) to replace it (its files are "
            "deleted), or another run id (the default id is new each time)"
        )
    for p in old:
        run_dir.at(p).remove()
    return len(old)


def _step_of(rel: str) -> int | None:
    for part in rel.split("/"):
        m = _STEP.match(part)
        if m:
            return int(m.group(1))
    return None


def resume(run_dir, rank: int, world_size: int, after: int) -> list[int]:
    """Continue the run in ``run_dir`` after step ``after`` (>= 0). This rank's files of later steps
    are removed: a killed job's uncommitted leftovers, and the steps after a checkpoint that the
    resumed job records again. Returns the committed steps removed. A job resumed on fewer ranks:
    rank 0 also removes the later steps of the ranks it no longer has (their steps up to ``after``
    stay); on more ranks, a new rank has nothing to remove. Compacted steps (entropylens compact,
    whose parts span steps and ranks) must all lie at or before ``after``: they stay as they are.
    Refused with one line: no run there, compacted steps after ``after``, or ``after`` beyond this
    rank's last committed step."""
    listing = sorted(run_dir.files())
    mine = [(p, posixpath.relpath(p, run_dir.path)) for p in old_files(run_dir, rank, world_size, listing)]
    compacted = [(int(m.group(1)), int(m.group(2))) for p in listing
                 if (m := _COMPACTED_COMMIT.match(posixpath.relpath(p, run_dir.path)))]
    if not listing:
        raise ValueError(f"resume: {run_dir} holds no run to resume")
    if not any(_owner(rel) == rank for _, rel in mine) and rank > 0 and not compacted:
        return []  # a rank the earlier job did not have (the job resumed on more ranks): nothing to remove
    if compacted and max(hi for _, hi in compacted) > after:
        lo, hi = max(compacted, key=lambda r: r[1])
        raise ValueError(f"resume={after}: steps {lo}-{hi} of {run_dir} were compacted (entropylens compact) and "
                         f"reach past step {after}; compacted steps cannot be removed: resume after step {hi} or "
                         "later, or continue into a new run id")
    committed = [_step_of(rel) for _, rel in mine
                 if rel.startswith("steps/") and _owner(rel) == rank and rel.endswith("/steps.parquet")]
    last = max([s for s in committed if s is not None] + [hi for _, hi in compacted], default=-1)
    if after > last and rank > 0:  # rank 0's check guards K; this rank missed steps (absent, or killed first)
        import warnings

        warnings.warn(f"entropylens: resume={after}: rank {rank} has no steps {last + 1}-{after} on disk in {run_dir} "
                      "(the rank did not take part in them, or its job was killed before writing them); the run "
                      "has none of them for this rank", stacklevel=3)
    elif after > last:
        raise ValueError(f"resume={after}: step {after} of rank {rank} is not on disk in {run_dir} (its last "
                         f"written step is {last}); resume from a checkpoint at or before step {last}, and call "
                         "commit() when saving one (then every step up to it is on disk)")
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

    for dirpath, dirnames, filenames in os.walk(run_dir.path, topdown=False):
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
