"""A run directory is written by one run (#13): a Recorder refuses a directory that already holds
a run of the same id unless told to overwrite, and then removes exactly the old run's files.

Each rank checks only its own files (``*/rank=R/*``, ``ranks/rank-R.json``), so ranks never race:
rank 0 also owns run.json, the compacted parts and the files of ranks >= world_size (an earlier run
with more ranks). Works on any storage.Location (local directory or s3://).
"""

from __future__ import annotations

import posixpath
import re

_RANK = re.compile(r"^rank=(\d+)$|^rank-(\d+)\.json$")


class RunExistsError(ValueError):
    """The run directory already holds a run of this id (pass overwrite=True / --overwrite)."""


def runs_exist_message(runs_dir, existing: "list[str]") -> str:
    """The demo's refusal to mix new runs into old ones of the same ids (the CLI's early check and
    :func:`entropylens.demo.run_demo` say it alike)."""
    return (f"{runs_dir} already holds run(s) {', '.join(existing)}; use --overwrite to replace them "
            "or --out for a new directory")


def _owner(rel: str) -> int | None:
    """The rank a file belongs to (None: run-level, e.g. run.json, compacted/...)."""
    for part in rel.split("/"):
        m = _RANK.match(part)
        if m:
            return int(m.group(1) or m.group(2))
    return None


def old_files(run_dir, rank: int, world_size: int) -> list[str]:
    """Files under ``run_dir`` (a storage.Location) that an earlier run left for this rank to own."""
    out = []
    for path in sorted(run_dir.files()):
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
            f"{run_dir} already holds a run ({len(old)} file(s): {shown}); pass overwrite=True "
            "(CLI: --overwrite) to replace it, or another run id (the default id is new each time)"
        )
    for p in old:
        run_dir.at(p).remove()
    return len(old)
