"""What the per-file schema check costs when a reader opens a run (entropylens/read/catalog.py, rule 6:
each file's footer read with its PAR1 check and held against the schema contract, cached per process).
Asserts nothing about time.

  python benchmarks/file_check.py [--steps 334] [--rounds 3]

A run of --steps steps x 3 tables (tokens, sequences, steps: 1,002 files at the default) in the recorder's
layout. Measured in one process, best of --rounds, each round on a cold footer cache and then a warm one:
  listing + PAR1   what the catalog read before the check: the run's listing and 4 bytes per file (baseline)
  scan, cold       catalog.scan with an empty footer cache: the listing, the last 64 KiB of every file,
                   footers parsed and checked against the contract
  scan, warm       catalog.scan again in the same process (a reconnect, `watch`): a stat per file
  connect, cold / warm   query.connect (views built, steps materialized, lockdown) on each cache
Last line: check_ratio=<connect cold / connect warm> per_file_us=<(scan cold - listing + PAR1) / files>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from layout_run import make_run  # noqa: E402

from entropylens.read import catalog as cat  # noqa: E402
from entropylens.read.query import connect  # noqa: E402
from entropylens.storage import location  # noqa: E402


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _listing_and_magic(d) -> int:
    """The catalog's work before the check: list the run's tables, read each file's last 4 bytes."""
    sizes = {p: s for t in cat.TABLE_DIRS if (d / t).exists() for p, s in (d / t).files().items()}
    tails = d.tails(sizes, 4)
    return sum(t == b"PAR1" for t in tails)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=334)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = make_run(tmp, "run", steps=a.steps, rows=256)
        n = len(d.files())
        best: dict[str, float] = {}

        def keep(name: str, s: float) -> None:
            best[name] = min(best.get(name, s), s)

        warnings.simplefilter("ignore")
        for _ in range(a.rounds):
            keep("listing + PAR1", _timed(lambda: _listing_and_magic(location(d.path))))
            cat._FOOTERS.clear()
            keep("scan, cold", _timed(lambda: cat.scan(d.path)))
            keep("scan, warm", _timed(lambda: cat.scan(d.path)))
            cat._FOOTERS.clear()
            keep("connect, cold", _timed(lambda: connect(d.path)))
            keep("connect, warm", _timed(lambda: connect(d.path)))
        base = best["listing + PAR1"]
        print(f"{n} files ({a.steps} steps x tokens, sequences, steps), best of {a.rounds}")
        for name, s in best.items():
            print(f"  {name:<16} {s * 1000:8.1f} ms   {s / base:5.2f}x listing + PAR1")
        per_file = (best["scan, cold"] - base) / n * 1e6
        print(f"check_ratio={best['connect, cold'] / best['connect, warm']:.3f} per_file_us={per_file:.0f}")


if __name__ == "__main__":
    main()
