"""`entropylens query` is read-only: one statement that reads, nothing that writes or changes the session.

DuckDB's own parser splits and classifies the SQL (``duckdb.extract_statements``); allowed are exactly
one SELECT-class statement (SELECT, WITH ..., VALUES, FROM ..., DESCRIBE, SHOW, SUMMARIZE, PIVOT /
UNPIVOT), EXPLAIN [ANALYZE], or a PRAGMA from READ_PRAGMAS. Everything else (COPY, CREATE, INSERT,
UPDATE, DELETE, DROP, ALTER, ATTACH, DETACH, INSTALL, LOAD, SET, CALL, EXPORT, IMPORT, several
statements) is refused before it runs, with a one-line reason.
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


def check_read_only(sql: str) -> None:
    """Raise NotReadOnly unless ``sql`` is one read-only statement (a parse error is left to DuckDB,
    which reports it when the query runs)."""
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
    if kind in ("SELECT", "EXPLAIN"):
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
