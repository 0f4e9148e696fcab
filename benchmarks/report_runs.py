"""The report over many runs: the whole report (entropylens.report.build.write_report) over 1 run and over N
copies of it (default 50), each copy its own run id, method cycled so figures hold N series.

  python benchmarks/report_runs.py RUN_DIR [--copies 50] [--group-by method]

RUN_DIR: one recorded run (e.g. entropylens-demo/runs/grpo-s0 from `entropylens demo`). The copies are
hard links (no extra disk), run.json rewritten per copy. Printed: seconds for 1 run and for N runs, and
the ratio per run; last line: runs=<N> report_1_s=<a> report_n_s=<b> per_run_ratio=<b / (N a)>.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path


def copies(src: Path, dst: Path, n: int) -> None:
    info = json.loads((src / "run.json").read_text())
    methods = ["grpo", "dapo", "ce_gppo", "gppo", "cispo"]
    for i in range(n):
        d = dst / f"run-{i:02d}"
        for f in src.rglob("*"):
            if f.is_file() and f.name != "run.json":
                t = d / f.relative_to(src)
                t.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, t)
        cfg = {**info.get("config", {}), "lr": 1e-4 * (1 + i % 5), "seed": i // 5}
        (d / "run.json").write_text(
            json.dumps({**info, "run": d.name, "method": methods[i % len(methods)], "config": cfg})
        )


def timed(path, out, **kw) -> float:
    from entropylens.report.build import write_report

    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_report(path, out, **kw)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--copies", type=int, default=50)
    ap.add_argument("--group-by", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="report-runs-"))
    try:
        copies(a.run, work / "one", 1)
        copies(a.run, work / "many", a.copies)
        timed(work / "one", work / "warm")  # imports, matplotlib's font cache
        one = timed(work / "one", work / "rep1", group_by=a.group_by)
        many = timed(work / "many", work / "repn", group_by=a.group_by)
        print(f"report over 1 run: {one:.2f} s; over {a.copies} runs: {many:.2f} s ({many / a.copies:.3f} s per run)")
        print(f"runs={a.copies} report_1_s={one:.2f} report_n_s={many:.2f} per_run_ratio={many / (a.copies * one):.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
