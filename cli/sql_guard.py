"""`entropylens query`'s statement check: the library's (entropylens/read/sql_guard.py), worded for the CLI."""

from __future__ import annotations

from entropylens.read.sql_guard import CLI, READ_ONLY, READ_PRAGMAS, NotReadOnly
from entropylens.read.sql_guard import check_read_only as _check


def check_read_only(sql: str) -> None:
    """Raise NotReadOnly unless ``sql`` is one read-only statement (entropylens.read.sql_guard)."""
    _check(sql, who=CLI)


__all__ = ["READ_ONLY", "READ_PRAGMAS", "NotReadOnly", "check_read_only"]
