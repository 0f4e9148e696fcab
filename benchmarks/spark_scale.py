"""The analyses through Spark on a large run: time, JVM CPU and peak memory per analysis, and the rate
that sizes a cluster.

  python benchmarks/spark_scale.py --data DIR [--master local[2]] [--driver-memory 4g]
                                   [--analyses a,b,...] [--duckdb] [--json OUT] [--fixed-from SMALL_JSON]

Needs the spark extra (pyspark, sqlglot; Java 17+) and psutil (`pip install psutil`).

``DIR``: a root of runs, e.g. the compacted run ``benchmarks/scale.py --keep`` leaves (its ``scale``
folder). Each analysis the report runs (or ``--analyses``) goes through ``entropylens.read.connect(DIR,
engine="spark")`` and ``run_analysis``: the same SQL files, translated (entropylens/read/portable.py).
Spark's driver runs in its own JVM process (local mode: the executors are its threads); its CPU seconds
(utime + stime from /proc) and peak resident memory (VmHWM: the JVM's high-water mark so far) are read
before and after each analysis. ``--duckdb`` also times each analysis on DuckDB (this process's CPU) for a
per-analysis ratio.

Printed per analysis: wall s, JVM CPU s, token rows per JVM CPU second, peak JVM RSS so far; then the
whole set, and the arithmetic for ``--project-rows`` (default 1e9) on ``--cluster-cores`` cores from the
measured per-core rate (CPU seconds scale with rows for every analysis here: scans, hash aggregates,
windows over per-step or per-block rows, and one sort for the sample).
Last line: spark_rows=<n> spark_cpu_s=<all analyses> spark_wall_s=<all> spark_rows_per_cpu_s=<rate>
spark_peak_rss_gb=<peak>
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def jvm_process() -> Any:
    """The Spark driver's JVM (a psutil.Process): a java child of this process (pyspark's gateway launches it)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if "java" in child.name() or any("java" in part for part in child.cmdline()[:1]):
                return child
        except psutil.Error:
            continue
    raise SystemExit("no JVM child process found: did the Spark session start here?")


def jvm_cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def jvm_peak_gb(proc) -> float:
    """VmHWM (peak resident set) of the JVM, GB."""
    with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a root of runs (benchmarks/scale.py --keep's `scale`)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="4g")
    ap.add_argument("--analyses", default=None, help="comma-separated (default: the ones the report runs)")
    ap.add_argument("--duckdb", action="store_true", help="also time each analysis on DuckDB (CPU ratio)")
    ap.add_argument("--project-rows", type=float, default=1e9)
    ap.add_argument("--cluster-cores", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None, help="write the per-analysis figures here")
    ap.add_argument(
        "--fixed-from",
        type=Path,
        default=None,
        help="a --json of a small run (e.g. 200k rows): its per-analysis JVM CPU is taken as the fixed cost "
        "(planning, JIT, job start) and the projection uses the marginal rate (rows / (cpu - fixed))",
    )
    a = ap.parse_args()

    from entropylens.read import spark as es
    from entropylens.read.query import connect, run_analysis
    from entropylens.report.figures import FIGURES

    # the report's analyses, each once (default parameters: the report's own depend only on the run set)
    names = (
        [x.strip() for x in a.analyses.split(",")] if a.analyses else list(dict.fromkeys(f.analysis for f in FIGURES))
    )
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    spark = es.session(master=a.master, conf={"spark.driver.memory": a.driver_memory})
    jvm = jvm_process()
    con = connect(a.data, engine="spark", spark=spark)
    rows = int(con.execute("SELECT count(*) FROM tokens").fetchone()[0])
    print(
        f"Spark {spark.version} {a.master}, driver memory {a.driver_memory}: {rows:,} token rows under {a.data}; "
        f"session + connect + count {time.perf_counter() - t0:.1f} s wall, JVM CPU {jvm_cpu(jvm):.1f} s, "
        f"load average {load0:.1f}"
    )
    duck = connect(a.data) if a.duckdb else None
    print(
        f"{'analysis':<34} {'wall s':>8} {'JVM cpu s':>10} {'rows/cpu s':>12} {'peak GB':>8}"
        + (f" {'duckdb cpu s':>13} {'spark/duck':>10}" if duck else "")
    )
    tot_wall = tot_cpu = 0.0
    per: dict[str, dict] = {}
    for name in names:
        c0, w0 = jvm_cpu(jvm), time.perf_counter()
        df = run_analysis(con, name)
        wall, cpu = time.perf_counter() - w0, jvm_cpu(jvm) - c0
        tot_wall += wall
        tot_cpu += cpu
        per[name] = {"wall": wall, "cpu": cpu, "peak_gb": jvm_peak_gb(jvm)}
        line = f"{name:<34} {wall:8.1f} {cpu:10.1f} {rows / max(cpu, 1e-9):12,.0f} {jvm_peak_gb(jvm):8.2f}"
        if duck is not None:
            d0 = time.process_time()
            ddf = run_analysis(duck, name)
            dcpu = time.process_time() - d0
            line += f" {dcpu:13.1f} {cpu / max(dcpu, 1e-9):10.1f}"
            assert len(ddf) == len(df), (name, len(ddf), len(df))  # the parity test compares values
        print(line, flush=True)
    rate = rows / tot_cpu  # token rows per JVM CPU second, over the whole set
    proj_cpu = a.project_rows / rate
    if a.fixed_from is not None:
        small = json.loads(a.fixed_from.read_text())
        fixed = sum(small["analyses"][n]["cpu"] for n in names if n in small["analyses"])
        marginal = (rows - small["rows"]) / max(tot_cpu - fixed, 1e-9)  # rows per CPU second beyond the fixed cost
        proj_cpu = fixed + a.project_rows / marginal
        print(
            f"fixed cost (the {small['rows']:,}-row run's JVM CPU): {fixed:.1f} s; marginal rate {marginal:,.0f} token "
            f"rows per CPU second"
        )
    print(
        f"all {len(names)} analyses: {tot_wall:.1f} s wall, {tot_cpu:.1f} s JVM CPU ({rate:,.0f} token rows per CPU "
        f"second, over the whole set), peak JVM RSS {jvm_peak_gb(jvm):.2f} GB; load average now {os.getloadavg()[0]:.1f}"
    )
    print(
        f"projected at {a.project_rows:,.0f} rows: {proj_cpu:,.0f} CPU s; on {a.cluster_cores} cores at this rate "
        f"{proj_cpu / a.cluster_cores:,.0f} s (perfect scaling; shuffle and stragglers add to it)"
    )
    print(
        f"spark_rows={rows} spark_cpu_s={tot_cpu:.1f} spark_wall_s={tot_wall:.1f} spark_rows_per_cpu_s={rate:.0f} "
        f"spark_peak_rss_gb={jvm_peak_gb(jvm):.2f}"
    )
    if a.json is not None:
        a.json.write_text(json.dumps({"rows": rows, "analyses": per, "master": a.master}, indent=1))


if __name__ == "__main__":
    main()
