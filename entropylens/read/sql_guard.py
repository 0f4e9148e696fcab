"""`entropylens query` is read-only: one statement that reads, nothing that writes or changes the session.

DuckDB's own parser splits and classifies the SQL (``duckdb.extract_statements``); allowed are exactly
one SELECT-class statement (SELECT, WITH ..., VALUES, FROM ..., DESCRIBE, SHOW, SUMMARIZE, PIVOT /
UNPIVOT), EXPLAIN [ANALYZE] [(options)] of a statement that passes this same rule (EXPLAIN ANALYZE
runs what it wraps: ``EXPLAIN ANALYZE COPY ... TO`` writes files), or a PRAGMA from READ_PRAGMAS.
A SELECT-class statement whose parse tree holds a writing query node (DuckDB 2.0: ``WITH a AS (COPY ... TO
...) SELECT 1``, INSERT / UPDATE / DELETE as a CTE body) is refused too.
Everything else (COPY, CREATE, INSERT, UPDATE, DELETE, DROP, ALTER, ATTACH, DETACH, INSTALL, LOAD,
SET, CALL, EXPORT, IMPORT, several statements) is refused before it runs, with a one-line reason.

This check is the first of two layers: the connection itself is locked down after its views are
built (entropylens.read.query.lock_down: no file access beyond the runs' own files, no network, no
extension install or load, configuration locked), so a statement this parser check lets through
still cannot write elsewhere or reach the network.
"""

from __future__ import annotations

import re

# PRAGMAs that only report (the others set options or write, e.g. a profiling output file)
READ_PRAGMAS = ("table_info", "show_tables", "show_tables_expanded", "show", "database_size", "version",
                "platform", "storage_info", "functions", "metadata_info", "database_list", "collations")
READ_ONLY = "SELECT / WITH / VALUES / FROM / DESCRIBE / SHOW / SUMMARIZE / PIVOT / EXPLAIN / read-only PRAGMA"


class NotReadOnly(ValueError):
    """The SQL is not a single read-only statement."""


def _strip_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*|/\*.*?\*/", " ", sql, flags=re.S).strip()


# EXPLAIN, then ANALYZE and/or a parenthesized option list: EXPLAIN ANALYZE, EXPLAIN (FORMAT json),
# EXPLAIN (ANALYZE, FORMAT json), EXPLAIN ANALYZE (FORMAT json); comments may sit between the words
_GAP = r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*"
_EXPLAIN_HEAD = re.compile(
    rf"{_GAP}explain\b{_GAP}(?:analy[sz]e\b{_GAP})?(?:\((?:[^()'\"]|'[^']*'|\"[^\"]*\")*\){_GAP})?", re.I | re.S)


def _explained(query: str) -> str | None:
    """The statement an EXPLAIN statement wraps (the text after EXPLAIN [ANALYZE] [(options)]), or
    None if that prefix cannot be found."""
    m = _EXPLAIN_HEAD.match(query)
    return query[m.end():] if m else None


# the query nodes that only read; DuckDB 2.0 also takes COPY TO / INSERT / UPDATE / DELETE as a CTE body
# (COPY_QUERY_NODE, ...) inside a statement it classifies as SELECT
_READING_NODES = {"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"}
_NODE_WORD = {"COPY_QUERY_NODE": "COPY", "INSERT_QUERY_NODE": "INSERT", "UPDATE_QUERY_NODE": "UPDATE",
              "DELETE_QUERY_NODE": "DELETE"}


def _node_types(tree, acc: set) -> set:
    if isinstance(tree, dict):
        if isinstance(tree.get("type"), str) and tree["type"].endswith("_NODE"):
            acc.add(tree["type"])
        for v in tree.values():
            _node_types(v, acc)
    elif isinstance(tree, list):
        for v in tree:
            _node_types(v, acc)
    return acc


def _check_query_nodes(query: str) -> None:
    """Refuse a SELECT-class statement whose parse tree (DuckDB's json_serialize_sql) holds a query node
    that writes, e.g. ``WITH a AS (COPY ... TO 'file') SELECT 1``; fail closed if it cannot be read."""
    import json

    import duckdb

    try:
        tree = json.loads(duckdb.connect().execute("SELECT json_serialize_sql(?)", [query]).fetchone()[0])
    except (duckdb.Error, ValueError, TypeError):
        tree = {"error": True}
    if tree.get("error"):
        raise NotReadOnly(f"cannot check this statement's parts: `entropylens query` runs one read-only statement "
                          f"({READ_ONLY})")
    bad = sorted(_node_types(tree, set()) - _READING_NODES)
    if bad:
        shown = ", ".join(_NODE_WORD.get(b, b) for b in bad)
        raise NotReadOnly(f"{shown} inside a query is not allowed: `entropylens query` is read-only ({READ_ONLY}); "
                          "to save a result use --output FILE")


def check_read_only(sql: str, _depth: int = 0) -> None:
    """Raise NotReadOnly unless ``sql`` is one read-only statement (a parse error is left to DuckDB,
    which reports it when the query runs). EXPLAIN is allowed only around a statement that passes
    this same check."""
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return  # not SQL DuckDB can parse: running it gives the one-line syntax error
    if len(statements) > 1:
        raise NotReadOnly(f"the query has {len(statements)} statements; `entropylens query` runs one read-only "
                          f"statement ({READ_ONLY})")
    if not statements:
        return
    st = statements[0]
    kind = st.type.name  # SELECT, EXPLAIN, PRAGMA, COPY, CREATE, ...
    words = _strip_comments(st.query).split(None, 2)
    first = words[0].upper() if words else ""
    if kind == "SELECT":
        _check_query_nodes(st.query)
        return
    if kind == "EXPLAIN" or first == "EXPLAIN":  # (EXPLAIN [ANALYZE] PIVOT parses as MULTI)
        inner = _explained(st.query)
        inner_ok = inner is not None and _depth < 4
        if inner_ok:
            try:
                inner_ok = len(duckdb.extract_statements(inner)) == 1
            except duckdb.Error:
                inner_ok = False
        if not inner_ok:  # fail closed: what EXPLAIN wraps must be checked, not guessed
            raise NotReadOnly("cannot tell which statement this EXPLAIN wraps: `entropylens query` runs EXPLAIN only "
                              f"around a read-only statement ({READ_ONLY})")
        try:
            check_read_only(inner, _depth + 1)
        except NotReadOnly as e:
            raise NotReadOnly(f"EXPLAIN of a statement that is not read-only: {e}") from None
        return
    if kind == "MULTI" and first in ("PIVOT", "UNPIVOT"):
        return
    if kind == "PRAGMA":
        name = re.match(r"\s*pragma\s+([a-z_]+)", _strip_comments(st.query), flags=re.I)
        if name and name.group(1).lower() in READ_PRAGMAS:
            return
        shown = f"PRAGMA {name.group(1)}" if name else "this PRAGMA"
        raise NotReadOnly(f"{shown} is not allowed: `entropylens query` is read-only ({READ_ONLY}; PRAGMAs: "
                          f"{', '.join(READ_PRAGMAS)})")
    shown = first or kind
    raise NotReadOnly(f"{shown} statements are not allowed: `entropylens query` is read-only ({READ_ONLY}); "
                      "to save a result use --output FILE")
