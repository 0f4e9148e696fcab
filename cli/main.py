"""entropylens command line. Each command parses, calls one library function, prints.

Errors a user can cause (a missing path, not a run, bad SQL, an unknown analysis, a bad parameter)
end with one line on stderr and exit code 2, never a traceback (cli/errors.py). Heavy imports (torch,
duckdb, matplotlib) happen inside the commands, so `entropylens --help` is fast. The shared options are
in cli/options.py, the output formats in cli/output.py, Typer's adjustments and the exit in cli/process.py.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import FileWarnings, fail, user_errors, writing
from .options import Band, Engine, EngineOpt, Format, FormatOpt, OutputOpt, PathArg, RunsOpt, TauOpt
from .output import check_out_dir, check_output, emit, schema_text
from .process import OneLineErrors, QueryCommand, process_seconds
from .process import run as _run

if TYPE_CHECKING:
    from entropylens.read.query import Connection

app = typer.Typer(
    cls=OneLineErrors,
    name="entropylens",
    help="Per-token training dynamics of GRPO-family RL: record, query, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Per-token training dynamics of GRPO-family RL: record, query, report."""
    FileWarnings._seen.clear()  # each skipped file is named once per command


def _connect(
    path: str,
    runs: list[str] | None = None,
    *,
    engine: Engine = Engine.duckdb,
    memory: str | None = None,
    tau: float | None = None,
) -> Connection:
    """The command's one connection: the views over the runs under PATH (entropylens.read.query.connect, on
    DuckDB or Spark; quadrants split at ``tau``, else each run's own; ``memory``: DuckDB's memory limit). Its
    errors end the command as one line (user_errors); a --memory-limit DuckDB does not take is named as such."""
    from entropylens.read.query import SettingError, connect

    settings = None if memory is None else {"memory_limit": memory}
    with FileWarnings():
        try:
            return connect(path, engine=engine.value, runs=runs or None, settings=settings, tau=tau)
        except SettingError as e:
            if e.key != "memory_limit":
                raise
            fail(f"--memory-limit {memory!r}: not a size DuckDB takes (e.g. 4GB, 512MB, 50%): {e.detail}")


def _check_tau(tau: float | None) -> None:
    if tau is not None and not 0.0 < tau <= 1.0:
        fail(f"--tau {tau:g}: not in (0, 1] (a token is HP when its probability p >= tau)")


DEFAULT_TIMEOUT_S = 300.0  # the heaviest analysis over 100M uncompacted rows: ~90 s CPU (docs/performance.md)
DEFAULT_MEMORY = "50%"  # of this machine's RAM: room for a training job beside the query; DuckDB spills past it

TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", metavar="SECONDS", min=0, help="Stop the query after this many seconds (exit 2); 0: no limit."
    ),
]
MemoryOpt = Annotated[
    str,
    typer.Option(
        "--memory-limit",
        metavar="SIZE",
        help="DuckDB's memory limit for the query, e.g. 4GB, 512MB or 50% (of RAM); past it DuckDB spills to a "
        "private temporary folder, and a query that still needs more stops (exit 2).",
    ),
]


def _limited(fn, timeout: float, memory: str):
    """``fn()``; a stop by --timeout or --memory-limit is one line that names the limit and what to pass."""
    from entropylens.read.query import QueryLimitError

    try:
        return fn()
    except QueryLimitError as e:
        if e.limit == "timeout":
            fail(f"query stopped: --timeout {timeout:g} s reached; pass --timeout 0 for no limit")
        shown = memory if e.value == memory else f"{memory} ({e.value})"  # 50% (11.7 GiB)
        fail(f"query stopped: --memory-limit {shown} reached: {e.detail}; pass a larger --memory-limit, e.g. 80%")


@app.command()
def schema(
    table: Annotated[
        str | None, typer.Argument(metavar="TABLE", help="Only this table (runs, steps, sequences, tokens, probes).")
    ] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print Markdown tables (as in docs/schema.md).")] = False,
) -> None:
    """Print the column contract (name, dtype, meaning) of every table."""
    from entropylens.schema import TABLES, schema_markdown

    if table is not None and table not in TABLES:
        fail(f"unknown table {table!r}; tables: {', '.join(TABLES)}")
    typer.echo(schema_markdown(table) if markdown else schema_text(table), nl=False)


@app.command()
@user_errors
def runs(path: PathArg) -> None:
    """One line per run: method, steps, tokens, final entropy (old_entropy; entropy where only that was recorded), final reward, status.

    A run is a folder holding run.json: PATH itself, or a folder below it.

    Not searched, as they cannot hold a run: the folders of a run (nothing below a run), hidden folders (.git, .venv, .cache, ...), __pycache__, node_modules, site-packages, dist-packages, virtual environments (pyvenv.cfg), and folders that cannot be read (skipped silently). Symbolic links to folders are not followed. Warnings name files of runs only.
    """
    from entropylens.read.query import run_analysis

    con = _connect(path)
    df = run_analysis(con, "run_summary")
    emit(df[["run", "method", "steps", "tokens", "final_entropy", "final_reward", "status"]], Format.table, None)


@app.command(cls=QueryCommand)
@user_errors
def query(
    path: PathArg,
    sql: Annotated[
        str,
        typer.Argument(
            metavar="SQL",
            help="One read-only statement (SELECT, WITH, VALUES, FROM, DESCRIBE, SHOW, SUMMARIZE, PIVOT, "
            "EXPLAIN of one of those, a few reporting PRAGMAs) over "
            "the views runs, steps, sequences, tokens; `-` reads it from stdin.",
        ),
    ],
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    run: RunsOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    memory_limit: MemoryOpt = DEFAULT_MEMORY,
) -> None:
    """Run one read-only SQL statement (DuckDB) over the runs under PATH.

    Statements that write or change the session (COPY, CREATE, INSERT, ATTACH, INSTALL, SET, ...) are refused, and so is EXPLAIN [ANALYZE] around any of them.

    A query stops after --timeout seconds (default 300; 0: no limit) or when it needs more memory than --memory-limit (default 50% of RAM; DuckDB spills to disk before that), with one line naming the limit (exit 2).

    The connection is also locked down (DuckDB's enable_external_access off, configuration locked): a query can read only the files of the runs under PATH, not other files of yours (read_csv, read_parquet, read_text of other paths fail), cannot write any file, attach a database, install or load an extension, or reach the network. To join runs with your own files use the Python API: entropylens.read.query.connect(PATH, lock=False). Save a result with --output FILE.

    SQL may start with an SQL comment (`-- ...`); `-` reads the SQL from stdin: `entropylens query PATH - < q.sql`.
    """
    from entropylens.read.query import run_sql

    from .sql_guard import check_read_only

    check_output(fmt, output)  # a bad --output fails before the query runs
    if sql == "-":
        sql = sys.stdin.read()
    check_read_only(sql)  # NotReadOnly: a ValueError, one line
    con = _limited(lambda: _connect(path, run, memory=memory_limit), timeout, memory_limit)
    df = _limited(lambda: run_sql(con, sql, timeout=timeout), timeout, memory_limit)
    emit(df, fmt, output)


@app.command()
def analyses() -> None:
    """List the named analyses (one SQL file each) with their titles and parameters."""
    from entropylens.read.query import analysis_info

    for name, info in analysis_info().items():
        params = ", ".join(f"{k}={v}" for k, v in info["params"].items())
        typer.echo(f"{name:<28} {info.get('title', '')}" + (f"  [{params}]" if params else ""))


@app.command()
@user_errors
def analyze(
    path: PathArg,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Analysis name (see `entropylens analyses`).")],
    run: RunsOpt = None,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", metavar="K=V", help="An analysis parameter, e.g. bins=5 (repeatable)."),
    ] = None,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    engine: EngineOpt = Engine.duckdb,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    memory_limit: MemoryOpt = DEFAULT_MEMORY,
    tau: TauOpt = None,
) -> None:
    """Run a named analysis over the runs under PATH.

    --tau splits the quadrants at that probability threshold, recomputed from the token rows, in place of each run's recorded tau.

    On DuckDB the analysis stops after --timeout seconds (default 300; 0: no limit) or when it needs more memory than --memory-limit (default 50% of RAM; DuckDB spills to disk before that), with one line naming the limit (exit 2). With --engine spark both are Spark's own settings (docs/spark.md).
    """
    from entropylens.read.query import render_analysis, run_analysis

    params = {}
    for p in param or []:
        k, sep, v = p.partition("=")
        if not sep or not k:
            fail(f"bad parameter {p!r}: use --param name=value")
        params[k.strip()] = v.strip()
    check_output(fmt, output)  # a bad --output fails before the analysis runs
    render_analysis(name, **params)  # unknown analysis / bad parameter before touching the data
    _check_tau(tau)
    if engine == Engine.spark:
        if tau is not None:
            fail("--tau needs --engine duckdb (the quadrants are recomputed there)")
        con, timeout = _connect(path, run, engine=engine), 0.0
    else:
        con = _limited(lambda: _connect(path, run, memory=memory_limit, tau=tau), timeout, memory_limit)
    df = _limited(lambda: run_analysis(con, name, timeout=timeout, **params), timeout, memory_limit)
    emit(df, fmt, output)
    if df.empty:
        from entropylens.report.build import when_empty

        if when_empty(name):  # an opt-in analysis: say how to record what it needs
            typer.echo(f"note: no rows: {when_empty(name)}", err=True)


@app.command()
@user_errors
def report(
    path: PathArg,
    run: RunsOpt = None,
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Output directory.")] = Path("entropylens-report"),
    engine: EngineOpt = Engine.duckdb,
    group_by: Annotated[
        str | None,
        typer.Option(
            "--group-by",
            metavar="method|config|KEY",
            help="Draw runs that share this as one series: their mean with a band over the runs. 'method'; "
            "'config' (runs whose configs differ only in the seed); or a config key such as lr or seed. "
            "Default: one line, bar or panel per run.",
        ),
    ] = None,
    band: Annotated[
        Band,
        typer.Option(
            "--band",
            help="With --group-by: the band of a series, minmax (min to max over its runs) or sd (mean +- 1 sd).",
        ),
    ] = Band.minmax,
    responses: Annotated[
        int,
        typer.Option(
            "--responses",
            metavar="N",
            min=0,
            help="Responses per run on its token-viewer page (responses-RUN.html): from steps spread over the "
            "run, the highest and lowest reward, most clipped, largest entropy effect, most ERC-dropped, "
            "highest entropy. 0: no pages. Each page's data stays under 4 MB (fewer responses if needed).",
        ),
    ] = 40,
    tau: TauOpt = None,
    where: Annotated[
        str | None,
        typer.Option(
            "--where",
            metavar="SQL",
            help="Only responses with a token row where this condition holds: a SQL condition on the tokens "
            "columns and the response's reward and length, e.g. \"quadrant = 'PA&LP' AND clipped\".",
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            metavar="PATH",
            help="A tokenizer (a local folder, loaded offline) to show the tokens' text, in place of the one a run "
            "names (TRL and verl runs name theirs; without any, token ids are shown).",
        ),
    ] = None,
) -> None:
    """Write the paper-style report (index.html, report.md, PNG figures, one token-viewer page per run)
    for the runs under PATH.

    Thresholds (tau, eps, the ERC band, beta1 / beta2, dual-clip) are each run's own; --tau splits every run's quadrants at one tau instead, recomputed from the token rows.

    Verdicts against the papers only where the runs differ in the method alone; else captions name what differs."""
    from entropylens.report.build import open_report, write_report

    _check_tau(tau)
    if tau is not None and engine == Engine.spark:
        fail("--tau needs --engine duckdb (the quadrants are recomputed there)")
    with FileWarnings():  # the report's one connection; path errors first, as one line
        con = open_report(path, run or None, engine.value, tau)
    check_out_dir(out)
    with writing("--out", out, reading_too=True), FileWarnings():  # e.g. an --out under /proc: one line
        index = write_report(
            path,
            out,
            con=con,
            runs=run or None,
            engine=engine.value,
            group_by=group_by,
            band=band.value,
            responses=responses,
            where=where,
            tokenizer=tokenizer,
            tau=tau,
        )
    typer.echo(f"report: {index}")


@app.command()
@user_errors
def show(
    path: PathArg,
    run: Annotated[str | None, typer.Option("--run", help="The run (may be left out when PATH holds one run).")] = None,
    step: Annotated[
        int | None, typer.Option("--step", help="The step (default: the run's last step with token rows).")
    ] = None,
    seq: Annotated[
        int | None,
        typer.Option(
            "--seq", help="One response: print its tokens coloured by --color. Without it: list the step's responses."
        ),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank",
            help="The rank that recorded the response, where several ranks recorded that --seq; without "
            "--seq: list only this rank's responses.",
        ),
    ] = None,
    update: Annotated[
        int | None,
        typer.Option(
            "--update",
            help="With --seq: the update to show (default: the step's last update with rows for the response).",
        ),
    ] = None,
    color: Annotated[
        str | None,
        typer.Option(
            "--color",
            metavar="METRIC",
            help="With --seq: the metric that colours the tokens (default entropy): entropy, old_entropy, prob, ratio, "
            "entropy_ratio, quadrant, clip, erc, logit_grad_norm, grad_coef, entropy_effect, "
            "entropy_effect_dropped, sampler_log_ratio (the sampler-trainer mismatch).",
        ),
    ] = None,
    where: Annotated[
        str | None,
        typer.Option(
            "--where",
            metavar="SQL",
            help="Without --seq: list only the responses with a token row where this holds (the tokens view's "
            "columns, plus the response's reward and length), e.g. \"quadrant = 'PA&LP' AND clipped\".",
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            metavar="PATH",
            help="With --seq: a tokenizer (a local directory, or a Hugging Face name already in the local cache) "
            "for the tokens' text. Default: the one the run recorded; without any, token ids as ⟨id⟩.",
        ),
    ] = None,
    tau: TauOpt = None,
) -> None:
    """Read a step's responses in the terminal: a list of them, or one token by token, coloured.

    Without --seq: one line per response of the step (rank, seq, group, reward, advantage, length, tokens, updates, mean entropy, clipped, ERC-dropped, entropy effect).

    With --seq: the response's tokens at one update, each on a background colour from --color; the forking tokens (the top 20% by sampling entropy) bold and underlined; a legend; the response across its step's updates.

    Colour scales run over the response's own values: low to high (entropy, prob, ...), around 1 on a log scale (ratio, entropy_ratio), around 0 (grad_coef, entropy_effect), or one colour per category (quadrant, clip, erc); grey: no value. Colours only on a terminal (or with FORCE_COLOR set). docs/viewer.md."""
    import warnings

    from rich.console import Console

    from entropylens.report import show as view

    if seq is None:
        given = [
            name for name, v in (("--update", update), ("--color", color), ("--tokenizer", tokenizer)) if v is not None
        ]
        if given:
            fail(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to one response: add --seq "
                "SEQ (without it the step's responses are listed)"
            )
    elif where is not None:
        fail("--where chooses which responses are listed: leave it out with --seq")
    view.metric_for(color or "entropy")  # an unknown --color before touching the data
    _check_tau(tau)
    con = _connect(path, [run] if run else None, tau=tau)
    names = view.runs_of(con)
    if run is not None and run not in names and len(names) == 1:
        run = names[0]  # --run named the run's directory; the views call it by its id
    run = view.pick_run(con, run)
    if seq is None:
        out = view.list_step(con, run, step, where=where, rank=rank)
    else:
        from entropylens.read.run_decoder import decoder_for_run
        from entropylens.token_text import TokenTextWarning

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TokenTextWarning)
            decoder = decoder_for_run(path, run, tokenizer)
        for w in caught:
            if issubclass(w.category, TokenTextWarning):
                typer.echo(f"warning: {str(w.message).removeprefix('entropylens: ')}", err=True)
        out = view.show_response(
            con, run, step, seq, rank=rank, update=update, color=color or "entropy", decoder=decoder
        )
    wide = sys.stdout.isatty() or os.environ.get("COLUMNS")
    Console(highlight=False, width=None if wide else 120).print(out)


@app.command()
@user_errors
def check(
    path: PathArg,
    run: RunsOpt = None,
    collapse: Annotated[
        float, typer.Option("--collapse", help="collapse: entropy below this fraction of its initial value.")
    ] = 0.25,
    explosion: Annotated[
        float, typer.Option("--explosion", help="explosion: entropy above this multiple of its initial value.")
    ] = 2.0,
    budget_steps: Annotated[
        int,
        typer.Option("--budget-steps", help="negative_budget: entropy budget below 0 for this many steps in a row ..."),
    ] = 10,
    budget_entropy: Annotated[
        float,
        typer.Option(
            "--budget-entropy", help="negative_budget: ... while entropy is below this fraction of its initial value."
        ),
    ] = 0.5,
    clip_spike: Annotated[
        float,
        typer.Option("--clip-spike", help="clip_spike: clipped fraction above this multiple of its rolling median ..."),
    ] = 3.0,
    clip_floor: Annotated[
        float, typer.Option("--clip-floor", help="clip_spike: ... and at least this clipped fraction (its floor).")
    ] = 0.05,
    kl_spike: Annotated[
        float, typer.Option("--kl-spike", help="kl_spike: KL above this multiple of its rolling median.")
    ] = 5.0,
    grad_norm_spike: Annotated[
        float,
        typer.Option("--grad-norm-spike", help="grad_norm_spike: grad norm above this multiple of its rolling median."),
    ] = 3.0,
    erc_drop_min: Annotated[
        float,
        typer.Option(
            "--erc-drop-min",
            help="erc_drop_rate: ERC drop fraction below this while the step's entropy ratios "
            "(p05 / p95) leave the ERC band.",
        ),
    ] = 0.001,
    erc_drop_max: Annotated[
        float, typer.Option("--erc-drop-max", help="erc_drop_rate: ERC drop fraction above this.")
    ] = 0.5,
    no_signal_share: Annotated[
        float,
        typer.Option(
            "--no-signal-share",
            help="no_signal: a step is signal-free when at least this share of its tokens has "
            "advantage 0, or of its updates grad norm 0.",
        ),
    ] = 0.5,
    no_signal_steps: Annotated[
        int,
        typer.Option(
            "--no-signal-steps",
            help="no_signal: this many signal-free steps in a row, or at least this many making "
            "up --no-signal-share of the last --window steps.",
        ),
    ] = 3,
    mismatch: Annotated[
        float,
        typer.Option(
            "--mismatch",
            help="mismatch: sampler-trainer KL above this multiple of its median over the run's first "
            "--mismatch-warmup steps ...",
        ),
    ] = 10.0,
    mismatch_floor: Annotated[
        float, typer.Option("--mismatch-floor", help="mismatch: ... and above this KL (nats).")
    ] = 1e-3,
    mismatch_warmup: Annotated[
        int,
        typer.Option(
            "--mismatch-warmup",
            help="mismatch: the run's first steps with a sampler KL that set its start (no alarm during them).",
        ),
    ] = 5,
    window: Annotated[
        int,
        typer.Option(
            "--window",
            help="The previous steps in the spike rules' rolling median; the last steps in no_signal's share.",
        ),
    ] = 20,
    baseline: Annotated[
        int, typer.Option("--baseline", help="First steps whose mean entropy is the initial entropy.")
    ] = 3,
    tau: TauOpt = None,
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
    --kl-spike / --grad-norm-spike x its median over the previous --window steps (warm-up: none fires
    before 5 such steps exist; a median of 0 never fires); clip_spike also needs a clipped fraction of at
    least --clip-floor (0.05).

    collapse / explosion / negative_budget (warm-up): none fires before the --baseline steps that define
    H0 have passed.

    erc_drop_rate: ERC drop fraction above --erc-drop-max, or below --erc-drop-min while the step's entropy
    ratios leave its ERC band (dropping nothing inside the band is healthy).

    no_signal: a step is signal-free when at least --no-signal-share of its tokens have advantage 0, or of
    its updates grad norm 0; fires at --no-signal-steps such steps in a row, or when they are at least
    that many and at least --no-signal-share of the last --window steps.

    mismatch: KL(pi_sampler || pi_old) (k3, steps.sampler_kl_k3) above max(--mismatch x its median over the
    first --mismatch-warmup steps that have one, --mismatch-floor); a run without sampler log-probs never
    fires.

    Notes (printed as `note: ...` lines, never exit 1): what limits what a run's figures can show.

    thin_quadrant (a note, over the token rows): a quadrant holds < 1% of a run's tokens of nonzero advantage; signal: the run's token-probability quantiles, exp(-H) and a suggested --tau (the median p).

    on_policy (a note, over the token rows): every recorded ratio is exactly 1, so clipping, CE-GPPO and ERC cannot act; set num_iterations > 1 or steps_per_generation > gradient_accumulation_steps."""
    from entropylens.alarms import Thresholds
    from entropylens.report.checks import check as run_check

    t = Thresholds(
        collapse=collapse,
        explosion=explosion,
        budget_steps=budget_steps,
        budget_entropy=budget_entropy,
        clip_spike=clip_spike,
        clip_floor=clip_floor,
        kl_spike=kl_spike,
        grad_norm_spike=grad_norm_spike,
        erc_drop_min=erc_drop_min,
        erc_drop_max=erc_drop_max,
        no_signal_share=no_signal_share,
        no_signal_steps=no_signal_steps,
        window=window,
        baseline=baseline,
        mismatch=mismatch,
        mismatch_floor=mismatch_floor,
        mismatch_warmup=mismatch_warmup,
    )
    _check_tau(tau)
    con = _connect(path, run)  # the runs at their own tau; path errors first, as one line
    from entropylens.report.checks import notes

    with FileWarnings():
        findings = run_check(path, t, runs=run or None, con=con)
        # the notes at --tau need the views split there: a second connection only then
        noted = notes(path, runs=run or None, tau=tau, con=con if tau is None else None)
    for f in findings:
        typer.echo(f.line())
    for f in noted:
        typer.echo(f"note: {f.line()}")
    if findings:
        raise typer.Exit(code=1)
    typer.echo(f"no alarm in the runs under {path}")


@app.command()
@user_errors
def watch(
    path: PathArg,
    run: RunsOpt = None,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes (each re-reads the committed steps).")
    ] = 2.0,
) -> None:
    """A live terminal view of runs being written: per run the latest steps' entropy (sparkline and
    table), reward, clip fractions by side and quadrant, entropy-ratio quantiles and the share outside
    the ERC band, and the alarms of `entropylens check` (default thresholds). Reads the steps table
    only, reconnecting every --interval seconds; leaves when every run is finished or failed (a
    summary line) or on Ctrl-C (exit 0). docs/watch.md."""
    from entropylens.report.watch import snapshot, summary_line
    from entropylens.report.watch import watch as live

    if not (interval > 0 and interval < float("inf")):
        fail(f"--interval must be a number of seconds > 0, got {interval}")
    try:
        with FileWarnings():
            first = snapshot(path, run or None)  # a missing PATH, no run, an unknown --run: one line
    except KeyboardInterrupt:  # Ctrl-C before the first view: leave as from the view
        typer.echo("watch: stopped (Ctrl-C)")
        return
    snap, interrupted = live(path, runs=run or None, interval=interval, first=first)
    typer.echo(
        "watch: stopped (Ctrl-C); " + summary_line(snap).removeprefix("watch: ") if interrupted else summary_line(snap)
    )


@app.command()
@user_errors
def verify(path: PathArg) -> None:
    """Check every file under PATH: its pages, its columns against the schema contract, that the recorder named it, each step's token rows against its n_tokens, run.json's types, compacted originals left on disk. Lists what is wrong, file by file (exit 1), or says all is whole (exit 0). docs/storage.md says what to do about each."""
    from entropylens.read.catalog import verify as check
    from entropylens.report.escape import terminal

    res = check(path)
    for f, why in res.bad:
        typer.echo(terminal(f"bad: {f}: {why}"))
    for _, why in res.notes:
        typer.echo(terminal(f"note: {why}"))
    if res.hidden:
        typer.echo(f"note: {res.hidden} file(s) of uncommitted steps (no steps file; hidden by the views)")
    typer.echo(terminal(f"{len(res.bad)} bad file(s) among {res.files} in {res.runs} run(s) under {path}"))
    if res.bad:
        raise typer.Exit(code=1)


@app.command()
@user_errors
def compact(
    path: PathArg,
    run: RunsOpt = None,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            help="Seconds between committing the compacted files and removing the originals, "
            "so that queries already running finish.",
        ),
    ] = 10.0,
    file_mb: Annotated[
        int, typer.Option("--file-mb", metavar="MB", help="Target size of a compacted file (MB of originals).")
    ] = 512,
) -> None:
    """Rewrite each run's many small per-step files into few large ones (readers never see both).

    A compaction interrupted after its commit (killed during --grace) is finished: the originals it superseded are removed once --grace has passed since its commit. Hidden temporary files of processes no longer alive on this host are removed too (in compacted/, or in a run that is no longer running); a live process's are never touched.
    """
    from entropylens.read.compact import compact as run_compact
    from entropylens.read.query import find_runs
    from entropylens.report.escape import terminal

    find_runs(path, runs=run or None)  # path errors first, as one line (before the banner); a listing, no reading
    if grace > 0:  # say why it waits, so the waits do not look like a hang
        typer.echo(
            f"compacting: each run waits --grace {grace:g} s after its commit before removing the originals "
            "(queries already planned on them finish)",
            err=True,
        )
    with FileWarnings():
        results = run_compact(path, runs=run or None, grace_s=grace, file_bytes=file_mb << 20)
    for r in results:
        typer.echo(terminal(r.summary()))


@app.command()
@user_errors
def demo(
    out: Annotated[
        Path, typer.Option("--out", metavar="DIR", help="Output directory (runs/ and report/ inside).")
    ] = Path("entropylens-demo"),
    methods: Annotated[
        str, typer.Option("--methods", metavar="A,B,...", help="Comma-separated named runs.")
    ] = "grpo,dapo,ce_gppo,erc_dapo",
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            metavar="N",
            help="RL steps per run (default 32, about a minute on 2 cores; 120: the fast "
            "regime's full length, about 3 minutes).",
        ),
    ] = None,
    seeds: Annotated[int, typer.Option("--seeds", metavar="K", help="Seeds per method.")] = 1,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Tiny runs (seconds: 6 RL steps after a 40-step warm-up), for tests and a first look at the pages; the toy is still near uniform, so some quadrants stay empty: --steps 32 shows the dynamics.",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            metavar="N",
            help="Runs trained in parallel processes (1 torch thread each); default: one per core.",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace runs of the same name already under --out (refused otherwise).")
    ] = False,
    probe_every: Annotated[
        int,
        typer.Option(
            "--probe-every",
            metavar="K",
            min=0,
            help="Parameter-space entropy probe (probes table) on every K-th step; 0: off.",
        ),
    ] = 0,
    mismatch: Annotated[
        str,
        typer.Option(
            "--mismatch",
            metavar="bf16|temp:S",
            help="A sampler that differs from the trainer (logits rounded to bf16, or sampling at S x the "
            "temperature): each method runs twice, <method>-<sampler> and <method>-<sampler>-tis (TIS at "
            "--tis), so the report shows what the mismatch does to entropy and clipping.",
        ),
    ] = "",
    tis: Annotated[
        float | None,
        typer.Option(
            "--tis",
            metavar="C",
            help="With --mismatch: TIS's cap C on the weight pi_old / pi_sampler (default 2).",
            show_default=False,
        ),
    ] = None,
    list_methods: Annotated[
        bool,
        typer.Option(
            "--list-methods", help="List every method --methods accepts (options, what it does, paper) and exit."
        ),
    ] = False,
) -> None:
    """Train the built-in toy policy under each method, record every run, write the report.

    Default: grpo, dapo, ce_gppo and erc_dapo, 32 RL steps each: about a minute on 2 quiet cores.

    --methods takes any method of the toy lab's registry (entropylens/demo/toy/methods.py), e.g. gppo, cispo, gspo, erc_gppo, entropy_bonus_<coef>, ce_gppo_<beta1>_<beta2>; --list-methods lists them all.
    """
    import time

    if list_methods:
        from entropylens.demo.toy.methods import listing

        for m in listing():
            typer.echo(
                f"{m.name}: {m.description}. Options: {m.options}. Paper: {m.paper}."
                + (f" Toy: {m.toy}." if m.toy else "")
            )
        return
    names = tuple(m.strip() for m in methods.split(",") if m.strip())
    if not names:
        fail("--methods is empty")
    from entropylens.demo.toy.sampler import check_mismatch

    try:
        check_mismatch(mismatch)
    except ValueError as e:
        fail(f"--{e}")
    if tis is not None and not mismatch:
        fail("--tis needs --mismatch (it caps the IS weight of a mismatched sampler)")
    tis = 2.0 if tis is None else tis
    if not tis > 0:
        fail(f"--tis must be > 0, got {tis}")
    check_out_dir(out)
    if not overwrite:  # a second `entropylens demo` is refused before seconds of imports and a fork server
        from entropylens.demo.runner import mismatch_runs

        ids = [f"{r}-s{k}" for r, _, _ in mismatch_runs(names, mismatch, tis) for k in range(max(1, seeds))]
        taken = [i for i in ids if (out / "runs" / i).exists()]
        if taken:
            from entropylens.record.run_dir.run_claim import runs_exist_message

            fail(runs_exist_message(out / "runs", taken))
    from entropylens.demo.workers import start_fork_server

    start_fork_server(
        len(names) * (2 if mismatch else 1) * max(1, seeds), workers
    )  # its imports overlap ours (torch: seconds)
    from entropylens.demo.runner import run_demo
    from entropylens.demo.toy.config import config_for

    with writing("--out", out):  # the output directory (a full disk, a read-only or pseudo file system)
        for n in names:
            try:  # validate before training
                config_for(n) if steps is None else config_for(n, steps=steps)
            except ValueError as e:
                if str(e).startswith("unknown run "):  # the user typed a method name
                    raise ValueError(f"--methods: unknown method {str(e)[len('unknown run ') :]}") from None
                raise
        t_run = time.perf_counter()
        res = run_demo(
            out,
            methods=names,
            steps=steps,
            seeds=seeds,
            quick=quick,
            workers=workers,
            overwrite=overwrite,
            probe_every=probe_every,
            mismatch=mismatch,
            tis=tis,
        )
    t0 = time.perf_counter()
    emit(_summary(res.runs_dir, [r.run for r in res.runs], res.summary), Format.table, None)
    typer.echo(f"runs: {res.runs_dir}")
    # start: interpreter, imports, the fork server's launch (before run_demo); process: all of it so far
    phases = {k: v for k, v in res.phases.items() if k != "total"}
    phases["summary"] = time.perf_counter() - t0
    since = process_seconds()
    if since is not None:
        phases = {"start": since - (time.perf_counter() - t_run), **phases, "process": since}
    else:
        phases["total"] = res.phases["total"]
    typer.echo("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    if res.report_dir:
        typer.echo(f"report: {res.report_dir / 'index.html'}")


def _summary(runs_dir: Path, runs: list[str], table=None):
    """run_summary over exactly the demo's runs (never older runs that share the directory); ``table``:
    the report's run table of the same runs, when the demo wrote one (no second connection)."""
    if table is not None:
        df = table
    else:
        from entropylens.read.query import connect, run_analysis

        df = run_analysis(connect(runs_dir, runs=runs), "run_summary")
    return df[
        [
            "run",
            "method",
            "steps",
            "final_entropy",
            "min_entropy",
            "final_reward",
            "clip_low_frac",
            "clip_high_frac",
            "erc_drop_frac",
        ]
    ]


def _reflow_help(typer_app: typer.Typer) -> None:
    """Each command's help as its docstring with every paragraph on one line. Typer joins the wrapped
    lines of a help text's first paragraph only; the later ones printed with the source's line breaks
    inside the terminal's own wrapping (ragged lines in `check --help`)."""
    for cmd in typer_app.registered_commands:
        doc = cmd.help or inspect.getdoc(cmd.callback) or ""
        cmd.help = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


_reflow_help(app)


def main() -> None:
    """The console script `entropylens` (cli.process.run: Ctrl-C, a closed pipe, the exit)."""
    _run(app)


if __name__ == "__main__":
    main()
