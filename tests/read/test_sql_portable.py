"""Every analyses/*.sql stays in the portable subset (entropylens.read.portable) so Spark runs it too.

The lint is checked both ways: every shipped analysis passes, and the constructs that sqlglot
mistranslates or rejects (indexing, WITHIN GROUP, exact quantiles, sums over booleans, ...) are caught.
"""

import pytest

pytest.importorskip("sqlglot")  # the spark extra (the test extra has it)

from entropylens.read.portable import problems, to_spark  # noqa: E402
from entropylens.read.query import analysis_info, render_analysis  # noqa: E402


@pytest.mark.parametrize("name", sorted(analysis_info()))
def test_analysis_is_portable(name):
    assert problems(render_analysis(name)) == [], name


@pytest.mark.parametrize(
    "sql, why",
    [
        # silently mistranslated by sqlglot (DuckDB -> Spark)
        ("SELECT run, list(entropy ORDER BY step)[1] AS first_h FROM tokens GROUP BY run", "indexing"),
        ("SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ratio) FROM tokens", "WITHIN GROUP"),
        ("SELECT * FROM read_parquet('r/tokens/**/*.parquet', hive_partitioning = true)", "views only"),
        ("SELECT run FROM tokens ORDER BY hash(step, seq, pos)", "hashes differently"),
        # rejected by sqlglot or Spark
        ("SELECT quantile_cont(entropy_ratio, [0.05, 0.95]) FROM tokens", "exact quantile"),
        ("SELECT quantile_cont(entropy_ratio, [0.05, 0.95])[3] FROM tokens", "indexing"),  # past the list
        ("SELECT quantile_cont(entropy_ratio, [0.05, 0.95])[0] FROM tokens", "indexing"),  # 1-based
        ("SELECT quantile_cont(entropy_ratio, [0.05, step])[1] FROM tokens", "indexing"),  # q not a number
        ("SELECT quantile_disc(entropy_ratio, 0.05) FROM tokens", "exact quantile"),
        ("SELECT quantile(entropy_ratio, 0.05) FROM tokens", "exact quantile"),
        ("SELECT sum(clipped) FROM tokens", "over a boolean"),
        ("SELECT sum(ratio > 1.2) FROM tokens", "over a boolean"),
        ("SELECT histogram(quadrant) FROM tokens", "DuckDB-only"),
        (
            "WITH c AS (SELECT run, sum(n_za) AS za FROM steps GROUP BY run) "
            "UNPIVOT c ON za INTO NAME quadrant VALUE tokens",
            "UNPIVOT",
        ),
        # DuckDB's arg_max skips NULL arguments, Spark's max_by does not
        ("SELECT arg_max(reward_mean, step) FROM steps", "FILTER"),
        # only the engine's views
        ("SELECT count(*) FROM tokens_raw", "only the views"),
        ("SELECT list_sum([1, 2])", "untranslated"),
        ("SELECT 1 FROM tokens; SELECT 2 FROM steps", "one query"),
    ],
)
def test_lint_catches_non_portable_sql(sql, why):
    found = problems(sql)
    assert found and any(why in p for p in found), found


def test_guarded_arg_max_and_count_if_pass():
    sql = (
        "SELECT run, arg_max(reward_mean, step) FILTER (WHERE reward_mean IS NOT NULL) AS r, "
        "count_if(clipped) AS c, avg(CAST(clipped AS INTEGER)) AS f, median(ratio) AS m, "
        "approx_quantile(ratio, 0.05) AS q FROM tokens GROUP BY run"
    )
    assert problems(sql) == []
    spark = to_spark(sql)
    for fn in ("MAX_BY(", "COUNT_IF(", "MEDIAN(", "PERCENTILE_APPROX("):
        assert fn in spark, spark


def test_exact_quantile_becomes_spark_percentile():
    """quantile_cont(x, q) with a number q is portable: Spark's exact percentile(x, q) (sqlglot alone
    writes PERCENTILE_CONT(x, q), which Spark rejects); median stays MEDIAN (exact on both)."""
    sql = "SELECT quantile_cont(ratio, 0.05) AS a, median(ratio) AS b, quantile_cont(ratio, 0.95) AS c FROM tokens"
    assert problems(sql) == []
    spark = to_spark(sql)
    assert "PERCENTILE(ratio, 0.05)" in spark and "PERCENTILE(ratio, 0.95)" in spark and "MEDIAN(ratio)" in spark
    assert "PERCENTILE_CONT" not in spark and "APPROX" not in spark, spark


def test_to_spark_error_is_one_line():
    with pytest.raises(ValueError, match="cannot translate to Spark SQL"):
        to_spark("SELECT * FROM read_parquet('x', hive_partitioning = true)")


def test_list_quantile_element_becomes_spark_element_at():
    """quantile_cont(x, [q1, .., qk])[i] (DuckDB: one list quantile per group for the identical expressions)
    is portable: Spark's element_at(percentile(x, array(..)), i), both 1-based, exact on both."""
    sql = (
        "SELECT quantile_cont(ratio, [0.05, 0.5, 0.95])[1] AS a, quantile_cont(ratio, [0.05, 0.5, 0.95])[3] AS c "
        "FROM tokens"
    )
    assert problems(sql) == []
    spark = to_spark(sql)
    assert "ELEMENT_AT(PERCENTILE(ratio, ARRAY(0.05, 0.5, 0.95)), 1)" in spark, spark
    assert "ELEMENT_AT(PERCENTILE(ratio, ARRAY(0.05, 0.5, 0.95)), 3)" in spark, spark
    assert "PERCENTILE_CONT" not in spark and "APPROX" not in spark, spark


def test_list_quantile_elements_equal_the_single_quantiles():
    """DuckDB gives the list form's elements exactly the single quantile_cont / median values."""
    import duckdb

    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT i % 7 AS g, sin(i * 1.7) * i AS x FROM range(5000) r(i)")
    single = con.execute(
        "SELECT g, quantile_cont(x, 0.05), median(x), quantile_cont(x, 0.95) FROM t GROUP BY g ORDER BY g"
    ).fetchall()
    listed = con.execute(
        "SELECT g, quantile_cont(x, [0.05, 0.5, 0.95])[1], quantile_cont(x, [0.05, 0.5, 0.95])[2], "
        "quantile_cont(x, [0.05, 0.5, 0.95])[3] FROM t GROUP BY g ORDER BY g"
    ).fetchall()
    assert listed == single
