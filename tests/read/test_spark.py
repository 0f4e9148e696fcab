"""DuckDB / Spark parity: every analysis gives the same rows on both engines (pyspark local[1]).

Fixture: the hand-built runs a and b of tests/fixture_runs.py plus random runs (c: 2 ranks,
3 steps, 2 updates of the same tokens; d: in a sub-directory, files written without the
erc_kept / logit_grad_norm columns (an older schema: union by name), a steps file with an extra
metric column; e: steps 0-2 compacted (entropylens.read.compact), step 3 in the original files, step 4
uncommitted (token files, no steps file: hidden), one truncated file (skipped)). Zero-advantage
tokens everywhere. One SparkSession for the module (start-up is the cost).

Tolerances: floats within 1e-6 relative (+1e-9 absolute, for differences of means that are ~0);
approximate quantiles (none today: entropy_ratio_by_step's p05/p95 are exact, quantile_cont on
DuckDB and percentile on Spark) must lie, on both engines, between the exact order statistics at
ranks (q -/+ 0.02) * (n - 1), i.e. within 2% of rank of the exact quantile.
"""

import json
import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from fixture_runs import build as build_hand_runs
from typer.testing import CliRunner

from entropylens.read import query
from entropylens.record.writing.parquet import write_probes, write_sequences, write_steps, write_tokens
from entropylens.schema import STEPS, stored_columns

pytestmark = pytest.mark.slow

APPROX: dict[str, tuple[str, ...]] = {}  # analysis -> approximate quantile columns (see above)
QUANTILE = {"p05": 0.05, "p95": 0.95}
RANK_TOL = 0.02
EXTRA_PARAMS = [
    ("ratio_vs_prob", {"points": 25}),
    ("clipped_prob_distribution", {"bins": 4}),
    ("drift_by_prob_bin", {"bins": 7}),
    ("entropy_ratio_by_step", {"band_low": 0.9, "band_high": 1.1}),
]


def _random_run(d, *, method, ranks, steps, updates, seed, drop=(), extra_metric=False, first_step=0, uncommitted=()):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": d.name,
                "method": method,
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.28,
                "tau": 0.5,
                "world_size": ranks,
                "seed": seed,
                "schema_version": 1,
                "config": {"method": method, "lr": 1e-6},
            }
        )
    )
    seq0 = 1000 * first_step
    for step in range(first_step, first_step + steps):
        for rank in range(ranks):
            n_seq = 6
            lengths = rng.integers(4, 12, n_seq)
            seq = np.repeat(np.arange(seq0, seq0 + n_seq, dtype=np.int32), lengths)
            seq0 += n_seq
            pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
            n = len(seq)
            adv_seq = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], n_seq).astype(np.float32)
            adv = np.repeat(adv_seq, lengths)
            old_lp = np.log(rng.uniform(0.02, 0.999, n)).astype(np.float32)
            old_h = rng.uniform(0.2, 3.0, n).astype(np.float32)
            rows = []
            for u in range(updates):
                lp = (old_lp + rng.normal(0, 0.25, n)).astype(np.float32)
                r = np.exp(lp.astype(np.float64) - old_lp)
                clip = np.where(r < 0.8, -1, np.where(r > 1.28, 1, 0)).astype(np.int8)
                p = np.exp(old_lp.astype(np.float64))
                quad = np.where(adv == 0, 0, np.where(adv > 0, np.where(p >= 0.5, 1, 2), np.where(p >= 0.5, 3, 4)))
                h = (old_h * rng.uniform(0.7, 1.4, n)).astype(np.float32)
                arrs = {
                    "update": np.full(n, u, np.int16),
                    "seq": seq,
                    "group": seq // 3,
                    "pos": pos,
                    "token_id": rng.integers(0, 50000, n).astype(np.int32),
                    "logprob": lp,
                    "old_logprob": old_lp,
                    "advantage": adv,
                    "quadrant": quad.astype(np.int8),
                    "clip": clip,
                    "clipped": ((clip == -1) & (adv < 0)) | ((clip == 1) & (adv > 0)),
                    "entropy": h,
                    "old_entropy": old_h,
                    "erc_kept": rng.random(n) < 0.9,
                    "grad_coef": rng.normal(0, 0.01, n).astype(np.float32),
                    "logit_grad_norm": rng.uniform(0, 0.05, n).astype(np.float32),
                }
                for c in stored_columns("tokens"):  # every other column of the contract gets values too
                    if c.name not in arrs and c.name not in ("step", "rank") and c.dtype not in ("string", "dict8"):
                        arrs[c.name] = (
                            rng.random(n) < 0.3
                            if c.dtype == "bool"
                            else rng.normal(0, 0.01, n).astype(np.float32)
                            if c.dtype.startswith("float")
                            else rng.integers(0, 5, n).astype(c.dtype)
                        )
                f = write_tokens(d, step, rank, u, arrs)
                if drop:
                    t = pq.read_table(f)
                    pq.write_table(t.drop_columns(list(drop)), f)
                write_probes(
                    d,
                    step,
                    rank,
                    u,
                    [
                        {
                            "update": u,
                            "part": part,
                            "tokens": int(rng.integers(0, 50)),
                            "grad_norm": float(rng.random()),
                            "predicted_dh": float(rng.normal()),
                            "measured_dh": float(rng.normal()) if part == "step" else None,
                            "entropy_before": float(rng.random()),
                            "optimizer": "AdamW",
                            "lr": 1e-6,
                        }
                        for part in ("PA&HP", "NA&LP", "momentum", "step")
                    ],
                )
                rows.append(
                    {
                        **{c.name: float(rng.random()) for c in STEPS if c.dtype.startswith("float")},
                        "update": u,
                        "n_tokens": n,
                        "loss": float(rng.normal()),
                        "grad_norm": float(rng.uniform(0.1, 2)),
                        "entropy_mean": float(h.mean()),
                        "old_entropy_mean": float(old_h.mean()),
                        "clip_low_frac": float(((clip == -1) & (adv < 0)).mean()),
                        "clip_high_frac": float(((clip == 1) & (adv > 0)).mean()),
                        **{
                            f"n_{k}": int((quad == c).sum())
                            for k, c in (("pa_hp", 1), ("pa_lp", 2), ("na_hp", 3), ("na_lp", 4), ("za", 0))
                        },
                        "erc_drop_frac": float(rng.uniform(0, 0.1)),
                        "kl_k3": float(rng.uniform(0, 0.01)),
                        "reward_mean": float(rng.uniform()),
                        **({"my_metric": float(rng.normal())} if extra_metric else {}),
                    }
                )
            if step not in uncommitted:
                write_steps(d, step, rank, rows)
            write_sequences(
                d,
                step,
                rank,
                0,
                {
                    "seq": np.arange(seq0 - n_seq, seq0, dtype=np.int32),
                    "group": np.arange(n_seq, dtype=np.int32) // 3,
                    "reward": rng.uniform(0, 1, n_seq).astype(np.float32),
                    "advantage": adv_seq,
                    "length": lengths.astype(np.int32),
                },
            )


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = build_hand_runs(tmp_path_factory.mktemp("parity"))
    _random_run(r / "c", method="dapo", ranks=2, steps=3, updates=2, seed=1)
    _random_run(
        r / "older" / "d",
        method="ce_gppo",
        ranks=1,
        steps=2,
        updates=2,
        seed=2,
        drop=("erc_kept", "logit_grad_norm"),
        extra_metric=True,
    )
    from entropylens.read.compact import compact

    _random_run(r / "e", method="grpo", ranks=2, steps=3, updates=2, seed=3)
    assert compact(r, runs=["e"], grace_s=0)[0].steps == (0, 2)
    _random_run(r / "e", method="grpo", ranks=2, steps=2, updates=1, seed=4, first_step=3, uncommitted=(4,))
    (r / "e" / "tokens" / "step=3" / "rank=1" / "update-0.parquet").write_bytes(b"PAR1 cut sho")
    return r


@pytest.fixture(scope="module")
def spark():
    from entropylens.read.spark import session

    s = session("local[1]", conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cons(root, spark):
    from entropylens.read import spark as es

    return query.connect(root), es.connect(root, spark=spark)


def _exact_rank_band(duck, run, step, q, n_tol=RANK_TOL):
    x = np.sort(
        duck.execute(
            f"SELECT entropy_ratio FROM tokens WHERE run = '{run}' AND step = {step} AND entropy_ratio IS NOT NULL"
        )
        .df()["entropy_ratio"]
        .to_numpy(np.float64)
    )
    lo = max(0, math.floor((q - n_tol) * (len(x) - 1)))
    hi = min(len(x) - 1, math.ceil((q + n_tol) * (len(x) - 1)))
    return x[lo], x[hi]


def _canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by every column (floats to 5 significant digits): for results whose ORDER BY
    leaves ties (e.g. the same key from two ranks), where each engine may return tied rows in any order."""
    keys = pd.DataFrame(
        {
            c: (
                df[c].map(lambda v: None if pd.isna(v) else float(f"{float(v):.5g}"))
                if df[c].dtype.kind in "iufb"
                else df[c].astype(str)
            )
            for c in df.columns
        }
    )
    return df.iloc[keys.sort_values(list(keys.columns), kind="mergesort", na_position="last").index]


def assert_same_rows(a: pd.DataFrame, b: pd.DataFrame, skip=()):
    assert list(a.columns) == list(b.columns)
    assert len(a) == len(b), (len(a), len(b))
    for c in a.columns:
        if c in skip:
            continue
        x, y = a[c].to_numpy(object), b[c].to_numpy(object)
        nx, ny = pd.isna(a[c]).to_numpy(), pd.isna(b[c]).to_numpy()
        assert (nx == ny).all(), (c, x[nx != ny], y[nx != ny])
        x, y = x[~nx], y[~ny]
        try:
            fx, fy = x.astype(np.float64), y.astype(np.float64)
        except (TypeError, ValueError):
            assert list(x) == list(y), c
            continue
        np.testing.assert_allclose(fy, fx, rtol=1e-6, atol=1e-9, err_msg=c)


CASES = [(n, {}) for n in sorted(query.analysis_info())] + EXTRA_PARAMS


@pytest.mark.parametrize(
    "name, params", CASES, ids=[f"{n}-{'-'.join(map(str, p.values())) or 'default'}" for n, p in CASES]
)
def test_same_rows_on_duckdb_and_spark(cons, name, params):
    duck, sc = cons
    a = query.run_analysis(duck, name, **params)
    b = query.run_analysis(sc, name, **params)
    assert len(a) > 0, f"{name}: the fixture gives no rows; the comparison would prove nothing"
    approx = APPROX.get(name, ())
    try:
        assert_same_rows(a, b, skip=approx)
    except AssertionError:  # rows tied on the ORDER BY (e.g. the same key from two ranks) in another order
        assert_same_rows(_canonical(a), _canonical(b), skip=approx)
    for col in approx:
        for df in (a, b):
            for row in df.to_dict("records"):
                lo, hi = _exact_rank_band(duck, row["run"], row["step"], QUANTILE[col])
                assert lo - 1e-6 <= row[col] <= hi + 1e-6, (name, col, row, lo, hi)


def test_views_are_equal(cons, root):
    """Every view has the same rows and columns on both engines (derived columns, run, union by name)."""
    duck, sc = cons
    for table, key in (
        ("tokens", "run, step, update, rank, seq, pos"),
        ("steps", "run, step, rank, update"),
        ("sequences", "run, step, rank, seq"),
        ("probes", "run, step, rank, update, part"),
        ("runs", "run"),
    ):
        a = duck.execute(f"SELECT * FROM {table} ORDER BY {key}").df()
        b = sc.execute(f"SELECT * FROM {table} ORDER BY {key}").df()
        assert sorted(a.columns) == sorted(b.columns), table
        assert_same_rows(a, b[list(a.columns)])
    # the fixture does exercise union by name: run d's files lack erc_kept, only d has my_metric
    t = sc.execute(
        "SELECT run = 'd' AS d, count(*) AS n, count(erc_kept) AS kept FROM tokens GROUP BY 1 ORDER BY 1"
    ).df()
    assert t["n"].tolist()[1] > 0 and t["kept"].tolist()[1] == 0 and t["kept"].tolist()[0] > 0
    m = sc.execute("SELECT run = 'd' AS d, count(my_metric) AS m FROM steps GROUP BY 1 ORDER BY 1").df()
    assert m["m"].tolist()[0] == 0 and m["m"].tolist()[1] > 0
    # and the catalog's rules: run e reads compacted steps 0-2, step 3 (rank 1's file is truncated:
    # skipped), never the uncommitted step 4
    e = sc.execute("SELECT step, rank, count(*) AS n FROM tokens WHERE run = 'e' GROUP BY 1, 2 ORDER BY 1, 2").df()
    assert list(zip(e["step"], e["rank"])) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    assert (root / "e" / "compacted").is_dir() and not (root / "e" / "tokens" / "step=0").exists()


def test_one_contract_for_both_engines(root, spark):
    """``entropylens.connect(path, engine=...)`` and ``entropylens.run_analysis(con, name, **params)``: the
    same calls on either engine give equal pandas frames, and the same errors (#40)."""
    import entropylens
    from entropylens.read.query import QueryError

    duck = entropylens.connect(root, engine="duckdb", runs=["a", "c"])
    sc = entropylens.connect(root, engine="spark", runs=["a", "c"])  # the active session (the fixture's)
    assert sc.spark.sparkContext is spark.sparkContext
    for name, params in (("entropy_by_step", {}), ("clip_by_quadrant", {}), ("drift_by_prob_bin", {"bins": 7})):
        a = entropylens.run_analysis(duck, name, **params)
        b = entropylens.run_analysis(sc, name, **params)
        assert type(a) is type(b) is pd.DataFrame
        assert set(a["run"]) == {"a", "c"}
        try:
            assert_same_rows(a, b)
        except AssertionError:  # rows tied on the ORDER BY, in another order
            assert_same_rows(_canonical(a), _canonical(b))
    for con in (duck, sc):
        with pytest.raises(QueryError, match="unknown analysis 'nope'"):
            entropylens.run_analysis(con, "nope")
        with pytest.raises(QueryError, match="has no parameter width"):
            entropylens.run_analysis(con, "entropy_by_step", width=3)
    with pytest.raises(QueryError, match="timeout applies to DuckDB connections"):
        entropylens.run_analysis(sc, "entropy_by_step", timeout=5)
    with pytest.raises(QueryError, match="tau: DuckDB's only"):
        entropylens.connect(root, engine="spark", tau=0.3)
    with pytest.raises(QueryError, match="unknown engine 'polars'"):
        entropylens.connect(root, engine="polars")


def test_a_path_in_place_of_the_connection_is_deprecated(root, spark):
    """spark.run_analysis(PATH, ...), the old form, runs for one more release with a DeprecationWarning."""
    from entropylens.read import spark as es

    with pytest.warns(DeprecationWarning, match=r"run_analysis\(connect\(PATH, engine='spark'\), name\)"):
        df = es.run_analysis(root, "entropy_by_step", runs=["c"], spark=spark)
    assert set(df["run"]) == {"c"} and len(df) == 3
    assert_same_rows(df, es.run_analysis(es.connect(root, runs=["c"], spark=spark), "entropy_by_step"))


def test_python_api_and_cli(root, spark, tmp_path):
    from entropylens.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["analyze", str(root), "kl_by_step", "--engine", "spark", "--format", "json"])
    assert res.exit_code == 0, res.output
    got = pd.DataFrame(json.loads(res.stdout))
    want = query.run_analysis(query.connect(root), "kl_by_step")
    assert_same_rows(want, got[list(want.columns)])
    res = runner.invoke(app, ["analyze", str(root), "nope", "--engine", "spark"])
    assert res.exit_code == 2 and "unknown analysis 'nope'" in res.output
    res = runner.invoke(app, ["report", str(root), "--engine", "spark", "--run", "c", "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| c | dapo |" in md and (tmp_path / "rep" / "entropy.png").stat().st_size > 1000


def test_spark_connection_is_read_only(root, spark):
    """The Spark connection's execute (DuckDB SQL, as on a DuckDB connection) runs the same statement check."""
    from entropylens.read import spark as es
    from entropylens.read.query import QueryError

    con = es.connect(root, spark=spark)
    for sql in ("DROP VIEW tokens", "CREATE TABLE t AS SELECT 1", "SELECT 1; SELECT 2"):
        with pytest.raises(QueryError, match="read-only|statements"):
            con.execute(sql)
    assert con.execute("SELECT count(*) AS n FROM tokens").df()["n"].tolist()[0] > 0
