"""Scale figures: a large synthetic run in the recorder's real layout, the whole report on it before
and after compaction, and the arithmetic for a 7B DAPO run.

  python benchmarks/scale.py [--rows 100000000] [--ranks 64] [--rows-per-file 4096] [--dir DIR]
                             [--workers 2] [--keep] [--skip-uncompacted]
  python benchmarks/scale.py --data DIR --phase before|compact|after   (reuse a --keep'd DIR)
        [--memory-limit 4GB] [--threads N] [--before-cap-cpu SECONDS] [--before-json PATH]

Token rows are written by entropylens.record.writing.parquet (write_tokens / write_steps / write_sequences: the
recorder's Hive layout, encodings and atomic writes), one file per (step, rank) holding all the
step's updates (``updates-0-U.parquet``, as the recorder coalesces small updates), with values shaped
like a toy GRPO run (benchmarks/writer.py's ``toy_like_rows``; a 2M-row pool generated once per
worker with vectorised numpy, sliced per file, sequence ids made unique and entropy decaying with
the step); at least --rows rows (whole steps). The default layout (64 ranks x 4,096 rows per file)
is what a multi-node run writes at the small ``sample`` fraction that keeps it on one machine (see
the arithmetic printed at the end). Small mode for tests: ``--rows 20000 --ranks 2
--rows-per-file 2048 --workers 1``.

Printed: bytes per token row (Parquet, before / after compaction); the whole report
(entropylens.report.build.write_report: connect, every analysis it runs, figures, HTML) before compaction,
the compaction time (entropylens.read.compact), the report after; inside the report the connect and each
analysis are timed, the analyses the report does not run are timed after it; then the per-query
ratios. Each timing is wall-clock and CPU seconds of this process (DuckDB's threads included): on a
shared machine the wall time is inflated by others' load (printed), the CPU time much less so;
CPU / 2 estimates the wall time on 2 idle cores.
DuckDB's memory: --memory-limit (default 4GB; DuckDB's own default is 80% of RAM) is set on the
report's connections, with a temporary directory for what spills. --before-cap-cpu S stops the report
on the original files once this process has spent S CPU seconds in it (the queries are interrupted):
its CPU time is then printed as a LOWER BOUND (>= S) and so is the speed-up. --before-json PATH reads
the before phase's figures from another directory (e.g. a hard-linked copy of the original files
measured while this one was compacted).
Last line: rows=<n> bytes_per_row=<b> report_s=<before> compacted_report_s=<after>
compacted_report_cpu_s=<after, CPU> speedup_cpu=<whole report, CPU>
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from writer import toy_like_rows  # noqa: E402

from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens  # noqa: E402
from entropylens.schema import STEPS  # noqa: E402

POOL_ROWS = 1 << 21
UPDATES = 4  # policy updates per step (mini-batches), all in the (step, rank) file
# 7B DAPO (DESIGN.md, #12): 512 prompts x 16 responses x up to 16k response tokens per step
PROMPTS, RESPONSES, MAX_LEN = 512, 16, 16_384


def _steps_rows(rng, quadrant: np.ndarray, update: np.ndarray) -> list[dict]:
    rows = []
    for u in range(UPDATES):
        q = quadrant[update == u]
        counts = np.bincount(q, minlength=5)
        row = {
            c.name: float(rng.random())
            for c in STEPS
            if c.dtype.startswith("float") and c.name not in ("step", "update", "rank")
        }
        row.update(
            update=u,
            n_tokens=len(q),
            n_za=int(counts[0]),
            n_pa_hp=int(counts[1]),
            n_pa_lp=int(counts[2]),
            n_na_hp=int(counts[3]),
            n_na_lp=int(counts[4]),
            lr=1e-6,
        )
        rows.append(row)
    return rows


def write_steps_range(run_dir: str, steps: list[int], ranks: int, rows_per_file: int, n_steps: int) -> int:
    """Write the files of ``steps`` (all ranks); returns the token rows written."""
    run_dir = Path(run_dir)
    pool = toy_like_rows(POOL_ROWS, seed=steps[0] if steps else 0)
    for k in ("prob", "ratio", "entropy_ratio"):  # derived by the views, never stored
        pool.pop(k)
    rng = np.random.default_rng(1 + (steps[0] if steps else 0))
    n = rows_per_file
    per_update = n // UPDATES
    update = np.repeat(np.arange(UPDATES, dtype=np.int16), per_update)
    update = np.concatenate([update, np.full(n - len(update), UPDATES - 1, np.int16)])
    written = 0
    for step in steps:
        decay = np.float32(1.0 - 0.9 * step / max(n_steps - 1, 1))  # entropy falls over the run
        for rank in range(ranks):
            off = int(rng.integers(0, POOL_ROWS - n))
            chunk = {k: v[off : off + n] for k, v in pool.items()}
            seq = chunk["seq"] - chunk["seq"][0]
            chunk["seq"] = (seq + (step * ranks + rank) * (n // 12 + 8)).astype(np.int32)  # unique in the run
            chunk["entropy"] = chunk["entropy"] * decay
            chunk["old_entropy"] = chunk["old_entropy"] * decay
            chunk["update"] = update
            write_tokens(run_dir, step, rank, (0, UPDATES - 1), chunk)
            n_seq = int(seq[-1]) + 1
            write_sequences(
                run_dir,
                step,
                rank,
                0,
                {
                    "seq": np.arange(n_seq, dtype=np.int32) + chunk["seq"][0],
                    "group": np.arange(n_seq, dtype=np.int32) // 16,
                    "reward": rng.random(n_seq).astype(np.float32),
                    "advantage": rng.standard_normal(n_seq).astype(np.float32),
                    "length": np.bincount(seq).astype(np.int32),
                },
            )
            write_steps(run_dir, step, rank, _steps_rows(rng, chunk["quadrant"], update))  # commits (step, rank)
            written += n
    return written


def build(run_dir: Path, rows: int, ranks: int, rows_per_file: int, workers: int) -> tuple[int, int]:
    n_steps = max(1, -(-rows // (ranks * rows_per_file)))  # at least `rows` rows
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(
        json.dumps(
            {
                "run": run_dir.name,
                "method": "dapo",
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.28,
                "tau": 0.5,
                "world_size": ranks,
                "sample": None,
                "schema_version": 1,
                "config": {"method": "dapo"},
            }
        )
    )
    chunks = [list(range(n_steps))[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers) as ex:
        written = sum(
            ex.map(
                write_steps_range,
                [str(run_dir)] * workers,
                chunks,
                [ranks] * workers,
                [rows_per_file] * workers,
                [n_steps] * workers,
            )
        )
    return written, n_steps


def tree_bytes(path: Path, part: str) -> tuple[int, int]:
    """(bytes, files) of the Parquet files under path whose path contains ``part``."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for f in names:
            p = os.path.join(dirpath, f)
            if f.endswith(".parquet") and part in p:
                total += os.path.getsize(p)
                files += 1
    return total, files


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CapReached(Exception):
    """The report passed --before-cap-cpu CPU seconds and was stopped."""


def _settings(memory_limit: str | None, threads: int | None, spill: Path) -> dict:
    """DuckDB settings of the measured connections (query.connect applies them before its lockdown)."""
    spill.mkdir(parents=True, exist_ok=True)
    out = {"temp_directory": str(spill)}
    if memory_limit:
        out["memory_limit"] = memory_limit
    if threads:
        out["threads"] = int(threads)
    return out


def measure(
    run_dir: Path,
    out: Path,
    *,
    memory_limit: str | None = "4GB",
    threads: int | None = None,
    cap_cpu: float | None = None,
) -> dict:
    """Wall and CPU seconds (this process, all DuckDB threads) of the whole report
    (entropylens.report.build.write_report: connect, every analysis it runs, figures, HTML), split into
    connect, each analysis (timed inside the report) and the rest (figures, HTML); then the analyses
    the report does not run, on one more connection. ``memory_limit`` / ``threads``: DuckDB settings
    of those connections (spilling under out/../duckdb-spill). ``cap_cpu``: stop the report once it
    has spent that many CPU seconds (a watchdog interrupts the running query); the result then has
    ``capped`` = True and its CPU time is a lower bound."""
    import entropylens.report.build as report
    from entropylens.read.query import QueryError, connect, list_analyses, run_analysis

    parts: dict[str, list[float]] = {}
    spill = out.parent / "duckdb-spill"
    cons: list = []
    capped = threading.Event()
    done = threading.Event()

    def connect_set(*a, **k):
        con = connect(*a, settings=_settings(memory_limit, threads, spill), **k)
        cons.append(con)
        return con

    def watchdog(c_start: float) -> None:
        while not done.wait(0.5):
            if _cpu() - c_start > cap_cpu:
                capped.set()
                for con in cons:
                    try:
                        con.interrupt()
                    except Exception:  # a closed connection
                        pass

    def timing(label, fn):
        def wrapped(*a, **k):
            c0, t0 = _cpu(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                w, c = parts.get(label, [0.0, 0.0])
                parts[label] = [w + time.perf_counter() - t0, c + _cpu() - c0]

        return wrapped

    def run_capped(con, name, **p):
        if capped.is_set():
            raise CapReached(name)
        try:
            return timing(name, orig_run)(con, name, **p)
        except QueryError:
            if capped.is_set():  # interrupted by the watchdog
                raise CapReached(name) from None
            raise

    shutil.rmtree(out, ignore_errors=True)
    orig_connect, orig_run = report.connect, report.run_analysis
    report.connect = timing("connect", connect_set)
    report.run_analysis = run_capped
    stopped_in = None
    c0, t0 = _cpu(), time.perf_counter()
    if cap_cpu:
        threading.Thread(target=watchdog, args=(c0,), daemon=True).start()
    try:
        report.write_report(run_dir, out)
    except CapReached as e:
        stopped_in = str(e)
    finally:
        report_s, report_cpu = time.perf_counter() - t0, _cpu() - c0
        done.set()
        report.connect, report.run_analysis = orig_connect, orig_run
    in_report = dict(parts)
    if stopped_in is None:
        con = connect_set(run_dir)
        for name, _ in list_analyses():
            if name not in in_report:
                timing(name, run_analysis)(con, name)
        con.close()
    shutil.rmtree(spill, ignore_errors=True)
    sql = [v for k, v in in_report.items() if k != "connect"]
    return {
        "report_s": report_s,
        "report_cpu": report_cpu,
        "parts": parts,
        "in_report": sorted(in_report),
        "sql_s": sum(w for w, _ in sql),
        "sql_cpu": sum(c for _, c in sql),
        "load": os.getloadavg()[0],
        "capped": stopped_in is not None,
        "stopped_in": stopped_in,
        "cap_cpu": cap_cpu,
        "memory_limit": memory_limit,
        "threads": threads,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }


def _show(label: str, m: dict) -> None:
    if m.get("capped"):
        print(
            f"{label}: STOPPED at the CPU cap ({m['cap_cpu']:.0f} s) while running {m['stopped_in']}: "
            f"whole report >= {m['report_cpu']:.1f} s CPU (a LOWER BOUND), {m['report_s']:.1f} s wall so far; "
            f"load average {m['load']:.1f}; peak RSS {m.get('max_rss_gb', float('nan')):.1f} GB "
            f"(DuckDB memory_limit {m.get('memory_limit')}); the parts finished before the stop:"
        )
    else:
        print(
            f"{label}: whole report {m['report_s']:.1f} s wall / {m['report_cpu']:.1f} s CPU "
            f"(connect + analyses {m['parts']['connect'][1] + m['sql_cpu']:.1f} s CPU, figures and HTML "
            f"{m['report_cpu'] - m['parts']['connect'][1] - m['sql_cpu']:.1f} s CPU); load average {m['load']:.1f}; "
            f"peak RSS {m.get('max_rss_gb', float('nan')):.1f} GB (DuckDB memory_limit {m.get('memory_limit')})"
        )
    for name, (w, c) in sorted(m["parts"].items(), key=lambda kv: -kv[1][1]):
        where = "" if name in m["in_report"] else "  (not in the report)"
        print(f"  {name:30s} {w:8.2f} s wall {c:8.2f} s CPU{where}")


def arithmetic(bytes_per_row: float, rows_per_s_report: float) -> None:
    rows_step = PROMPTS * RESPONSES * MAX_LEN
    gb_1000 = rows_step * 1000 * bytes_per_row / 1e9
    print(
        f"\n7B DAPO run: {PROMPTS} prompts x {RESPONSES} responses x {MAX_LEN:,} tokens = "
        f"{rows_step:,} token rows per step (at full response length)"
    )
    print(
        f"  at {bytes_per_row:.1f} B/row (measured above, compacted): {rows_step * bytes_per_row / 1e9:,.2f} GB "
        f"per step, {gb_1000:,.0f} GB = {gb_1000 / 1e3:,.1f} TB per 1,000 steps"
    )
    for budget_gb in (100, 500):
        s = budget_gb / gb_1000
        print(
            f"  sample={s:.2g} keeps 1,000 steps within {budget_gb} GB of token rows "
            f"({s * rows_step * 1000 / 1e6:,.0f}M rows)"
        )
    rows_60 = rows_per_s_report * 60
    s = rows_60 / (rows_step * 1000)
    print(
        f"  the compacted analyses ran at {rows_per_s_report / 1e6:.1f}M rows/s on 2 cores (CPU seconds / 2): "
        f"a 60 s report holds "
        f"{rows_60 / 1e6:,.0f}M rows -> sample={s:.2g} for 1,000 steps "
        f"({s * rows_step:,.0f} rows per step, ~{s * rows_step / (PROMPTS * RESPONSES):.1f} per response)"
    )
    print(
        "  steps rows stay exact at any sample (aggregates over all tokens on the device): "
        "1,000 steps x 16 updates x 64 ranks = 1.0M rows, a few MB"
    )


def token_rows(run_dir: Path) -> int:
    import pyarrow.parquet as pq

    return sum(
        pq.read_metadata(os.path.join(d, f)).num_rows
        for top in (run_dir / "tokens", run_dir / "compacted" / "tokens")
        for d, _, names in os.walk(top)
        for f in names
        if f.endswith(".parquet")
    )


def speedups(before: dict, after: dict) -> None:
    if before.get("capped"):
        print(
            f"compaction speed-up: the report on the original files was stopped at {before['report_cpu']:.1f} s CPU "
            f"(cap {before['cap_cpu']:.0f} s, in {before['stopped_in']}): whole report >= "
            f"x{before['report_cpu'] / after['report_cpu']:.1f} CPU (LOWER BOUND; compacted "
            f"{after['report_cpu']:.1f} s CPU)"
        )
    print("compaction speed-up (CPU seconds, original / compacted), by query:")
    for name, (_, c) in sorted(after["parts"].items(), key=lambda kv: -before["parts"].get(kv[0], [0, 0])[1]):
        b = before["parts"].get(name, [float("nan")] * 2)[1]
        print(f"  {name:30s} {b:8.2f} / {c:7.2f} = x{b / max(c, 1e-9):.1f}")
    if before.get("capped"):
        return  # the whole-report ratio is the lower bound above
    print(
        f"  whole report: x{before['report_s'] / after['report_s']:.1f} wall, "
        f"x{before['report_cpu'] / after['report_cpu']:.1f} CPU; its connect + analyses: "
        f"x{(before['sql_cpu'] + before['parts']['connect'][1]) / (after['sql_cpu'] + after['parts']['connect'][1]):.1f} CPU"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rows-per-file", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2, help="processes writing the files")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the data (default: removed at the end)")
    ap.add_argument(
        "--data",
        type=Path,
        default=None,
        help="a directory kept by an earlier --keep run (DATA/scale): no generation; with "
        "--phase, one part of the benchmark at a time",
    )
    ap.add_argument("--phase", choices=("all", "before", "compact", "after"), default="all")
    ap.add_argument("--skip-uncompacted", action="store_true", help="do not time the report before compaction")
    ap.add_argument(
        "--memory-limit",
        default="4GB",
        help="DuckDB memory_limit of the report's connections ('' for DuckDB's default, 80%% of RAM)",
    )
    ap.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: DuckDB's, one per core)")
    ap.add_argument(
        "--before-cap-cpu",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the report on the original files after this many CPU seconds; its time and the "
        "speed-up are then printed as lower bounds",
    )
    ap.add_argument(
        "--before-json", type=Path, default=None, help="the before phase's figures (before.json) from another directory"
    )
    a = ap.parse_args()
    settings = {"memory_limit": a.memory_limit or None, "threads": a.threads}
    base = a.data or Path(tempfile.mkdtemp(prefix="entropylens-scale-", dir=a.dir))
    keep = a.keep or a.data is not None
    run_dir = base / "scale"
    try:
        print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
        if (run_dir / "run.json").exists():
            rows = token_rows(run_dir)
            print(f"{rows:,} token rows in {run_dir} (kept from an earlier run)")
        else:
            (rows, n_steps), t_gen = timed(lambda: build(run_dir, a.rows, a.ranks, a.rows_per_file, a.workers))
            print(
                f"{rows:,} token rows: {n_steps} steps x {a.ranks} ranks x {a.rows_per_file:,} rows per file "
                f"written in {t_gen:.0f} s ({rows / t_gen / 1e6:.2f}M rows/s, {a.workers} processes)"
            )
        size, files = tree_bytes(run_dir / "tokens", "")
        if files:
            print(
                f"original tokens: {files:,} files, {size / 1e9:.2f} GB, {size / rows:.1f} bytes per row; "
                f"all tables: {sum(tree_bytes(run_dir / t, '')[1] for t in ('tokens', 'sequences', 'steps')):,} files"
            )
        before = after = None
        if a.phase in ("all", "before") and not a.skip_uncompacted:
            before = measure(run_dir, base / "report-before", cap_cpu=a.before_cap_cpu, **settings)
            _show("original files", before)
            (base / "before.json").write_text(json.dumps(before))
        if a.phase in ("all", "compact"):
            from entropylens.read.compact import compact

            c0 = _cpu()
            res, t_compact = timed(lambda: compact(run_dir, grace_s=0))
            print(
                f"compaction: {t_compact:.0f} s wall, {_cpu() - c0:.0f} s CPU, load average "
                f"{os.getloadavg()[0]:.1f} ({'; '.join(r.summary() for r in res)})"
            )
        csize, cfiles = tree_bytes(run_dir / "compacted" / "tokens", "")
        if cfiles:
            print(f"compacted tokens: {cfiles} files, {csize / 1e9:.2f} GB, {csize / rows:.1f} bytes per row")
        if a.phase in ("all", "after"):
            after = measure(run_dir, base / "report-after", **settings)
            _show("compacted", after)
            (base / "after.json").write_text(json.dumps(after))
        before_json = a.before_json or base / "before.json"
        if before is None and before_json.exists():
            before = json.loads(before_json.read_text())
            print(f"before phase read from {before_json}")
        if before and after:
            speedups(before, after)
        if after and cfiles:
            arithmetic(csize / rows, rows / (after["report_cpu"] / 2))
            print(
                f"rows={rows} bytes_per_row={csize / rows:.2f} "
                f"report_s={before['report_s'] if before else float('nan'):.1f}"
                f"{' (lower bound)' if before and before.get('capped') else ''} "
                f"compacted_report_s={after['report_s']:.1f} compacted_report_cpu_s={after['report_cpu']:.1f} "
                f"speedup_cpu={before['report_cpu'] / after['report_cpu'] if before else float('nan'):.1f}"
                f"{' (lower bound)' if before and before.get('capped') else ''}"
            )
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"data kept in {base}")


if __name__ == "__main__":
    main()
