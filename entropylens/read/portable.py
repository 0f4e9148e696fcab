"""The portable SQL subset the analyses are written in, and their DuckDB -> Spark translation.

DuckDB stays the canonical engine; ``analyses/*.sql`` must also run on Spark after sqlglot translates
them (``entropylens.read.spark``). sqlglot translates some DuckDB constructs *silently wrong* and fails on
others, so every analysis keeps to a subset that :func:`problems` checks (tests/read/test_sql_portable.py
runs it on every file):

- tables: only the views the engines build (``tokens``, ``steps``, ``sequences``, ``runs``,
  ``probes``) and the file's own CTEs; no ``read_parquet`` or other table functions;
- exact quantiles only as ``median(x)`` or ``quantile_cont(x, q)`` with a number ``q`` (exact on
  both: :func:`to_spark` writes Spark's ``percentile(x, q)``, the same linear interpolation at rank
  q * (n - 1)); several quantiles of the same x as ``quantile_cont(x, [q1, ..., qk])[i]`` with numbers q
  and a number i in 1..k (DuckDB computes the list once per group, a third of the CPU of three
  separate quantiles; :func:`to_spark` writes ``element_at(percentile(x, array(q1, ..., qk)), i)``, both
  1-based); not ``quantile`` / ``quantile_disc`` / ``percentile_cont ... WITHIN GROUP`` / a list of q
  used otherwise: sqlglot turns them into approximate ones or Spark rejects them. ``approx_quantile``
  is approximate on both (DuckDB t-digest, Spark percentile_approx);
- no ``list`` / ``array_agg`` and no other ``[i]`` indexing (ordered-list indexing is mistranslated), no
  ``histogram``, no ``PIVOT`` / ``UNPIVOT``, no lambdas or ``unnest``;
- no ``sum`` / ``avg`` over a boolean (Spark rejects it): ``count_if(cond)`` or
  ``avg(CAST(cond AS INTEGER))``;
- no engine-specific values: ``hash`` (each engine hashes differently), ``random``, ``any_value`` /
  ``first`` / ``last`` (order-dependent);
- ``arg_max`` / ``arg_min`` (Spark ``max_by`` / ``min_by``) only with ``FILTER (WHERE <arg> IS NOT
  NULL)``: DuckDB skips rows whose argument is NULL, Spark does not;
- no function sqlglot does not know (it would pass through untranslated) unless listed in
  :data:`KNOWN_BOTH` (checked to exist with the same meaning on both engines);
- and the file must transpile with ``unsupported_level=RAISE``.
"""

from __future__ import annotations

VIEWS = ("tokens", "steps", "sequences", "runs", "probes")

# sqlglot expression class -> why it is not portable
DENIED = {
    "PercentileCont": "exact quantile: use median(x), quantile_cont(x, <number>) or quantile_cont(x, [<numbers>])[<i>]",
    "PercentileDisc": "exact quantile: use median(x) or quantile_cont(x, <number>)",
    "Quantile": "exact quantile: use median(x) or quantile_cont(x, <number>)",
    "WithinGroup": "WITHIN GROUP is translated to an approximate quantile: use median / approx_quantile",
    "Pivot": "PIVOT / UNPIVOT syntax differs: CROSS JOIN a list of names with CASE",
    "Bracket": "[i] indexing (ordered list indexing is mistranslated)",
    "ArrayAgg": "list / array_agg: order and indexing differ between engines",
    "GroupConcat": "string_agg: order differs between engines",
    "Lambda": "lambdas are DuckDB-specific",
    "Unnest": "unnest is DuckDB-specific",
    "Explode": "explode is engine-specific",
    "ReadParquet": "read files through the views only",
    "ReadCSV": "read files through the views only",
    "Rand": "random values differ between engines",
    "AnyValue": "order-dependent: not the same row on both engines",
    "First": "order-dependent: not the same row on both engines",
    "Last": "order-dependent: not the same row on both engines",
    "MD5Digest": "engine-specific hash",
}
# functions sqlglot does not model (exp.Anonymous) and why they are not portable
DENIED_NAMES = {
    "hash": "each engine hashes differently (a different sample): write the hash in integer arithmetic",
    "histogram": "DuckDB-only: GROUP BY a bin expression instead",
}
# functions sqlglot does not model (exp.Anonymous) that are known to mean the same on both engines
KNOWN_BOTH: set[str] = set()


def _bool_columns() -> set[str]:
    from ..schema import TABLES

    return {c.name for cols in TABLES.values() for c in cols if c.dtype == "bool"}


def _number(node) -> bool:
    from sqlglot import exp

    return isinstance(node, exp.Literal) and not node.is_string


def _exact_quantile(node) -> bool:
    """``quantile_cont(x, q)`` with a number q (not the WITHIN GROUP form), or the list form
    ``quantile_cont(x, [q1, ..., qk])`` as the operand of an element access :func:`_quantile_element`:
    the exact quantiles :func:`to_spark` writes with Spark's ``percentile``."""
    from sqlglot import exp

    if not isinstance(node, exp.PercentileCont) or isinstance(node.parent, exp.WithinGroup):
        return False
    if isinstance(node.expression, exp.Array):
        return isinstance(node.parent, exp.Bracket) and _quantile_element(node.parent)
    return _number(node.expression)


def _quantile_element(node) -> bool:
    """``quantile_cont(x, [q1, ..., qk])[i]``: numbers q, one number i, an integer in 1..k."""
    from sqlglot import exp

    if not isinstance(node, exp.Bracket) or len(node.expressions) != 1 or not _number(node.expressions[0]):
        return False
    q = node.this
    if not isinstance(q, exp.PercentileCont) or not isinstance(q.expression, exp.Array):
        return False
    qs = q.expression.expressions
    if not qs or not all(_number(v) for v in qs):
        return False
    i = node.expressions[0].this
    return i.isdigit() and 1 <= int(i) <= len(qs)


def _spark_percentile(node):
    """sqlglot transform: DuckDB ``quantile_cont(x, q)`` -> Spark ``percentile(x, q)`` (both exact,
    linear interpolation between the order statistics around rank q * (n - 1)); sqlglot itself
    writes PERCENTILE_CONT(x, q), which Spark rejects. ``quantile_cont(x, [q1, ..., qk])[i]`` ->
    ``element_at(percentile(x, array(q1, ..., qk)), i)`` (DuckDB lists and element_at both count from 1)."""
    from sqlglot import exp

    if _quantile_element(node):
        q = node.this
        qs = exp.Array(expressions=[v.copy() for v in q.expression.expressions])
        pct = exp.Anonymous(this="percentile", expressions=[q.this.copy(), qs])
        return exp.Anonymous(this="element_at", expressions=[pct, node.expressions[0].copy()])
    if _exact_quantile(node) and not isinstance(node.expression, exp.Array):
        return exp.Anonymous(this="percentile", expressions=[node.this.copy(), node.expression.copy()])
    return node


def _is_boolean(e) -> bool:
    from sqlglot import exp

    e = e.unnest()
    if isinstance(e, (exp.Predicate, exp.Connector, exp.Not, exp.Boolean)):
        return True
    return isinstance(e, exp.Column) and e.name in _bool_columns()


def problems(sql: str) -> list[str]:
    """Why ``sql`` (one DuckDB statement, parameters filled in) is outside the portable subset."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        trees = [t for t in sqlglot.parse(sql, read="duckdb") if t is not None]
    except SqlglotError as e:
        return [f"does not parse: {str(e).splitlines()[0]}"]
    if len(trees) != 1:
        return [f"{len(trees)} statements; an analysis is one query"]
    tree = trees[0]
    out: list[str] = []
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    for node in tree.walk():
        kind = type(node).__name__
        if kind in DENIED and not _exact_quantile(node) and not _quantile_element(node):
            out.append(f"{node.sql(dialect='duckdb')[:60]}: {DENIED[kind]}")
        elif isinstance(node, exp.Anonymous) and node.name.lower() in DENIED_NAMES:
            out.append(f"{node.name}(): {DENIED_NAMES[node.name.lower()]}")
        elif isinstance(node, exp.Anonymous) and node.name.lower() not in KNOWN_BOTH:
            out.append(f"{node.name}(): not a function sqlglot translates (would reach Spark untranslated)")
        elif isinstance(node, exp.Table):
            name = node.name.lower()
            if not name or not isinstance(node.this, exp.Identifier):
                out.append(f"{node.sql(dialect='duckdb')[:60]}: read data through the views only")
            elif name not in VIEWS and name not in ctes:
                out.append(f"table {node.name}: only the views {', '.join(VIEWS)} and the query's CTEs")
        elif isinstance(node, (exp.Sum, exp.Avg)) and _is_boolean(node.this):
            out.append(
                f"{node.sql(dialect='duckdb')[:60]}: {kind.lower()} over a boolean: count_if(cond) "
                "or avg(CAST(cond AS INTEGER))"
            )
        elif isinstance(node, (exp.ArgMax, exp.ArgMin)):
            arg = node.this.sql(dialect="duckdb")
            filt = node.parent if isinstance(node.parent, exp.Filter) else None
            guarded = filt is not None and any(
                isinstance(i.parent, exp.Not)
                and isinstance(i.expression, exp.Null)
                and i.this.sql(dialect="duckdb") == arg
                for i in filt.expression.find_all(exp.Is)
            )
            if not guarded:
                out.append(
                    f"{node.sql(dialect='duckdb')[:60]}: needs FILTER (WHERE {arg} IS NOT NULL) "
                    "(DuckDB skips NULL arguments, Spark max_by does not)"
                )
    try:
        to_spark(sql)
    except ValueError as e:
        out.append(f"does not transpile to Spark: {str(e).removeprefix('cannot translate to Spark SQL: ')}")
    return out


def to_spark(sql: str) -> str:
    """DuckDB SQL (in the portable subset) -> Spark SQL; a one-line ValueError if it cannot."""
    import sqlglot
    from sqlglot.errors import ErrorLevel, SqlglotError

    try:
        (tree,) = sqlglot.parse(sql, read="duckdb")
        if tree is None:  # only comments or semicolons
            raise ValueError("the statement is empty")
        out = tree.transform(_spark_percentile).sql(dialect="spark", unsupported_level=ErrorLevel.RAISE)
    except (SqlglotError, ValueError) as e:
        raise ValueError(f"cannot translate to Spark SQL: {str(e).splitlines()[0]}") from None
    return out


__all__ = ["VIEWS", "problems", "to_spark"]
