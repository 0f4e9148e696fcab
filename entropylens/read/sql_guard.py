"""The read-only rule of every query a user writes: one statement that reads, nothing that writes or
changes the session. ``entropylens query`` (cli/main.py) checks its SQL with :func:`check_read_only`, and
every connection from :func:`entropylens.read.query.connect` is a :class:`ReadOnlyConnection`, which checks
each statement the same way before DuckDB sees it (``raw=True`` / ``.raw``: DuckDB's own connection,
unchecked, the documented escape hatch: docs/security.md).

DuckDB's own parser splits and classifies the SQL (``duckdb.extract_statements``); allowed are exactly
one SELECT-class statement (SELECT, WITH ..., VALUES, FROM ..., DESCRIBE, SHOW, SUMMARIZE, PIVOT /
UNPIVOT), EXPLAIN [ANALYZE] [(options)] of a statement that passes this same rule (EXPLAIN ANALYZE
runs what it wraps: ``EXPLAIN ANALYZE COPY ... TO`` writes files), or a PRAGMA from READ_PRAGMAS.
A SELECT-class statement whose parse tree holds a writing query node (DuckDB 2.0: ``WITH a AS (COPY ... TO
...) SELECT 1``, INSERT / UPDATE / DELETE as a CTE body) is refused too.
Everything else (COPY, CREATE, INSERT, UPDATE, DELETE, DROP, ALTER, ATTACH, DETACH, INSTALL, LOAD,
SET, CALL, EXPORT, IMPORT, several statements) is refused before it runs, with a one-line reason.

This check is the first of two layers: the connection itself is locked down after its views are
built (entropylens/read/lockdown.py: no file access beyond the runs' own files, no network, no
extension install or load, configuration locked), so a statement this parser check lets through
still cannot write elsewhere or reach the network.
"""

from __future__ import annotations

import re
import threading

from .catalog import QueryError

# PRAGMAs that only report (the others set options or write, e.g. a profiling output file)
READ_PRAGMAS = (
    "table_info",
    "show_tables",
    "show_tables_expanded",
    "show",
    "database_size",
    "version",
    "platform",
    "storage_info",
    "functions",
    "metadata_info",
    "database_list",
    "collations",
)
READ_ONLY = "SELECT / WITH / VALUES / FROM / DESCRIBE / SHOW / SUMMARIZE / PIVOT / EXPLAIN / read-only PRAGMA"


# who runs the SQL, and what to do instead of writing, as the refusals say it
PYTHON = (
    "this connection",
    "for statements that write or change the session use connect(PATH, raw=True): docs/security.md",
)
CLI = ("`entropylens query`", "to save a result use --output FILE")


class NotReadOnly(QueryError):
    """The SQL is not a single read-only statement (a QueryError: one line, a ValueError)."""


def _strip_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*|/\*.*?\*/", " ", sql, flags=re.S).strip()


# EXPLAIN, then ANALYZE and/or a parenthesized option list: EXPLAIN ANALYZE, EXPLAIN (FORMAT json),
# EXPLAIN (ANALYZE, FORMAT json), EXPLAIN ANALYZE (FORMAT json); comments may sit between the words
_GAP = r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*"
_EXPLAIN_HEAD = re.compile(
    rf"{_GAP}explain\b{_GAP}(?:analy[sz]e\b{_GAP})?(?:\((?:[^()'\"]|'[^']*'|\"[^\"]*\")*\){_GAP})?", re.I | re.S
)


def _explained(query: str) -> str | None:
    """The statement an EXPLAIN statement wraps (the text after EXPLAIN [ANALYZE] [(options)]), or
    None if that prefix cannot be found."""
    m = _EXPLAIN_HEAD.match(query)
    return query[m.end() :] if m else None


# the query nodes that only read; DuckDB 2.0 also takes COPY TO / INSERT / UPDATE / DELETE as a CTE body
# (COPY_QUERY_NODE, ...) inside a statement it classifies as SELECT
_READING_NODES = {"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"}
_NODE_WORD = {
    "COPY_QUERY_NODE": "COPY",
    "INSERT_QUERY_NODE": "INSERT",
    "UPDATE_QUERY_NODE": "UPDATE",
    "DELETE_QUERY_NODE": "DELETE",
}


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


_PARSER = threading.local()  # one in-memory DuckDB per thread that only parses (a connection is not thread safe)


def _parser():
    import duckdb

    con = getattr(_PARSER, "con", None)
    if con is None:
        con = _PARSER.con = duckdb.connect()
    return con


def _check_query_nodes(query: str, who: tuple[str, str]) -> None:
    """Refuse a SELECT-class statement whose parse tree (DuckDB's json_serialize_sql) holds a query node
    that writes, e.g. ``WITH a AS (COPY ... TO 'file') SELECT 1``; fail closed if it cannot be read."""
    import json

    import duckdb

    try:
        tree = json.loads(_parser().execute("SELECT json_serialize_sql(?)", [query]).fetchone()[0])
    except (duckdb.Error, ValueError, TypeError):
        tree = {"error": True}
    if tree.get("error"):
        raise NotReadOnly(f"cannot check this statement's parts: {who[0]} runs one read-only statement ({READ_ONLY})")
    bad = sorted(_node_types(tree, set()) - _READING_NODES)
    if bad:
        shown = ", ".join(_NODE_WORD.get(b, b) for b in bad)
        raise NotReadOnly(f"{shown} inside a query is not allowed: {who[0]} is read-only ({READ_ONLY}); {who[1]}")


def check_read_only(sql: str, _depth: int = 0, *, who: tuple[str, str] = PYTHON) -> None:
    """Raise NotReadOnly unless ``sql`` is one read-only statement (a parse error is left to DuckDB,
    which reports it when the query runs). EXPLAIN is allowed only around a statement that passes
    this same check. ``who``: (who runs the SQL, what to do instead of writing), for the message:
    :data:`PYTHON` or :data:`CLI`."""
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return  # not SQL DuckDB can parse: running it gives the one-line syntax error
    if len(statements) > 1:
        raise NotReadOnly(
            f"the query has {len(statements)} statements; {who[0]} runs one read-only statement ({READ_ONLY})"
        )
    if not statements:
        return
    st = statements[0]
    kind = st.type.name  # SELECT, EXPLAIN, PRAGMA, COPY, CREATE, ...
    words = _strip_comments(st.query).split(None, 2)
    first = words[0].upper() if words else ""
    if kind == "SELECT":
        _check_query_nodes(st.query, who)
        return
    if kind == "EXPLAIN" or first == "EXPLAIN":  # (EXPLAIN [ANALYZE] PIVOT parses as MULTI)
        inner = _explained(st.query)
        inner_ok = False
        if inner is not None and _depth < 4:
            try:
                inner_ok = len(duckdb.extract_statements(inner)) == 1
            except duckdb.Error:
                inner_ok = False
        if inner is None or not inner_ok:  # fail closed: what EXPLAIN wraps must be checked, not guessed
            raise NotReadOnly(
                f"cannot tell which statement this EXPLAIN wraps: {who[0]} runs EXPLAIN only "
                f"around a read-only statement ({READ_ONLY})"
            )
        try:
            check_read_only(inner, _depth + 1, who=who)
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
        raise NotReadOnly(
            f"{shown} is not allowed: {who[0]} is read-only ({READ_ONLY}; PRAGMAs: {', '.join(READ_PRAGMAS)})"
        )
    shown = first or kind
    raise NotReadOnly(f"{shown} statements are not allowed: {who[0]} is read-only ({READ_ONLY}); {who[1]}")


# methods of a DuckDB connection that write into its tables or install / load code: refused outright
_REFUSED = {
    "append": "appends rows to a table",
    "appender": "appends rows to a table",
    "query_appender": "appends rows to a table",
    "install_extension": "installs an extension",
    "load_extension": "loads an extension",
    "register_filesystem": "changes how files are read",
    "unregister_filesystem": "changes how files are read",
}


class ReadOnlyConnection:
    """A DuckDB connection whose SQL is checked by :func:`check_read_only` before it runs: the
    connection :func:`entropylens.read.query.connect` returns.

    ``execute`` / ``executemany`` / ``sql`` / ``query`` / ``from_query`` check their statement (a refusal
    is a one-line :class:`NotReadOnly`, a QueryError); ``cursor()`` / ``duplicate()`` give a connection
    checked the same way; ``register`` refuses a name the connection already has (a DataFrame
    registered as ``tokens`` would replace the view) and ``unregister`` takes only a name registered
    through it; the methods that append rows or
    install / load extensions are refused. Everything else (fetching, ``table``, ``read_parquet``,
    ``interrupt``, ``close``, ...) is DuckDB's own. ``.raw`` is the DuckDB connection itself,
    unchecked: the escape hatch for statements that write (docs/security.md). The relations that
    ``sql`` / ``query`` return are DuckDB's own too: what the Python code then calls on them
    (``.to_parquet(FILE)``, ``.query(name, SQL)``) is the code's, not a user's SQL, and is not checked."""

    def __init__(self, con):
        self.raw = con
        self._registered: set[str] = set()

    def _checked(self, query) -> None:
        if isinstance(query, str):
            check_read_only(query)
        elif query is not None:  # DuckDB also takes a prepared Statement object: not checkable by text
            raise NotReadOnly(
                "this connection takes SQL text only (a str); for other statement objects use "
                "connect(PATH, raw=True): docs/security.md"
            )

    def execute(self, query, parameters=None):
        self._checked(query)
        out = self.raw.execute(query, parameters)
        return None if out is None else self  # results are fetched from the connection, as DuckDB's own

    def executemany(self, query, parameters=None):
        self._checked(query)
        out = self.raw.executemany(query, parameters)
        return None if out is None else self

    def sql(self, query, **kwargs):
        self._checked(query)
        return self.raw.sql(query, **kwargs)

    def query(self, query, **kwargs):
        self._checked(query)
        return self.raw.query(query, **kwargs)

    def from_query(self, query, **kwargs):
        self._checked(query)
        return self.raw.from_query(query, **kwargs)

    def cursor(self):
        return ReadOnlyConnection(self.raw.cursor())

    def duplicate(self):
        return ReadOnlyConnection(self.raw.duplicate())

    def _new_name(self, name: str, what: str) -> None:
        have = {
            str(r[0]).lower()
            for r in self.raw.execute(
                "SELECT table_name FROM duckdb_tables() UNION ALL SELECT view_name FROM duckdb_views()"
            ).fetchall()
        }
        if str(name).lower() in have:
            raise NotReadOnly(
                f"cannot {what} {name!r}: the connection already has a table or view of that name; "
                "register your data under a new name"
            )

    def register(self, view_name: str, python_object):
        self._new_name(view_name, "register")
        self.raw.register(view_name, python_object)
        self._registered.add(str(view_name).lower())
        return self

    def unregister(self, view_name: str):
        if str(view_name).lower() not in self._registered:  # never one of the runs' views
            raise NotReadOnly(f"cannot unregister {view_name!r}: only a name registered on this connection can be")
        self.raw.unregister(view_name)
        self._registered.discard(str(view_name).lower())
        return self

    def __getattr__(self, name: str):
        if name in _REFUSED:
            raise NotReadOnly(
                f"{name}() {_REFUSED[name]}: this connection is read-only; use connect(PATH, "
                "raw=True): docs/security.md"
            )
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()

    def __repr__(self) -> str:
        return f"<entropylens ReadOnlyConnection over {self.raw!r}>"


def unguarded(con):
    """The DuckDB connection under ``con`` (``con`` itself if it is not a :class:`ReadOnlyConnection`)."""
    return con.raw if isinstance(con, ReadOnlyConnection) else con


__all__ = ["CLI", "PYTHON", "NotReadOnly", "ReadOnlyConnection", "check_read_only", "unguarded"]
