"""entropylens.open(path): the same answers as pandas or as polars DataFrames."""

import polars as pl
import pytest
from fixture_runs import build

import entropylens
from entropylens.read.query import QueryError


def test_sql_and_analyses_as_pandas_or_polars(tmp_path):
    runs = entropylens.open(build(tmp_path / "runs"))
    sql = "SELECT run, count(*) AS n, round(avg(entropy), 4) AS h FROM tokens GROUP BY run ORDER BY run"
    pd_df, pl_df = runs.sql(sql), runs.sql(sql, polars=True)
    assert isinstance(pl_df, pl.DataFrame)
    # fixture: run a has 3 updates x 4 tokens, b 1 x 4; a's mean entropy over its 12 rows
    assert (
        pl_df.to_dicts()
        == pd_df.to_dict("records")
        == [
            {"run": "a", "n": 12, "h": round((0.5 + 1.2 + 0.9 + 2.0) * 2 / 12 + (0.4 + 1.5 + 0.7 + 2.4) / 12, 4)},
            {"run": "b", "n": 4, "h": round((0.5 + 1.2 + 0.9 + 2.0) / 4, 4)},
        ]
    )
    a = runs.analysis("clip_by_quadrant")
    b = runs.analysis("clip_by_quadrant", polars=True)
    assert b.columns == list(a.columns) and b.height == len(a)
    assert b.filter((pl.col("run") == "a") & (pl.col("quadrant") == "PA&LP"))["clip_high_frac"].item() == 1.0
    with pytest.raises(QueryError, match="SQL error"):
        runs.sql("SELECT nosuch FROM tokens", polars=True)
    with pytest.raises(QueryError, match="no parameter"):
        runs.analysis("clip_by_quadrant", polars=True, bins=3)
