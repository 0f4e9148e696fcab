"""entropylens command line. Each command parses, calls one library function, prints.

Errors a user can cause (a missing path, not a run, bad SQL, an unknown analysis, a bad parameter)
end with one line on stderr and exit code 2, never a traceback. Heavy imports (torch, duckdb,
matplotlib) happen inside the commands, so `entropylens --help` is fast.
"""

from __future__ import annotations

import os
import sys
import time as _time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core


def _plain_metavars() -> None:
    """Help as users expect it (#13): `--quick` (no `<bool>`), `PATH` (no `{PATH}` / `<str>`), `--run RUN`
    (no `<list[str]>`), choices as `[table|csv]`. Typer 0.29 has no setting for this; its display hooks
    are wrapped once here (skipped where a Typer version lacks them)."""
    from typer import core

    opt, arg = getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)
    if opt is None or arg is None or getattr(opt, "_entropylens_plain", False):
        return
    orig = opt.display_type_rich

    def option_type(self, ctx):
        if self.is_flag or getattr(self, "count", False):
            return None
        if self.metavar is not None:
            return self.metavar
        shown = orig(self, ctx) or ""
        if "|" in shown:  # a choice: <table|csv> or <list[a|b]>
            return "[" + shown.strip("<>").removeprefix("list[").rstrip("]") + "]"
        names = [o for o in self.opts if o.startswith("--")] or self.opts
        return max(names, key=len).lstrip("-").replace("-", "_").upper()

    def argument_usage(self):
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return name + ("..." if self.nargs != 1 else "")

    opt.display_type_rich = option_type
    arg.display_type_rich = lambda self, ctx: None  # the name column already says PATH / SQL / NAME
    if hasattr(arg, "_usage_display_name"):
        arg._usage_display_name = argument_usage
    opt._entropylens_plain = True


_plain_metavars()


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a bad choice, an unknown option, a missing argument) as ONE line on stderr,
    `error: ... (entropylens CMD --help)`, exit 2, instead of Typer's boxed multi-line panel."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:  # Typer 0.29 vendors click (typer._click); older Typer uses click itself
            from typer import _click as click
            from typer.exceptions import Abort
        except ImportError:  # pragma: no cover
            import click
            from click.exceptions import Abort

        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError:  # `entropylens` alone: the help, as before
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=standalone_mode, **extra)
        except click.ClickException as e:
            if not standalone_mode:
                raise
            msg = " ".join(e.format_message().split()).replace("Value error, ", "")
            ctx = getattr(e, "ctx", None)
            hint = f" ({ctx.command_path} --help)" if ctx is not None else ""
            typer.echo(f"error: {msg}{hint}", err=True)
            sys.exit(e.exit_code)
        except Abort:
            if not standalone_mode:
                raise
            typer.echo("aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)  # an Exit's code (--help: 0, _fail: 2)


app = typer.Typer(
    cls=_OneLineErrors,
    name="entropylens",
    help="Per-token training dynamics of GRPO-family RL: record, query, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

PathArg = Annotated[str, typer.Argument(
    metavar="PATH",
    help="A run directory, a directory of runs, or any directory above them; or an object-store URL "
         "(s3://bucket/prefix; endpoint and keys from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).")]


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


class Engine(str, Enum):
    duckdb = "duckdb"
    spark = "spark"


class Band(str, Enum):
    minmax = "minmax"
    sd = "sd"


EngineOpt = Annotated[Engine, typer.Option(
    "--engine", help="duckdb (canonical, local) or spark (the same SQL on pyspark; see docs/spark.md).")]


def _spark_connect(path, runs: list[str] | None = None):
    """Spark views over the runs under PATH (entropylens.spark); a one-line error if Spark cannot start."""
    from entropylens.spark import connect

    try:
        return connect(path, runs=runs or None)
    except _user_errors() as e:
        _fail(str(e))


@app.callback()
def _root() -> None:
    """Per-token training dynamics of GRPO-family RL: record, query, report."""
    _FileWarnings._seen.clear()  # each skipped file is named once per command


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code=2)


def _check_out_dir(out: Path, option: str = "--out") -> None:
    """A local output directory must be a directory, or creatable as one: one line otherwise."""
    if "://" in str(out):
        return
    if out.exists() and not out.is_dir():
        _fail(f"{option} {out} is a file; give a directory")
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        _fail(f"{option} {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        _fail(f"{option} {out}: {parent} is not writable")


def _os_error_line(e: OSError) -> str:
    """'No such file or directory: /proc/demo' rather than '[Errno 2] ...'."""
    return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e))


def _user_errors():
    """The exception types that are the user's to fix (printed as one line, exit 2)."""
    from entropylens.query import QueryError

    return (QueryError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


class _FileWarnings:
    """Print each skipped-file warning of the library once, as one line on stderr."""

    _seen: set = set()  # messages printed by this command (reset by _root)

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        from entropylens.query import UnreadableFileWarning

        self._cm.__exit__(*exc)
        for w in self._caught:
            if issubclass(w.category, UnreadableFileWarning) and str(w.message) not in self._seen:
                self._seen.add(str(w.message))
                typer.echo(f"warning: {w.message}", err=True)
        return False


def _connect(path: str, runs: list[str] | None = None):
    from entropylens.query import connect

    try:
        with _FileWarnings():
            return connect(path, runs=runs or None)
    except _user_errors() as e:
        _fail(str(e))


# --output's extension names its format when --format is not given. A text name (.txt, or no extension)
# holds a table by default and any text format with --format; any other extension is refused (#27: an
# .xlsx file received a text table): the file would not be what its name says.
_SUFFIX_FORMATS = {".csv": Format.csv, ".json": Format.json, ".parquet": Format.parquet, ".pq": Format.parquet}
_TEXT_SUFFIXES = (".txt", "")
_FORMAT_HELP = "Output format (default: --output's extension; table for .txt, no extension or no --output)."
_OUTPUT_HELP = "Write to this file. Its extension names the format: .csv .json .parquet .pq .txt or none; any other is refused."


def _output_format(fmt: Format | None, output: Path | None) -> Format:
    """--format, or else --output's extension (.csv, .json, .parquet / .pq; .txt or none: table), or else
    table. An extension that is none of these fails, and so does a --format that the extension
    contradicts (a file named .csv holding a text table misleads its reader); a file without an extension
    takes any --format."""
    if output is None:
        return fmt or Format.table
    suffix = output.suffix.lower()
    if suffix not in _SUFFIX_FORMATS and suffix not in _TEXT_SUFFIXES:
        want = {Format.table: ".txt", Format.json: ".json", Format.parquet: ".parquet"}.get(fmt, ".csv")
        _fail(f"--output {output.name}: unknown extension {output.suffix}; entropylens writes .csv, .json, "
              f".parquet (.pq) or .txt (a text table): name the file {output.with_suffix(want).name}, or leave "
              "the extension out and pick the format with --format")
    implied = _SUFFIX_FORMATS.get(suffix) or (Format.table if suffix else None)
    if fmt is None:
        return implied or Format.table
    if suffix in _TEXT_SUFFIXES and fmt != Format.parquet:
        return fmt  # csv and json are text too
    if implied is not None and implied != fmt:
        ext = {Format.table: ".txt"}.get(fmt, f".{fmt.value}")
        _fail(f"--format {fmt.value} but --output {output.name} says {implied.value}: drop --format (the "
              f"extension decides) or name the file {output.with_suffix(ext).name}")
    return fmt


def _check_output(fmt: Format | None, output: Path | None) -> Format:
    """Everything about --format / --output that can fail, checked before the query runs: the format
    (:func:`_output_format`), parquet without a file, a directory or a missing parent as the file."""
    fmt = _output_format(fmt, output)
    if fmt == Format.parquet and output is None:
        _fail("--format parquet needs --output FILE")
    if output is not None and output.is_dir():
        _fail(f"--output {output} is a directory; give a file name")
    if output is not None and not output.parent.is_dir():
        _fail(f"--output {output}: the directory {output.parent} does not exist")
    return fmt


def _emit(df, fmt: Format | None, output: Path | None) -> None:
    """Print or write a DataFrame: table (aligned text), csv, json (records) or parquet (needs --output);
    without --format, --output's extension decides (:func:`_output_format`); an unknown one fails."""
    fmt = _check_output(fmt, output)
    if fmt == Format.parquet:
        try:
            df.to_parquet(output, index=False)
        except OSError as e:
            _fail(f"--output {output}: {e.strerror or e}")
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
            _fail(f"--output {output}: {e.strerror or e}")
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

    columns = {c: [plain(v) for v in (df[c].to_numpy() if df[c].dtype == np.float32 else df[c].tolist())]
               for c in df.columns}  # float32 values stay np.float32: plain() prints them as float32
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
    leaves it empty and json writes null: a float NaN reads the same, as in those formats)."""
    import pandas as pd

    if not len(df):
        return "(no rows)\n"
    d = df.copy()
    folded, widest = [], FOLD + 5
    for c in d.columns:
        col = d[c]
        if pd.api.types.is_extension_array_dtype(col) and pd.api.types.is_integer_dtype(col) and col.isna().any():
            d[c] = col.astype(object)  # nullable integers: <NA> would print as is; as objects they take na_rep
        if d[c].dtype == object or pd.api.types.is_string_dtype(d[c]):
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
    with pd.option_context("display.max_rows", 500, "display.max_columns", 50, "display.width", 250,
                           "display.max_colwidth", widest, "display.float_format", _number):
        text = d.to_string(index=False, na_rep="NULL") + "\n"
    if folded:
        text += f"({', '.join(folded)} folded to {FOLD} characters; --format json prints them whole)\n"
    return text


@app.command()
def schema(
    table: Annotated[Optional[str], typer.Argument(metavar="TABLE", help="Only this table (runs, steps, sequences, tokens, probes).")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print Markdown tables (as in docs/schema.md).")] = False,
) -> None:
    """Print the column contract (name, dtype, meaning) of every table."""
    from entropylens.schema import SCHEMA_VERSION, TABLES, schema_markdown

    if table is not None and table not in TABLES:
        _fail(f"unknown table {table!r}; tables: {', '.join(TABLES)}")
    if markdown:
        typer.echo(schema_markdown(table), nl=False)
        return
    typer.echo(f"schema version {SCHEMA_VERSION}")
    for name, cols in TABLES.items():
        if table is not None and name != table:
            continue
        typer.echo(f"\n{name}")
        width = max(len(c.name) for c in cols)
        for c in cols:
            dtype = "dictionary<int8,string>" if c.dtype == "dict8" else c.dtype
            typer.echo(f"  {c.name:<{width}}  {dtype:<23}  {c.meaning}")


@app.command()
def runs(path: PathArg) -> None:
    """One line per run: method, steps, tokens, final entropy (old_entropy; entropy where only that was recorded), final reward, status.

    A run is a folder holding run.json: PATH itself, or a folder below it.

    Not searched, as they cannot hold a run: the folders of a run (nothing below a run), hidden folders (.git, .venv, .cache, ...), __pycache__, node_modules, site-packages, dist-packages, virtual environments (pyvenv.cfg), and folders that cannot be read (skipped silently). Symbolic links to folders are not followed. Warnings name files of runs only.
    """
    from entropylens.query import run_analysis

    con = _connect(path)
    df = run_analysis(con, "run_summary")
    _emit(df[["run", "method", "steps", "tokens", "final_entropy", "final_reward", "status"]], Format.table, None)


def _is_sql(arg: str) -> bool:
    """An argument that starts with `--` but is SQL (an SQL comment first): it has whitespace before any
    `=`, which no option name has (`--run=a b` is an option, `-- top runs\nSELECT ...` is SQL)."""
    return arg.startswith("--") and len(arg) > 2 and any(c.isspace() for c in arg.split("=", 1)[0])


class _QueryCommand(typer.core.TyperCommand):
    """`entropylens query`: SQL that starts with an SQL comment (`-- ...`) is the SQL argument, not an
    unknown option (it is moved behind a `--` separator before parsing)."""

    def parse_args(self, ctx, args):
        if "--" not in args and any(_is_sql(a) for a in args):
            args = [a for a in args if not _is_sql(a)] + ["--"] + [a for a in args if _is_sql(a)]
        return super().parse_args(ctx, args)


@app.command(cls=_QueryCommand)
def query(
    path: PathArg,
    sql: Annotated[str, typer.Argument(
        metavar="SQL", help="One read-only statement (SELECT, WITH, VALUES, FROM, DESCRIBE, SHOW, SUMMARIZE, PIVOT, "
                            "EXPLAIN of one of those, a few reporting PRAGMAs) over "
                            "the views runs, steps, sequences, tokens; `-` reads it from stdin.")],
    fmt: Annotated[Optional[Format], typer.Option("--format", "-f", show_default=False, help=_FORMAT_HELP)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE", help=_OUTPUT_HELP)] = None,
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (repeatable).")] = None,
) -> None:
    """Run one read-only SQL statement (DuckDB) over the runs under PATH.

    Statements that write or change the session (COPY, CREATE, INSERT, ATTACH, INSTALL, SET, ...) are refused, and so is EXPLAIN [ANALYZE] around any of them.

    The connection is also locked down (DuckDB's enable_external_access off, configuration locked): a query can read only the files of the runs under PATH, not other files of yours (read_csv, read_parquet, read_text of other paths fail), cannot write any file, attach a database, install or load an extension, or reach the network. To join runs with your own files use the Python API: entropylens.query.connect(PATH, lock=False). Save a result with --output FILE.

    SQL may start with an SQL comment (`-- ...`); `-` reads the SQL from stdin: `entropylens query PATH - < q.sql`.
    """
    from entropylens.cli.sql_guard import NotReadOnly, check_read_only
    from entropylens.query import QueryError, run_sql

    _check_output(fmt, output)  # a bad --output fails before the query runs
    if sql == "-":
        sql = sys.stdin.read()
    try:
        check_read_only(sql)
    except NotReadOnly as e:
        _fail(str(e))
    con = _connect(path, run)
    try:
        df = run_sql(con, sql)
    except QueryError as e:
        _fail(str(e))
    _emit(df, fmt, output)


@app.command()
def analyses() -> None:
    """List the named analyses (one SQL file each) with their titles and parameters."""
    from entropylens.query import analysis_info

    for name, info in analysis_info().items():
        params = ", ".join(f"{k}={v}" for k, v in info["params"].items())
        typer.echo(f"{name:<28} {info.get('title', '')}" + (f"  [{params}]" if params else ""))


@app.command()
def analyze(
    path: PathArg,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Analysis name (see `entropylens analyses`).")],
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (repeatable).")] = None,
    param: Annotated[Optional[list[str]], typer.Option("--param", "-p", metavar="K=V", help="An analysis parameter, e.g. bins=5 (repeatable).")] = None,
    fmt: Annotated[Optional[Format], typer.Option("--format", "-f", show_default=False, help=_FORMAT_HELP)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE", help=_OUTPUT_HELP)] = None,
    engine: EngineOpt = Engine.duckdb,
) -> None:
    """Run a named analysis over the runs under PATH."""
    from entropylens.query import QueryError, render_analysis, run_analysis

    params = {}
    for p in param or []:
        k, sep, v = p.partition("=")
        if not sep or not k:
            _fail(f"bad parameter {p!r}: use --param name=value")
        params[k.strip()] = v.strip()
    _check_output(fmt, output)  # a bad --output fails before the analysis runs
    try:
        render_analysis(name, **params)  # unknown analysis / bad parameter before touching the data
    except QueryError as e:
        _fail(str(e))
    con = _spark_connect(path, run) if engine == Engine.spark else _connect(path, run)
    try:
        df = run_analysis(con, name, **params)
    except QueryError as e:
        _fail(str(e))
    _emit(df, fmt, output)
    if df.empty:
        from entropylens.report import when_empty

        if when_empty(name):  # an opt-in analysis: say how to record what it needs
            typer.echo(f"note: no rows: {when_empty(name)}", err=True)


@app.command()
def report(
    path: PathArg,
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (repeatable).")] = None,
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Output directory.")] = Path("entropylens-report"),
    engine: EngineOpt = Engine.duckdb,
    group_by: Annotated[Optional[str], typer.Option(
        "--group-by", metavar="method|config|KEY",
        help="Draw runs that share this as one series: their mean with a band over the runs. 'method'; "
             "'config' (runs whose configs differ only in the seed); or a config key such as lr or seed. "
             "Default: one line, bar or panel per run.")] = None,
    band: Annotated[Band, typer.Option(
        "--band", help="With --group-by: the band of a series, minmax (min to max over its runs) or sd (mean +- 1 sd).")]
    = Band.minmax,
    responses: Annotated[int, typer.Option(
        "--responses", metavar="N", min=0,
        help="Responses per run on its token-viewer page (responses-RUN.html): from steps spread over the "
             "run, the highest and lowest reward, most clipped, largest entropy effect, most ERC-dropped, "
             "highest entropy. 0: no pages. Each page's data stays under 4 MB (fewer responses if needed).")] = 40,
    where: Annotated[Optional[str], typer.Option(
        "--where", metavar="SQL",
        help="Only responses with a token row where this condition holds: a SQL condition on the tokens "
             "columns and the response's reward and length, e.g. \"quadrant = 'PA&LP' AND clipped\".")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", metavar="PATH",
        help="A tokenizer (a local folder, loaded offline) to show the tokens' text, in place of the one a run "
             "names (TRL and verl runs name theirs; without any, token ids are shown).")] = None,
) -> None:
    """Write the paper-style report (index.html, report.md, PNG figures, one token-viewer page per run)
    for the runs under PATH.

    Thresholds (tau, eps, the ERC band, beta1 / beta2, dual-clip) are each run's own.

    Verdicts against the papers only where the runs differ in the method alone; else captions name what differs."""
    from entropylens.report import write_report

    _connect(path, run)  # path errors first, as one line
    _check_out_dir(out)
    try:
        with _FileWarnings():
            index = write_report(path, out, runs=run or None, engine=engine.value, group_by=group_by,
                                 band=band.value, responses=responses, where=where, tokenizer=tokenizer)
    except _user_errors() as e:
        _fail(_os_error_line(e) if isinstance(e, OSError) else str(e))
    except BrokenPipeError:
        raise  # the reader of our output went away: main() stops quietly
    except OSError as e:  # e.g. an --out under /proc: the system's reason, one line
        _fail(f"--out {out}: {_os_error_line(e)}")
    typer.echo(f"report: {index}")


@app.command()
def show(
    path: PathArg,
    run: Annotated[Optional[str], typer.Option(
        "--run", help="The run (may be left out when PATH holds one run).")] = None,
    step: Annotated[Optional[int], typer.Option(
        "--step", help="The step (default: the run's last step with token rows).")] = None,
    seq: Annotated[Optional[int], typer.Option(
        "--seq", help="One response: print its tokens coloured by --color. Without it: list the step's "
                      "responses.")] = None,
    rank: Annotated[Optional[int], typer.Option(
        "--rank", help="The rank that recorded the response, where several ranks recorded that --seq; without "
                       "--seq: list only this rank's responses.")] = None,
    update: Annotated[Optional[int], typer.Option(
        "--update", help="With --seq: the update to show (default: the step's last update with rows for the "
                         "response).")] = None,
    color: Annotated[Optional[str], typer.Option(
        "--color", metavar="METRIC",
        help="With --seq: the metric that colours the tokens (default entropy): entropy, old_entropy, prob, ratio, "
             "entropy_ratio, quadrant, clip, erc, logit_grad_norm, grad_coef, entropy_effect, "
             "entropy_effect_dropped.")] = None,
    where: Annotated[Optional[str], typer.Option(
        "--where", metavar="SQL",
        help="Without --seq: list only the responses with a token row where this holds (the tokens view's "
             "columns, plus the response's reward and length), e.g. \"quadrant = 'PA&LP' AND clipped\".")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", metavar="PATH",
        help="With --seq: a tokenizer (a local directory, or a Hugging Face name already in the local cache) "
             "for the tokens' text. Default: the one the run recorded; without any, token ids as ⟨id⟩.")] = None,
) -> None:
    """Read a step's responses in the terminal: a list of them, or one token by token, coloured.

    Without --seq: one line per response of the step (rank, seq, group, reward, advantage, length, tokens, updates, mean entropy, clipped, ERC-dropped, entropy effect).

    With --seq: the response's tokens at one update, each on a background colour from --color; the forking tokens (the top 20% by sampling entropy) bold and underlined; a legend; the response across its step's updates.

    Colour scales run over the response's own values: low to high (entropy, prob, ...), around 1 on a log scale (ratio, entropy_ratio), around 0 (grad_coef, entropy_effect), or one colour per category (quadrant, clip, erc); grey: no value. Colours only on a terminal (or with FORCE_COLOR set). docs/viewer.md."""
    import warnings

    from rich.console import Console

    from entropylens import show as view

    if seq is None:
        given = [name for name, v in (("--update", update), ("--color", color), ("--tokenizer", tokenizer))
                 if v is not None]
        if given:
            _fail(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to one response: add --seq "
                  "SEQ (without it the step's responses are listed)")
    elif where is not None:
        _fail("--where chooses which responses are listed: leave it out with --seq")
    try:
        view.metric_for(color or "entropy")  # an unknown --color before touching the data
    except _user_errors() as e:
        _fail(str(e))
    con = _connect(path, [run] if run else None)
    try:
        names = view.runs_of(con)
        if run is not None and run not in names and len(names) == 1:
            run = names[0]  # --run named the run's directory; the views call it by its id
        run = view.pick_run(con, run)
        if seq is None:
            out = view.list_step(con, run, step, where=where, rank=rank)
        else:
            from entropylens.token_text import TokenTextWarning, decoder_for_run

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TokenTextWarning)
                decoder = decoder_for_run(path, run, tokenizer)
            for w in caught:
                if issubclass(w.category, TokenTextWarning):
                    typer.echo(f"warning: {str(w.message).removeprefix('entropylens: ')}", err=True)
            out = view.show_response(con, run, step, seq, rank=rank, update=update, color=color or "entropy",
                                     decoder=decoder)
    except _user_errors() as e:
        _fail(str(e))
    wide = sys.stdout.isatty() or os.environ.get("COLUMNS")
    Console(highlight=False, width=None if wide else 120).print(out)


@app.command()
def check(
    path: PathArg,
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (repeatable).")] = None,
    collapse: Annotated[float, typer.Option(
        "--collapse", help="collapse: entropy below this fraction of its initial value.")] = 0.25,
    explosion: Annotated[float, typer.Option(
        "--explosion", help="explosion: entropy above this multiple of its initial value.")] = 2.0,
    budget_steps: Annotated[int, typer.Option(
        "--budget-steps", help="negative_budget: entropy budget below 0 for this many steps in a row ...")] = 10,
    budget_entropy: Annotated[float, typer.Option(
        "--budget-entropy", help="negative_budget: ... while entropy is below this fraction of its initial value.")] = 0.5,
    clip_spike: Annotated[float, typer.Option(
        "--clip-spike", help="clip_spike: clipped fraction above this multiple of its rolling median.")] = 3.0,
    kl_spike: Annotated[float, typer.Option(
        "--kl-spike", help="kl_spike: KL above this multiple of its rolling median.")] = 5.0,
    grad_norm_spike: Annotated[float, typer.Option(
        "--grad-norm-spike", help="grad_norm_spike: grad norm above this multiple of its rolling median.")] = 3.0,
    erc_drop_min: Annotated[float, typer.Option(
        "--erc-drop-min", help="erc_drop_rate: ERC drop fraction below this while the step's entropy ratios "
                               "(p05 / p95) leave the ERC band.")] = 0.001,
    erc_drop_max: Annotated[float, typer.Option(
        "--erc-drop-max", help="erc_drop_rate: ERC drop fraction above this.")] = 0.5,
    no_signal_share: Annotated[float, typer.Option(
        "--no-signal-share", help="no_signal: a step is signal-free when at least this share of its tokens has "
                                  "advantage 0, or of its updates grad norm 0.")] = 0.5,
    no_signal_steps: Annotated[int, typer.Option(
        "--no-signal-steps", help="no_signal: this many signal-free steps in a row, or at least this many making "
                                  "up --no-signal-share of the last --window steps.")] = 3,
    window: Annotated[int, typer.Option(
        "--window", help="The previous steps in the spike rules' rolling median; the last steps in "
                         "no_signal's share.")] = 20,
    baseline: Annotated[int, typer.Option(
        "--baseline", help="First steps whose mean entropy is the initial entropy.")] = 3,
) -> None:
    """Alarms over the runs' step aggregates: one line per finding (run, step, rule, value, threshold[,
    signal]), at the step where a rule starts firing (once per episode); exit 1 when any rule fires, 0
    when none (a CI gate for training runs). H0: the mean entropy of the first --baseline steps.

    nonfinite (always on): loss, grad norm, lr, KL or entropy is NaN or inf (signal names it), or tokens'
    ratio overflowed (n_nonfinite_ratio > 0).

    collapse / explosion: entropy below --collapse x H0 / above --explosion x H0.

    negative_budget: the entropy budget below 0 for --budget-steps steps in a row while entropy is below
    --budget-entropy x H0 (entropy already fell that far and the updates still push it down).

    clip_spike / kl_spike / grad_norm_spike: clipped fraction / KL / grad norm above --clip-spike /
    --kl-spike / --grad-norm-spike x its median over the previous --window steps (needs 5 of them; a
    median of 0 never fires).

    erc_drop_rate: ERC drop fraction above --erc-drop-max, or below --erc-drop-min while the step's entropy
    ratios leave its ERC band (dropping nothing inside the band is healthy).

    no_signal: a step is signal-free when at least --no-signal-share of its tokens have advantage 0, or of
    its updates grad norm 0; fires at --no-signal-steps such steps in a row, or when they are at least
    that many and at least --no-signal-share of the last --window steps."""
    from entropylens.alarms import Thresholds
    from entropylens.alarms import check as run_check

    try:
        t = Thresholds(collapse=collapse, explosion=explosion, budget_steps=budget_steps,
                       budget_entropy=budget_entropy, clip_spike=clip_spike, kl_spike=kl_spike,
                       grad_norm_spike=grad_norm_spike, erc_drop_min=erc_drop_min, erc_drop_max=erc_drop_max,
                       no_signal_share=no_signal_share, no_signal_steps=no_signal_steps, window=window,
                       baseline=baseline)
    except ValueError as e:
        _fail(str(e))
    _connect(path, run)  # path errors first, as one line
    try:
        with _FileWarnings():
            findings = run_check(path, t, runs=run or None)
    except _user_errors() as e:
        _fail(str(e))
    for f in findings:
        typer.echo(f.line())
    if findings:
        raise typer.Exit(code=1)
    typer.echo(f"no alarm in the runs under {path}")


@app.command()
def watch(
    path: PathArg,
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (repeatable).")] = None,
    interval: Annotated[float, typer.Option(
        "--interval", help="Seconds between refreshes (each re-reads the committed steps).")] = 2.0,
) -> None:
    """A live terminal view of runs being written: per run the latest steps' entropy (sparkline and
    table), reward, clip fractions by side and quadrant, entropy-ratio quantiles and the share outside
    the ERC band, and the alarms of `entropylens check` (default thresholds). Reads the steps table
    only, reconnecting every --interval seconds; leaves when every run is finished or failed (a
    summary line) or on Ctrl-C (exit 0). docs/watch.md."""
    from entropylens.watch import snapshot, summary_line
    from entropylens.watch import watch as live

    if not (interval > 0 and interval < float("inf")):
        _fail(f"--interval must be a number of seconds > 0, got {interval}")
    try:
        with _FileWarnings():
            first = snapshot(path, run or None)  # a missing PATH, no run, an unknown --run: one line
    except _user_errors() as e:
        _fail(str(e))
    except KeyboardInterrupt:  # Ctrl-C before the first view: leave as from the view
        typer.echo("watch: stopped (Ctrl-C)")
        return
    snap, interrupted = live(path, runs=run or None, interval=interval, first=first)
    typer.echo("watch: stopped (Ctrl-C); " + summary_line(snap).removeprefix("watch: ") if interrupted
               else summary_line(snap))


@app.command()
def verify(path: PathArg) -> None:
    """Check every file under PATH: list the unreadable ones (exit 1), or say all is whole (exit 0)."""
    from entropylens.catalog import verify as check

    try:
        res = check(path)
    except _user_errors() as e:
        _fail(str(e))
    for f, why in res.bad:
        typer.echo(f"bad: {f}: {why}")
    if res.hidden:
        typer.echo(f"note: {res.hidden} file(s) of uncommitted steps (no steps file; hidden by the views)")
    typer.echo(f"{len(res.bad)} bad file(s) among {res.files} in {res.runs} run(s) under {path}")
    if res.bad:
        raise typer.Exit(code=1)


@app.command()
def compact(
    path: PathArg,
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these runs (repeatable).")] = None,
    grace: Annotated[float, typer.Option(
        "--grace", metavar="SECONDS", help="Seconds between committing the compacted files and removing the originals, "
                        "so that queries already running finish.")] = 10.0,
    file_mb: Annotated[int, typer.Option("--file-mb", metavar="MB", help="Target size of a compacted file (MB of originals).")]
        = 512,
) -> None:
    """Rewrite each run's many small per-step files into few large ones (readers never see both)."""
    from entropylens.compact import compact as run_compact

    from entropylens.query import find_runs

    try:  # path errors first, as one line (before the banner); a listing, no reading
        find_runs(path, runs=run or None)
    except _user_errors() as e:
        _fail(str(e))
    if grace > 0:  # new-user trial: the waits looked like a hang
        typer.echo(f"compacting: each run waits --grace {grace:g} s after its commit before removing the originals "
                   "(queries already planned on them finish)", err=True)
    try:
        with _FileWarnings():
            results = run_compact(path, runs=run or None, grace_s=grace, file_bytes=file_mb << 20)
    except _user_errors() as e:
        _fail(str(e))
    for r in results:
        typer.echo(r.summary())


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Output directory (runs/ and report/ inside).")] = Path(
        "entropylens-demo"),
    methods: Annotated[str, typer.Option("--methods", metavar="A,B,...", help="Comma-separated named runs.")] = "grpo,dapo,ce_gppo,erc_dapo",
    steps: Annotated[Optional[int], typer.Option(
        "--steps", metavar="N", help="RL steps per run (default 32, about a minute on 2 cores; 120: the fast "
                                     "regime's full length, about 3 minutes).")] = None,
    seeds: Annotated[int, typer.Option("--seeds", metavar="K", help="Seeds per method.")] = 1,
    quick: Annotated[bool, typer.Option("--quick", help="Tiny runs (seconds), for tests and a first look.")] = False,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", metavar="N", help="Runs trained in parallel processes (1 torch thread each); default: one per core.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace runs of the same name already under --out (refused otherwise).")] = False,
    probe_every: Annotated[int, typer.Option(
        "--probe-every", metavar="K", min=0,
        help="Parameter-space entropy probe (probes table) on every K-th step; 0: off.")] = 0,
) -> None:
    """Train the built-in toy policy under each method, record every run, write the report.

    Default: grpo, dapo, ce_gppo and erc_dapo, 32 RL steps each: about a minute on 2 quiet cores.

    Named runs: grpo, dapo, gppo, ce_gppo (beta 0.5/1), ce_gppo_b0 (0/1), ce_gppo_switch (beta1 0 -> 0.5),
    cispo, gspo, erc_dapo, erc_gppo, entropy_bonus_<coef>, ce_gppo_<beta1>_<beta2>, dual_clip_<c>.
    """
    import time

    names = tuple(m.strip() for m in methods.split(",") if m.strip())
    if not names:
        _fail("--methods is empty")
    _check_out_dir(out)
    if not overwrite:  # a second `entropylens demo` is refused before seconds of imports and a fork server
        taken = [f"{n}-s{k}" for n in names for k in range(max(1, seeds)) if (out / "runs" / f"{n}-s{k}").exists()]
        if taken:
            from entropylens.run_claim import runs_exist_message

            _fail(runs_exist_message(out / "runs", taken))
    from entropylens.workers import start_fork_server

    start_fork_server(len(names) * max(1, seeds), workers)  # its imports overlap ours (torch: seconds)
    from entropylens.demo import run_demo
    from entropylens.toy.config import config_for

    try:
        for n in names:
            try:  # validate before training
                config_for(n, **({"steps": steps} if steps is not None else {}))
            except ValueError as e:
                if str(e).startswith("unknown run "):  # the user typed a method name
                    raise ValueError(f"--methods: unknown method {str(e)[len('unknown run '):]}") from None
                raise
        t_run = time.perf_counter()
        res = run_demo(out, methods=names, steps=steps, seeds=seeds, quick=quick, workers=workers,
                       overwrite=overwrite, probe_every=probe_every)
    except ValueError as e:
        _fail(str(e))
    except BrokenPipeError:
        raise  # the reader of our output went away: main() stops quietly
    except OSError as e:  # the output directory (a full disk, a read-only or pseudo file system)
        _fail(f"--out {out}: {_os_error_line(e)}")
    t0 = time.perf_counter()
    _emit(_summary(res.runs_dir, [r.run for r in res.runs], res.summary), Format.table, None)
    typer.echo(f"runs: {res.runs_dir}")
    # start: interpreter, imports, the fork server's launch (before run_demo); process: all of it so far
    phases = {k: v for k, v in res.phases.items() if k != "total"}
    phases["summary"] = time.perf_counter() - t0
    since = _process_seconds()
    if since is not None:
        phases = {"start": since - (time.perf_counter() - t_run), **phases, "process": since}
    else:
        phases["total"] = res.phases["total"]
    typer.echo("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    if res.report_dir:
        typer.echo(f"report: {res.report_dir / 'index.html'}")


_IMPORTED_AT = _time.perf_counter()
_EXEC_GAP_S = 10.0  # a process this much older than the CLI's import was a shell that exec'd us late


def _process_seconds() -> float | None:
    """Wall seconds since this process started (Linux: /proc), or None. A shell runs the last command
    of `a && b` in its own process (exec): that process started with `a`, so when it is more than
    _EXEC_GAP_S older than this module's import, the seconds since the import are returned instead."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    since_import = _time.perf_counter() - _IMPORTED_AT
    return since_import if age - since_import > _EXEC_GAP_S else age


def _summary(runs_dir: Path, runs: list[str], table=None):
    """run_summary over exactly the demo's runs (never older runs that share the directory); ``table``:
    the report's run table of the same runs, when the demo wrote one (no second connection)."""
    if table is not None:
        df = table
    else:
        from entropylens.query import connect, run_analysis

        df = run_analysis(connect(runs_dir, runs=runs), "run_summary")
    return df[["run", "method", "steps", "final_entropy", "min_entropy", "final_reward", "clip_low_frac",
               "clip_high_frac", "erc_drop_frac"]]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`entropylens demo | head`): stop quietly, exit 1
        _quiet_exit(1)  # (inside a command click does the same: its main exits 1 on EPIPE, silenced)
    except SystemExit as e:
        _exit(e)


def _quiet_exit(code: int) -> None:
    """Exit without another word: stdout and stderr (maybe the closed pipe) now point to /dev/null, so
    neither an error line nor the interpreter's final flush can raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    _exit(SystemExit(code))


def _exit(e: SystemExit) -> None:
    """Leave at once where a command loaded torch (the demo): the interpreter's teardown of torch's and
    transformers' modules takes ~1.5 s of CPU (5 s wall under load) and saves nothing (our files are
    closed, the worker pool shut down). atexit handlers and non-daemon threads still finish first."""
    if "torch" not in sys.modules or not (e.code is None or isinstance(e.code, int)):
        raise e
    import atexit
    import os
    import threading

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`)
            pass
    os._exit(e.code or 0)


if __name__ == "__main__":
    main()
