"""Command output: a DataFrame as an aligned table, csv, json or parquet, printed or written to
--output (whose extension names the format), and the checks on --format / --output / --out that run
before any work."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from .errors import fail
from .options import Format


def check_out_dir(out: Path, option: str = "--out") -> None:
    """A local output directory must be a directory, or creatable as one: one line otherwise."""
    if "://" in str(out):
        return
    if out.exists() and not out.is_dir():
        fail(f"{option} {out} is a file; give a directory")
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        fail(f"{option} {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        fail(f"{option} {out}: {parent} is not writable")


# --output's extension names its format when --format is not given. A text name (.txt, or no extension)
# holds a table by default and any text format with --format; any other extension is refused (an
# .xlsx file holding a text table): the file would not be what its name says.
_SUFFIX_FORMATS = {".csv": Format.csv, ".json": Format.json, ".parquet": Format.parquet, ".pq": Format.parquet}
_TEXT_SUFFIXES = (".txt", "")


def output_format(fmt: Format | None, output: Path | None) -> Format:
    """--format, or else --output's extension (.csv, .json, .parquet / .pq; .txt or none: table), or else
    table. An extension that is none of these fails, and so does a --format that the extension
    contradicts (a file named .csv holding a text table misleads its reader); a file without an extension
    takes any --format."""
    if output is None:
        return fmt or Format.table
    suffix = output.suffix.lower()
    if suffix not in _SUFFIX_FORMATS and suffix not in _TEXT_SUFFIXES:
        suffixes: dict[Format | None, str] = {Format.table: ".txt", Format.json: ".json", Format.parquet: ".parquet"}
        want = suffixes.get(fmt, ".csv")
        fail(
            f"--output {output.name}: unknown extension {output.suffix}; entropylens writes .csv, .json, "
            f".parquet (.pq) or .txt (a text table): name the file {output.with_suffix(want).name}, or leave "
            "the extension out and pick the format with --format"
        )
    implied = _SUFFIX_FORMATS.get(suffix) or (Format.table if suffix else None)
    if fmt is None:
        return implied or Format.table
    if suffix in _TEXT_SUFFIXES and fmt != Format.parquet:
        return fmt  # csv and json are text too
    if implied is not None and implied != fmt:
        ext = {Format.table: ".txt"}.get(fmt, f".{fmt.value}")
        fail(
            f"--format {fmt.value} but --output {output.name} says {implied.value}: drop --format (the "
            f"extension decides) or name the file {output.with_suffix(ext).name}"
        )
    return fmt


def check_output(fmt: Format | None, output: Path | None) -> Format:
    """Everything about --format / --output that can fail, checked before the query runs: the format
    (:func:`output_format`), parquet without a file, a directory or a missing parent as the file."""
    fmt = output_format(fmt, output)
    if fmt == Format.parquet and output is None:
        fail("--format parquet needs --output FILE")
    if output is not None and output.is_dir():
        fail(f"--output {output} is a directory; give a file name")
    if output is not None and not output.parent.is_dir():
        fail(f"--output {output}: the directory {output.parent} does not exist")
    run = None if output is None else _run_folder_holding(output)
    if run is not None:
        fail(
            f"--output {output} is inside the run folder {run}: a query never writes into a run (it would "
            "replace the run's own files); give a path outside it"
        )
    return fmt


def _run_folder_holding(path: Path) -> Path | None:
    """The run folder (a folder holding run.json) that ``path`` lies in, or None."""
    for d in path.resolve().parents:
        if (d / "run.json").is_file():
            return d
    return None


def emit(df, fmt: Format | None, output: Path | None) -> None:
    """Print or write a DataFrame: table (aligned text), csv, json (records) or parquet (needs --output);
    without --format, --output's extension decides (:func:`output_format`); an unknown one fails."""
    fmt = check_output(fmt, output)
    if fmt == Format.parquet:
        try:
            df.to_parquet(output, index=False)
        except OSError as e:
            fail(f"--output {output}: {e.strerror or e}")
        typer.echo(f"wrote {len(df)} rows to {output}")
        return
    if fmt == Format.csv:
        text = df.to_csv(index=False)
    elif fmt == Format.json:
        text = json_text(df)
    else:
        text = table_text(df)
    if output is not None:
        try:
            output.write_text(text)
        except OSError as e:  # no permission, disk full: the user's to fix
            fail(f"--output {output}: {e.strerror or e}")
        typer.echo(f"wrote {len(df)} rows to {output}")
    else:
        typer.echo(text, nl=False)


def json_text(df) -> str:
    """The rows as a JSON list of records, every number as precise as csv writes it (pandas' to_json
    rounds floats to 10 decimals: 1e-12 became 0.0): float64 at full precision, float32 as float32
    prints (7.9756603e-07); NaN, inf and missing values null; timestamps and dates ISO 8601; lists and
    structs as JSON arrays and objects."""
    import json
    import math

    import numpy as np
    import pandas as pd

    def plain(v):
        if v is None or v is pd.NA or v is pd.NaT:
            return None
        if isinstance(v, (float, np.floating)):
            if not math.isfinite(v):
                return None
            return float(str(v)) if isinstance(v, np.float32) else float(v)
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, (pd.Timestamp, np.datetime64)):
            return pd.Timestamp(v).isoformat()
        if isinstance(v, np.ndarray):
            return [plain(x) for x in v.tolist()]
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return v

    columns = {
        c: [plain(v) for v in (df[c].to_numpy() if df[c].dtype == np.float32 else df[c].tolist())] for c in df.columns
    }  # float32 values stay np.float32: plain() prints them as float32
    rows = [dict(zip(columns, r)) for r in zip(*columns.values())] if len(df.columns) else [{} for _ in range(len(df))]
    return json.dumps(rows, indent=1, ensure_ascii=False, default=str) + "\n"


FOLD = 60  # characters: wider text cells (config JSON) are folded in tables; csv / json keep them whole
WHOLE = ("run", "path")  # never folded: a run id or a path is copied from the table


def _number(v: float) -> str:
    """Whole numbers as integers (a sum of counts is 1966080, not 1.96608e+06), others to 6 digits."""
    return f"{v:.0f}" if v == v and abs(v) < 1e15 and float(v).is_integer() else f"{v:.6g}"


def table_text(df) -> str:
    """Aligned text table: integers as integers, text longer than FOLD folded to one line with '...'
    (run ids and paths, WHOLE, are always shown whole), a missing value as NULL in every column (as csv
    leaves it empty and json writes null: a float NaN reads the same, as in those formats). Text and
    column names are escaped for the terminal (entropylens/report/escape.py: a control, format or bidi
    character as its code, e.g. \\u202e); csv and json keep the values exact."""
    import pandas as pd

    from entropylens.report.escape import terminal

    if not len(df):
        return "(no rows)\n"
    d = df.copy()
    d.columns = [terminal(c) for c in d.columns]
    folded, widest = [], FOLD + 5
    for c in d.columns:
        col = d[c]
        if pd.api.types.is_extension_array_dtype(col) and pd.api.types.is_integer_dtype(col) and col.isna().any():
            d[c] = col.astype(object)  # nullable integers: <NA> would print as is; as objects they take na_rep
        if d[c].dtype == object or pd.api.types.is_string_dtype(d[c]):
            # a user's text (a run id, a config value, a token's text) as printed: no raw control or bidi
            # character
            d[c] = [terminal(x) if isinstance(x, str) else x for x in d[c]]
            cells = [x if isinstance(x, str) else None for x in d[c]]
            longest = max((len(x) for x in cells if x is not None), default=0)
            if c in WHOLE:
                widest = max(widest, longest)
            elif longest > FOLD:
                d[c] = [x if x is None or len(x) <= FOLD else x[: FOLD - 3] + "..." for x in cells]
                folded.append(c)
    for c in d.columns:
        if d[c].dtype == object:  # None and pd.NA print as themselves; NaN takes na_rep
            d[c] = d[c].where(d[c].notna(), float("nan"))
    with pd.option_context(
        "display.max_rows",
        500,
        "display.max_columns",
        50,
        "display.width",
        250,
        "display.max_colwidth",
        widest,
        "display.float_format",
        _number,
    ):
        text = d.to_string(index=False, na_rep="NULL") + "\n"
    if folded:
        text += f"({', '.join(folded)} folded to {FOLD} characters; --format json prints them whole)\n"
    return text


def schema_text(table: str | None = None) -> str:
    """The column contract as text: the schema version, then per table (or only ``table``) one aligned
    line per column, name, dtype, meaning."""
    from entropylens.schema import SCHEMA_VERSION, TABLES

    lines = [f"schema version {SCHEMA_VERSION}"]
    for name, cols in TABLES.items():
        if table is not None and name != table:
            continue
        lines += ["", name]
        width = max(len(c.name) for c in cols)
        for c in cols:
            dtype = "dictionary<int8,string>" if c.dtype == "dict8" else c.dtype
            lines.append(f"  {c.name:<{width}}  {dtype:<23}  {c.meaning}")
    return "\n".join(lines) + "\n"
