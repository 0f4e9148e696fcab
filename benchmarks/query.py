"""Analyses and the whole report over a 10M-token-row run (synthetic, shaped like a toy run).

  python benchmarks/query.py [--rows 10000000] [--steps 100]

Prints each analysis' time, the whole report's time, DuckDB against pandas for the heaviest
analysis, and the same run before and after `entropylens compact` (4,000 small files, and the big
run's analyses), all in one process; best of 3 for the compaction ratios.
Last line: report_s=<whole report seconds> rows=<token rows>
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from writer import toy_like_rows  # noqa: E402

from entropylens.read.compact import compact  # noqa: E402
from entropylens.read.query import connect, list_analyses, run_analysis  # noqa: E402
from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens  # noqa: E402
from entropylens.report.build import write_report  # noqa: E402
from entropylens.rl.aggregates import AGG_NAMES  # noqa: E402


def build_run(root: Path, rows: int, steps: int, files_per_step: int, run: str = "synthetic") -> Path:
    """A run directory with `rows` token rows spread over `steps` x `files_per_step` files."""
    d = root / run
    d.mkdir(parents=True)
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": run,
                "method": "grpo",
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.2,
                "tau": 0.5,
                "schema_version": 1,
                "config": {"method": "grpo"},
            }
        )
    )
    data = toy_like_rows(rows)
    rng = np.random.default_rng(1)
    data["entropy"] = data["entropy"] * np.repeat(np.linspace(1.0, 0.1, steps), rows // steps + 1)[:rows]
    data["logit_grad_norm"] = data["logit_grad_norm"].astype(np.float32)
    per = rows // (steps * files_per_step)
    i = 0
    for s in range(steps):
        for u in range(files_per_step):
            chunk = {k: v[i : i + per] for k, v in data.items()}
            chunk["update"] = np.full(len(chunk["seq"]), u, np.int16)
            write_tokens(d, s, 0, u, chunk)
            i += per
        write_steps(
            d,
            s,
            0,
            [
                {
                    **{k: float(rng.random()) for k in AGG_NAMES},
                    "update": u,
                    "n_tokens": per,
                    "grad_norm": float(rng.random()),
                    "lr": 1e-3,
                }
                for u in range(files_per_step)
            ],
        )
        n_seq = 256
        write_sequences(
            d,
            s,
            0,
            0,
            {
                "seq": np.arange(n_seq, dtype=np.int32),
                "group": np.arange(n_seq) // 8,
                "reward": rng.random(n_seq).astype(np.float32),
                "advantage": rng.standard_normal(n_seq).astype(np.float32),
                "length": np.full(n_seq, 16, np.int32),
            },
        )
    return d


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def best(fn, n: int = 3):
    """(result, best wall time of n runs)."""
    out, ts = None, []
    for _ in range(n):
        out, t = timed(fn)
        ts.append(t)
    return out, min(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--compaction-only", action="store_true", help="only the 4,000-file compaction ratio")
    a = ap.parse_args()
    if a.compaction_only:
        with tempfile.TemporaryDirectory() as tmp:
            small_files_ratio(Path(tmp))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_dir, t_build = timed(lambda: build_run(root / "big", a.rows, a.steps, 8))
        print(f"{a.rows:,} token rows, {a.steps} steps x 8 files, written in {t_build:.1f} s")
        con = connect(run_dir)
        total = 0.0
        times = {}
        for name, _ in list_analyses():
            _, t = timed(lambda: run_analysis(con, name))
            times[name] = t
            total += t
            print(f"  {name:<28} {t:6.2f} s")
        print(f"  {'all analyses':<28} {total:6.2f} s")
        _, t_report = timed(lambda: write_report(run_dir, root / "report"))
        print(f"whole report (analyses + 11 figures + HTML): {t_report:.2f} s")

        heaviest = max(times, key=times.get)
        print(f"\nheaviest analysis: {heaviest}; the same question in pandas (entropy change per quadrant):")
        cols = "step, rank, seq, pos, update, quadrant, entropy, old_entropy"
        df, t_load = timed(lambda: con.execute(f"SELECT {cols} FROM tokens WHERE quadrant <> 'ZA'").df())

        def pandas_change():
            d = df.sort_values(["step", "rank", "seq", "pos", "update"])
            nxt = d.groupby(["step", "rank", "seq", "pos"], sort=False)["entropy"].shift(-1)
            dh = (nxt - d["entropy"]).dropna()
            per_q = dh.groupby(d.loc[dh.index, "quadrant"], observed=True).mean()
            return per_q - per_q.mean()

        _, t_pd = timed(pandas_change)
        t_duck = times[heaviest]
        print(
            f"  DuckDB {t_duck:.2f} s; pandas {t_pd:.2f} s + {t_load:.2f} s to load the columns "
            f"(x{(t_pd + t_load) / t_duck:.1f})"
        )

        def all_analyses():
            c = connect(run_dir)
            for name, _ in list_analyses():
                run_analysis(c, name)

        _, t_all_before = best(all_analyses)
        (res,), t_compact = timed(lambda: compact(run_dir, grace_s=0))
        _, t_all_after = best(all_analyses)
        print(f"\n{res.summary()} in {t_compact:.1f} s")
        print(
            f"  all analyses (connect included): {t_all_before:.2f} s before, {t_all_after:.2f} s after "
            f"(x{t_all_before / t_all_after:.1f})"
        )

        small_files_ratio(root)
    print(f"report_s={t_report:.2f} rows={a.rows}")


def small_files_ratio(root: Path) -> None:
    """2M rows in 4,000 small files, connect + query, before and after compaction (best of 3)."""
    small = build_run(root / "small", 2_000_000, 500, 8)
    q = "SELECT quadrant, avg(ratio), count(*) FROM tokens GROUP BY quadrant"
    expect, t_small = best(lambda: connect(small).execute(q).fetchall())
    (res,), t_compact = timed(lambda: compact(small, grace_s=0))
    got, t_big = best(lambda: connect(small).execute(q).fetchall())
    assert sorted(got) == sorted(expect) or all(
        a[0] == b[0] and a[2] == b[2] and abs(a[1] - b[1]) < 1e-9 for a, b in zip(sorted(got), sorted(expect))
    )
    print(
        f"2M rows in 4,000 files of 500 rows: {t_small:.2f} s; after compaction ({res.files_out} files, "
        f"{t_compact:.1f} s to compact): {t_big:.2f} s (x{t_small / t_big:.1f}); connect + query, same answer"
    )


if __name__ == "__main__":
    main()
