"""The steps file (writer.steps_table) holds exactly the rows given, by the schema's rules: every schema
column with its arrow type (step and rank aside), then the extra metrics as float64 in name order; a
missing key or None is null; a recorder aggregate's NaN ("not measured") is null, a caller's NaN stays
NaN; inf stays; integer columns round. Checked for rows with missing keys, None, NaN, inf, extra
metrics, Python ints in integer columns and integers beyond float64's exact ones."""

from __future__ import annotations

import math

import duckdb
import pyarrow as pa
import pytest

from entropylens.record.writing.parquet import steps_table, write_steps
from entropylens.schema import STEP_METRICS, STEPS, arrow_type

# the recorder's own aggregates: NaN there means "not measured" (null); the caller's scalars keep NaN
AGGREGATES = set(STEP_METRICS) | {c.name for c in STEPS if c.name.startswith("entropy_effect")}


def by_the_schema(rows: list[dict]) -> pa.Table:
    """The table the module docstring's rules give, one Python list per column."""
    known = {c.name: arrow_type(c.dtype) for c in STEPS if c.name not in ("step", "rank")}
    names = list(known) + sorted({k for r in rows for k in r} - set(known))
    cols = {}
    for name in names:
        vals = [r.get(name) for r in rows]
        vals = [None if (v is None or (name in AGGREGATES and isinstance(v, float) and v != v)) else v for v in vals]
        typ = known.get(name, pa.float64())
        if pa.types.is_integer(typ):
            vals = [None if v is None else int(round(v)) for v in vals]
        cols[name] = pa.array(vals, typ)
    return pa.table(cols)


def assert_same(got: pa.Table, want: pa.Table) -> None:
    assert got.schema == want.schema  # names, order, types (and no metadata on either)
    assert got.num_rows == want.num_rows
    for name in want.column_names:
        g, w = got.column(name), want.column(name)
        assert g.null_count == w.null_count, name
        assert g.is_null().to_pylist() == w.is_null().to_pylist(), name
        gv, wv = g.to_pylist(), w.to_pylist()
        for a, b in zip(gv, wv):  # bitwise; inf compares equal; a caller's NaN stays NaN
            assert (a is None and b is None) or (a == b and type(a) is type(b)) or (a != a and b != b), (name, a, b)


ROWS = [
    # an aggregates-like row: floats (counts as floats, as packed_block.unpack gives them), NaN = not measured
    {
        "update": 0,
        "n_tokens": 4096.0,
        "n_pa_hp": 1000.0,
        "n_pa_lp": 24.0,
        "n_na_hp": 2000.0,
        "n_na_lp": 72.0,
        "n_za": 1000.0,
        "entropy_mean": 3.4114692211151123,
        "old_entropy_mean": 0.1 + 0.2,
        "ratio_mean": 1.0000001,
        "lgn_mean_pa_hp": float("nan"),
        "kl_k3": 1e-9,
        "loss": -0.0,
        "entropy_effect": float("inf"),
        "entropy_effect_dropped": float("-inf"),
        "n_nonfinite_ratio": 0.0,
        "reward_mean": 0.4375,
        "accuracy": 0.25,
        "policy/entropy": 1.5,
    },
    # keys missing, explicit None, an extra metric only this row has, an int count, halves that round to even
    {
        "update": 1,
        "n_tokens": 2.5,
        "n_pa_hp": 3.5,
        "n_za": None,
        "grad_norm": 1e40,
        "lr": 3e-45,
        "entropy_mean": None,
        "my_metric": 2.0,
        "n_na_lp": 7,
    },
    # a row with almost nothing
    {"update": 2},
    # big integers: beyond float64's exact ones (value-by-value for that column) and an exact one
    {"update": 3, "n_tokens": 2**60 + 1, "n_pa_hp": 2**53 - 1, "accuracy": -1.25e-300},
]


def test_steps_table_equals_the_value_by_value_construction():
    assert_same(steps_table(ROWS), by_the_schema(ROWS))
    # the same with each row alone (single-row files) and in reverse order
    for r in ROWS:
        assert_same(steps_table([r]), by_the_schema([r]))
    assert_same(steps_table(ROWS[::-1]), by_the_schema(ROWS[::-1]))


def test_values_only_the_slow_path_takes():
    import numpy as np

    rows = [
        {"update": 0, "n_tokens": np.float64(12.0), "entropy_mean": np.float32(0.5), "accuracy": True},
        {"update": np.int16(1), "n_tokens": 3, "extra": np.float64("nan")},
    ]
    assert_same(steps_table(rows), by_the_schema(rows))
    assert steps_table(rows).column("extra").null_count == 1  # a caller's NaN (np.float64 is a float) stays NaN


@pytest.mark.parametrize("bad", [{"update": 40000}, {"n_tokens": float("inf")}, {"entropy_mean": "x"}])
def test_bad_values_fail_as_before(bad):
    with pytest.raises(Exception) as want:
        by_the_schema([{"update": 0}, bad])
    with pytest.raises(type(want.value)):
        steps_table([{"update": 0}, bad])


def test_steps_file_reads_back_in_duckdb(tmp_path):
    write_steps(tmp_path, 7, 0, ROWS[:3])
    con = duckdb.connect()
    got = con.execute(
        "SELECT step, update, n_tokens, n_pa_hp, n_za, entropy_mean, lgn_mean_pa_hp, entropy_effect, my_metric "
        "FROM read_parquet(?, hive_partitioning = true) ORDER BY update",
        [str(tmp_path / "steps" / "*" / "*" / "*.parquet")],
    ).fetchall()
    # n_tokens 2.5 and n_pa_hp 3.5 round half to even: 2 and 4
    assert got[0][:5] == (7, 0, 4096, 1000, 1000) and math.isclose(got[0][5], 3.4114692211151123, rel_tol=1e-7)
    assert got[0][6] is None and got[0][7] == math.inf and got[0][8] is None
    assert got[1][:5] == (7, 1, 2, 4, None) and got[1][5] is None and got[1][8] == 2.0
    assert got[2][2:9] == (None,) * 7


def test_small_files_skip_compression_and_statistics_tokens_files_keep_them(tmp_path):
    import numpy as np
    import pyarrow.parquet as pq

    from entropylens.record.writing.parquet import SMALL_BYTES, write_sequences, write_tokens

    def meta(path):
        col = pq.ParquetFile(path).metadata.row_group(0).column(0)
        return col.compression, col.is_stats_set

    n = 64
    seqs = {
        "seq": np.arange(n, dtype=np.int32),
        "group": np.arange(n, dtype=np.int32) // 8,
        "reward": np.ones(n, np.float32),
        "advantage": np.zeros(n, np.float32),
        "length": np.full(n, 16, np.int32),
    }
    assert meta(write_steps(tmp_path, 0, 0, ROWS[:3])) == ("UNCOMPRESSED", False)
    assert meta(write_sequences(tmp_path, 0, 0, 0, seqs)) == ("UNCOMPRESSED", False)
    big = {**seqs, "text": ["x" * (SMALL_BYTES // n + 1)] * n}  # texts past the small-file size: zstd again
    assert meta(write_sequences(tmp_path, 0, 0, 1, big)) == ("ZSTD", True)
    rows = {
        "update": np.zeros(n, np.int16),
        "seq": np.arange(n, dtype=np.int32),
        "group": np.zeros(n, np.int32),
        "pos": np.zeros(n, np.int32),
        "logprob": np.zeros(n, np.float32),
        "quadrant": np.zeros(n, np.int8),
        "clip": np.zeros(n, np.int8),
        "clipped": np.zeros(n, bool),
    }
    tok = write_tokens(tmp_path, 0, 0, 0, rows)
    assert meta(tok) == ("ZSTD", True)  # DuckDB's filter pushdown reads the tokens files' min/max
    # the small files read back whole: values, types and nulls
    back = pq.read_table(tmp_path / "sequences" / "step=0" / "rank=0" / "part-0.parquet")
    assert back.column("seq").to_pylist() == list(range(n)) and back.column("text").null_count == n
    assert_same(
        pq.read_table(tmp_path / "steps" / "step=0" / "rank=0" / "steps.parquet").replace_schema_metadata(),
        by_the_schema(ROWS[:3]),
    )
