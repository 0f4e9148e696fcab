"""run.json: what it says about a run (:class:`RunInfo`), and how it and each rank's status file are written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ... import storage
from ...schema import QUADRANT_NAMES, SCHEMA_VERSION


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: Path | storage.Location, text: str, fsync: bool = False) -> None:
    """Local: a hidden temporary file renamed into place; object storage: one PUT (storage.py)."""
    storage.location(path).write_text(text, fsync=fsync)


@dataclass
class RunInfo:
    """What run.json says about the run (the recorder updates status and loss settings)."""

    run: str
    world_size: int
    config: dict
    eps_low: float
    eps_high: float
    tau: float
    sample: float
    status: str = "running"
    loss: dict | None = None  # the loss's run-level settings (method, eps, agg, ...)
    started_at: str = field(default_factory=utc_now)
    resumed: list = field(default_factory=list)  # [{"after_step": K, "at": time}] per resume (Recorder(resume=))
    # the oldest schema version any of the run's files was written with (a run resumed by a newer
    # version keeps the older one: readers null the columns whose meaning changed since, schema.changed_meaning)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self, error: BaseException | None) -> dict[str, Any]:
        loss = self.loss or {}
        return {
            "run": self.run,
            "method": self.config.get("method") or loss.get("method"),
            "config": self.config,
            "model": self.config.get("model"),
            "seed": self.config.get("seed"),
            "schema_version": self.schema_version,
            "world_size": self.world_size,
            "started_at": self.started_at,
            "heartbeat_at": utc_now(),
            "status": self.status,
            "error": None if error is None else str(error),
            "loss": self.loss,
            "eps_low": loss.get("eps_low", self.eps_low),
            "eps_high": loss.get("eps_high", self.eps_high),
            "tau": loss.get("tau", self.tau),
            "sample": self.sample,
            "quadrants": QUADRANT_NAMES,
            **({"resumed": self.resumed} if self.resumed else {}),
        }


def write_run_json(
    run_dir, rank: int, info: RunInfo, error: BaseException | None, heartbeat_s: float, fsync: bool
) -> None:
    """run.json (rank 0) from ``info``. With several ranks every rank also writes its own
    ``ranks/rank-R.json`` (status, heartbeat, error): the readers combine them into the run's status,
    so a rank that failed or died stays visible. ``fsync``: the final status (close) reaches the
    disk; heartbeats need not."""
    data = {**info.to_dict(error), "heartbeat_s": heartbeat_s}  # readers: stale after a few
    if info.world_size > 1:
        mine = {"rank": rank, **{k: data[k] for k in ("status", "heartbeat_at", "heartbeat_s", "error")}}
        atomic_write_text(run_dir / "ranks" / f"rank-{rank}.json", json.dumps(mine) + "\n", fsync=fsync)
    if rank == 0:
        atomic_write_text(run_dir / "run.json", json.dumps(data, indent=2, default=str) + "\n", fsync=fsync)
