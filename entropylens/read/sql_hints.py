"""What to add to a DuckDB binder / catalog error of a user's SQL: the closest known names (did you mean
`quadrant`), the views, and where the columns are listed (`entropylens schema`). One line."""

from __future__ import annotations

import difflib
import re

from ..schema import TABLES

VIEWS = ("runs", "steps", "sequences", "tokens", "probes")
MACROS = ("quadrant",)  # retau.py: quadrant(advantage, prob, tau)
_UNKNOWN = (
    re.compile(r'[Cc]olumn "([^"]+)" not found'),
    re.compile(r'does not have a column named "([^"]+)"'),
    re.compile(r"with name \"?([A-Za-z_][\w.]*)\"? does not exist"),
)
_KINDS = ("BinderException", "CatalogException")


def known_names() -> list[str]:
    """Every view, column and macro name a query over the views may use."""
    cols = {c.name for cols in TABLES.values() for c in cols} | {"run", "path"}
    return sorted(set(VIEWS) | set(MACROS) | cols)


def unknown_name(message: str) -> str | None:
    """The name a binder / catalog error says is unknown (None where it names none)."""
    for pat in _UNKNOWN:
        m = pat.search(message)
        if m:
            return m.group(1).split(".")[-1]
    return None


def hint(e: BaseException) -> str:
    """'; did you mean `quadrant`? views: runs, steps, sequences, tokens, probes; every column: `entropylens
    schema`' for a binder / catalog error, '' for any other."""
    if type(e).__name__ not in _KINDS:
        return ""
    name = unknown_name(str(e))
    pool = VIEWS if re.search(r"Table with name|Table Function", str(e)) else known_names()
    where = _views_of()
    if name and name.lower() in where and pool is not VIEWS:  # a real column, of another view than the query's
        said = f"; `{name.lower()}` is a column of {' and '.join(where[name.lower()])}"
        return f"{said}; views: {', '.join(VIEWS)}; every column: `entropylens schema`"
    close = difflib.get_close_matches(name.lower(), pool, n=3, cutoff=0.6) if name else []

    def named(c: str) -> str:  # a column with the views that hold it: `entropy_mean` (steps)
        return f"`{c}`" + (f" ({', '.join(where[c])})" if c in where and pool is not VIEWS else "")

    said = "; did you mean " + " or ".join(named(c) for c in close) + "?" if close else ""
    return f"{said}; views: {', '.join(VIEWS)}; every column: `entropylens schema`"


def _views_of() -> dict[str, list[str]]:
    """{column: the views (tables) that have it}."""
    out: dict[str, list[str]] = {}
    for table, cols in TABLES.items():
        for c in cols:
            out.setdefault(c.name, []).append(table)
    return out
