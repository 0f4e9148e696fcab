"""DuckDB over recorded runs: views ``runs``, ``steps``, ``sequences``, ``tokens``.

PATH may be a run directory, a directory of runs, or any directory above them: runs are found by
their run.json. Each table view reads its Hive-partitioned Parquet files (step=/rank= from the
path) with ``union_by_name`` (older runs that lack a newer column read as NULL) and carries a
``run`` column. Analyses are the ``*.sql`` files in ``entropylens.analyses``.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from .schema import TABLES

PARTITIONED = ("steps", "sequences", "tokens")


class QueryError(ValueError):
    """A user-facing query problem (bad path, unknown analysis, bad parameter, bad SQL)."""


def run_ids(dirs: list[Path], base: Path) -> list[str]:
    """A run's id is its directory name, or its path relative to ``base`` where names collide."""
    names = [d.name for d in dirs]
    return [d.name if names.count(d.name) == 1 else str(d.relative_to(base)) if d != base else d.name
            for d in dirs]


def find_runs(path: str | Path, runs: list[str] | None = None) -> list[Path]:
    """Run directories at or under ``path`` (a directory holding run.json), sorted by path.
    ``runs`` selects by run id (see :func:`run_ids`) or directory name."""
    p = Path(path)
    if not p.exists():
        raise QueryError(f"path does not exist: {p}")
    if not p.is_dir():
        raise QueryError(f"not a directory: {p}")
    found = [p] if (p / "run.json").is_file() else sorted(q.parent for q in p.rglob("run.json"))
    if not found:
        raise QueryError(f"no entropylens run under {p} (no run.json found)")
    if runs:
        wanted = set(runs)
        ids = run_ids(found, p)
        unknown = wanted - set(ids) - {d.name for d in found}
        if unknown:
            raise QueryError(f"unknown run(s) {', '.join(sorted(unknown))}; runs here: {', '.join(ids)}")
        found = [d for d, i in zip(found, ids) if i in wanted or d.name in wanted]
    return found


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _duck_type(dtype: str) -> str:
    return {"int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT", "float32": "FLOAT",
            "float64": "DOUBLE", "bool": "BOOLEAN", "string": "VARCHAR", "dict8": "VARCHAR"}[dtype]


def _read_run_json(d: Path, run_id: str) -> dict:
    try:
        info = json.loads((d / "run.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QueryError(f"unreadable run.json in {d}: {e}") from None
    cfg = info.get("config") or {}
    return {
        "run": run_id,
        "method": info.get("method") or cfg.get("method"),
        "config": json.dumps(cfg, sort_keys=True, default=str),
        "model": info.get("model"),
        "seed": info.get("seed"),
        "world_size": info.get("world_size"),
        "eps_low": info.get("eps_low"),
        "eps_high": info.get("eps_high"),
        "tau": info.get("tau"),
        "sample": info.get("sample"),
        "status": info.get("status"),
        "started_at": info.get("started_at"),
        "heartbeat_at": info.get("heartbeat_at"),
        "schema_version": info.get("schema_version"),
        "path": str(d),
    }


def _derived_sql(table: str, have: set[str]) -> str:
    """Derived columns (schema.Column.derived) the files lack; NULL where an input is missing too."""
    out = []
    for c in TABLES[table]:
        if not c.derived or c.name in have:
            continue
        inputs = set(re.findall(r"[a-z_]+", c.derived)) - {"exp", "e"}
        expr = c.derived if inputs <= have else "NULL"
        out.append(f", CAST({expr} AS {_duck_type(c.dtype)}) AS {c.name}")
    return "".join(out)


def connect(path: str | Path, *, runs: list[str] | None = None, database: str = ":memory:"):
    """A DuckDB connection with views runs / steps / sequences / tokens over the runs under ``path``."""
    import duckdb
    import pandas as pd

    dirs = find_runs(path, runs)
    ids = run_ids(dirs, Path(path))
    con = duckdb.connect(database)
    info = pd.DataFrame([_read_run_json(d, i) for d, i in zip(dirs, ids)])
    for c in TABLES["runs"]:
        if c.name not in info:
            info[c.name] = None
    con.register("_runs_df", info)
    casts = ", ".join(
        f"CAST({c.name} AS {_duck_type(c.dtype)}) AS {c.name}" for c in TABLES["runs"]
    )
    con.execute(f"CREATE VIEW runs AS SELECT {casts}, path FROM _runs_df")
    for table in PARTITIONED:
        selects = []
        for d, rid in zip(dirs, ids):
            if any((d / table).rglob("*.parquet")):
                src = (f"read_parquet({_sql_str(str(d / table / '**' / '*.parquet'))}, hive_partitioning = true, "
                       "union_by_name = true, hive_types = {'step': INTEGER, 'rank': SMALLINT})")
                have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
                selects.append(f"SELECT {_sql_str(rid)} AS run, *{_derived_sql(table, have)} FROM {src}")
        if selects:
            con.execute(f"CREATE VIEW {table} AS " + " UNION ALL BY NAME ".join(selects))
        else:  # no file yet: an empty view with the contract's columns
            cols = ", ".join(f"CAST(NULL AS {_duck_type(c.dtype)}) AS \"{c.name}\"" for c in TABLES[table])
            con.execute(f"CREATE VIEW {table} AS SELECT CAST(NULL AS VARCHAR) AS run, {cols} WHERE false")
    return con


# ---------------------------------------------------------------- analyses
_PARAM = re.compile(r"\$([a-z_][a-z0-9_]*)")


def _analysis_files() -> dict[str, str]:
    files = resources.files("entropylens.analyses")
    return {p.name[:-4]: p.read_text() for p in files.iterdir() if p.name.endswith(".sql")}


def parse_header(sql: str) -> dict:
    """The ``-- key: value`` lines at the top of an analysis file."""
    head: dict = {"notes": ""}
    for line in sql.splitlines():
        if not line.startswith("--"):
            break
        text = line[2:].strip()
        m = re.match(r"(title|columns|figure|params):\s*(.*)", text)
        if m:
            head[m.group(1)] = m.group(2)
        elif text:
            head["notes"] = (head["notes"] + " " + text).strip()
    params = {}
    for item in filter(None, (s.strip() for s in head.get("params", "").split(","))):
        if item == "none":
            continue
        name, _, default = item.partition("=")
        params[name.strip()] = default.strip()
    head["params"] = params
    return head


def analysis_info() -> dict[str, dict]:
    """name -> header (title, columns, figure, params, notes), sorted by name."""
    return {name: parse_header(sql) for name, sql in sorted(_analysis_files().items())}


def list_analyses() -> list[tuple[str, str]]:
    """(name, title) of every analysis, sorted by name."""
    return sorted((name, parse_header(sql).get("title", "")) for name, sql in _analysis_files().items())


def _literal(value) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, float)):
        return repr(value)
    s = str(value)
    if re.fullmatch(r"-?\d+", s):
        return s
    if re.fullmatch(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", s):
        return s
    if re.fullmatch(r"\[\s*-?[\d.eE+-]+(\s*,\s*-?[\d.eE+-]+)*\s*\]", s):
        return s  # a numeric list, e.g. bins
    raise QueryError(f"parameter value {s!r} is not a number or a list of numbers")


def render_analysis(name: str, **params) -> str:
    files = _analysis_files()
    if name not in files:
        raise QueryError(f"unknown analysis {name!r}; analyses: {', '.join(sorted(files))}")
    sql = files[name]
    declared = parse_header(sql)["params"]
    unknown = set(params) - set(declared)
    if unknown:
        raise QueryError(
            f"analysis {name!r} has no parameter {', '.join(sorted(unknown))}; "
            f"parameters: {', '.join(declared) or 'none'}"
        )
    values = {**declared, **params}
    return _PARAM.sub(lambda m: _literal(values[m.group(1)]) if m.group(1) in values else m.group(0), sql)


def run_analysis(con, name: str, **params):
    """Run analyses/<name>.sql on ``con`` (from :func:`connect`) and return a pandas DataFrame."""
    import duckdb

    sql = render_analysis(name, **params)
    try:
        return con.execute(sql).df()
    except duckdb.Error as e:
        raise QueryError(f"analysis {name!r} failed: {str(e).splitlines()[0]}") from None


def run_sql(con, sql: str):
    """A user's SQL; errors become one-line QueryErrors."""
    import duckdb

    try:
        return con.execute(sql).df()
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from None


__all__ = ["connect", "find_runs", "list_analyses", "run_analysis", "run_sql", "QueryError"]
