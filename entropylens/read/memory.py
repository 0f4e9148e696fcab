"""DuckDB's ``memory_limit`` as every DuckDB entropylens supports takes it.

DuckDB 2 reads a percentage of the machine's memory (``"50%"``, the CLI's default); DuckDB 1.x
(the last release for Python 3.10) refuses it ("Unknown unit for memory: '%'"). :func:`memory_limit`
gives such a DuckDB the same share in MiB: percentage / 100 x the machine's memory (the cgroup's limit
where one is set and smaller). Sizes with a unit (``"4GB"``, ``"512MiB"``) pass through unchanged.
"""

from __future__ import annotations

import functools
import os
import re

_PERCENT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")


@functools.cache
def takes_percent() -> bool:
    """Whether this DuckDB reads ``memory_limit = '50%'`` itself (DuckDB 2 does, 1.x does not)."""
    import duckdb

    try:
        duckdb.connect().execute("SET memory_limit = '50%'")
    except duckdb.Error:
        return False
    return True


def total_memory() -> int | None:
    """This machine's memory in bytes: physical pages x page size, or the cgroup v2 limit
    (``/sys/fs/cgroup/memory.max``) where it is set and smaller; None where neither can be read."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        total = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap.isdigit():
            total = int(cap) if total is None else min(total, int(cap))
    except OSError:
        pass
    return total


def memory_limit(size: str) -> str:
    """``size`` as this DuckDB takes it: ``"P%"`` -> ``"<P / 100 x total_memory() in MiB>MiB"`` when
    DuckDB does not read percentages itself (and the machine's memory is known); anything else as given,
    for DuckDB to accept or name. E.g. 50% of 23.5 GiB -> ``"12052MiB"``."""
    m = _PERCENT.fullmatch(str(size))
    if m is None or takes_percent():
        return size
    total = total_memory()
    if total is None:
        return size
    return f"{max(1, int(total * float(m.group(1)) / 100 / 2**20))}MiB"


__all__ = ["memory_limit", "takes_percent", "total_memory"]
