"""Every CLI command's output and exit code on the hand-built fixture runs, and every error case."""

import inspect
import json

import pandas as pd
import pytest
from cli_calls import err, ok, runner
from entropylens.cli.main import app
from fixture_runs import build


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("cli"))


def test_help_everywhere():
    out = ok("--help")
    for cmd in ("schema", "runs", "query", "analyses", "analyze", "report", "demo"):
        assert cmd in out
        assert "Usage" in ok(cmd, "--help")


def test_help_paragraphs_are_wrapped_by_the_terminal_only():
    """On a terminal wide enough for it, each paragraph of a command's help is one line: no line
    break from the docstring's source wrapping (`check --help` printed ragged lines)."""
    for cmd in app.registered_commands:
        name = cmd.name or cmd.callback.__name__
        res = runner.invoke(app, [name, "--help"], env={"COLUMNS": "4000"})
        assert res.exit_code == 0, res.output
        head = res.stdout.split("Usage:")[1].split("\u256d")[0]  # the prose, before the first panel
        lines = [x.strip() for x in head.splitlines()[1:] if x.strip()]
        paragraphs = [p for p in inspect.getdoc(cmd.callback).split("\n\n") if p.strip()]
        assert len(lines) == len(paragraphs), (name, lines)


def test_runs(runs):
    out = ok("runs", runs)
    lines = out.strip().splitlines()
    assert lines[0].split() == ["run", "method", "steps", "tokens", "final_entropy", "final_reward", "status"]
    assert lines[1].split()[:3] == ["a", "grpo", "2"] and "finished" in lines[1]
    assert lines[2].split()[:3] == ["b", "ce_gppo", "1"]
    assert ok("runs", runs / "a").strip().splitlines()[1].split()[0] == "a"  # a run directory itself


def test_query_formats(runs, tmp_path):
    sql = "SELECT run, count(*) AS n FROM tokens GROUP BY run ORDER BY run"
    assert ok("query", runs, sql).split() == ["run", "n", "a", "12", "b", "4"]
    assert ok("query", runs, sql, "--format", "csv") == "run,n\na,12\nb,4\n"
    assert json.loads(ok("query", runs, sql, "--format", "json")) == [{"run": "a", "n": 12}, {"run": "b", "n": 4}]
    out = tmp_path / "q.parquet"
    assert "wrote 2 rows" in ok("query", runs, sql, "--format", "parquet", "--output", out)
    assert pd.read_parquet(out)["n"].tolist() == [12, 4]
    assert ok("query", runs, sql, "--run", "b").split() == ["run", "n", "b", "4"]
    # without --format the extension of --output decides (q.csv holds CSV, not a text table)
    ok("query", runs, sql, "--output", tmp_path / "q.csv")
    assert (tmp_path / "q.csv").read_text() == "run,n\na,12\nb,4\n"
    ok("analyze", runs, "kl_by_step", "-o", tmp_path / "k.PQ")
    assert pd.read_parquet(tmp_path / "k.PQ").columns.tolist() == ["run", "method", "step", "kl"]
    ok("query", runs, sql, "-o", tmp_path / "q.json")
    assert json.loads((tmp_path / "q.json").read_text()) == [{"run": "a", "n": 12}, {"run": "b", "n": 4}]
    # json keeps every digit csv keeps (pandas' to_json rounded to 10 decimals: 1e-12 became 0.0); NaN and
    # inf null, timestamps ISO 8601, float32 as float32 prints, lists as arrays
    got = json.loads(
        ok(
            "query",
            runs,
            "SELECT 1e-12::DOUBLE AS z, 1.0::DOUBLE / 3 AS x, 7.9756603e-07::FLOAT AS f, "
            "'nan'::DOUBLE AS n, 'inf'::DOUBLE AS i, NULL::INT AS m, [1, 2] AS l, "
            "TIMESTAMP '2026-01-01 03:04:05' AS t",
            "--format",
            "json",
        )
    )
    assert got == [
        {
            "z": 1e-12,
            "x": 1 / 3,
            "f": 7.9756603e-07,
            "n": None,
            "i": None,
            "m": None,
            "l": [1, 2],
            "t": "2026-01-01T03:04:05",
        }
    ]
    ok("query", runs, sql, "-o", tmp_path / "q.txt")
    assert (tmp_path / "q.txt").read_text().split() == ["run", "n", "a", "12", "b", "4"]


def test_analyses_and_analyze(runs):
    out = ok("analyses")
    assert "drift_by_prob_bin" in out and "[bins=10]" in out
    res = ok("analyze", runs, "kl_by_step", "--run", "a", "--format", "csv")
    assert res.splitlines()[0] == "run,method,step,kl"
    run_, method, step, kl = res.splitlines()[1].split(",")
    assert (run_, method, step) == ("a", "grpo", "0")
    assert float(kl) == pytest.approx(0.025)  # (10 * 0.01 + 30 * 0.03) / 40 (float32 storage)
    res = ok("analyze", runs, "entropy_ratio_by_step", "-p", "band_low=0.6", "-p", "band_high=1.6", "-f", "json")
    assert all(r["outside_band"] == 0 for r in json.loads(res))


def test_report_command(runs, tmp_path):
    out = ok("report", runs, "--out", tmp_path / "rep")
    assert "index.html" in out
    assert (tmp_path / "rep" / "index.html").exists() and (tmp_path / "rep" / "report.md").exists()
    from entropylens.report.build import FIGURES

    assert len(list((tmp_path / "rep").glob("*.png"))) == len([f for f in FIGURES if not f.optional])  # no probes


def test_errors_are_one_line_exit_2(runs, tmp_path):
    assert "path does not exist" in err("runs", tmp_path / "missing")
    assert "no entropylens run" in err("runs", tmp_path)
    assert "no entropylens run" in err("query", tmp_path, "SELECT 1")
    assert "SQL error" in err("query", runs, "SELEC nonsense")
    assert "SQL error" in err("query", runs, "SELECT missing_column FROM tokens")
    for empty in ("", "   ", ";", "/* nothing */"):  # no statement: one line, not a traceback
        assert "SQL error" in err("query", runs, empty)
    assert "unknown analysis 'nope'" in err("analyze", runs, "nope")
    assert "not a number" in err("analyze", runs, "drift_by_prob_bin", "--param", "bins=ten")
    assert "has no parameter" in err("analyze", runs, "drift_by_prob_bin", "--param", "width=3")
    assert "bad parameter" in err("analyze", runs, "drift_by_prob_bin", "--param", "bins")
    assert "unknown run" in err("query", runs, "SELECT 1", "--run", "zz")
    assert "needs --output" in err("query", runs, "SELECT 1", "--format", "parquet")
    assert (
        "--format csv but --output x.json says json: drop --format (the extension decides) or name the file x.csv"
    ) in err("query", runs, "SELECT 1", "--format", "csv", "--output", tmp_path / "x.json")
    assert "or name the file x.txt" in err("query", runs, "SELECT 1", "-f", "table", "-o", tmp_path / "x.parquet")
    assert not (tmp_path / "x.json").exists()
    # --output to a missing directory or to a directory: one line, not a FileNotFoundError traceback
    for fmt in ("csv", "parquet"):
        assert "does not exist" in err("query", runs, "SELECT 1", "--format", fmt, "--output", tmp_path / "no" / "x")
    assert "is a directory" in err("query", runs, "SELECT 1", "--output", tmp_path)
    assert "does not exist" in err("analyze", runs, "run_summary", "--output", tmp_path / "no" / "x.csv")
    assert "no entropylens run" in err("report", tmp_path)
    assert "--methods: unknown method 'nope'" in err("demo", "--methods", "nope", "--out", tmp_path / "d")


def test_usage_errors_are_one_line_exit_2(runs):
    """A usage error (a bad --format choice, an unknown option, command or missing argument) is one line,
    exit 2, not Typer's boxed multi-line usage error."""
    line = err("query", runs, "SELECT 1", "--format", "bogus")
    assert "--format" in line and "'bogus'" in line and "table" in line and "entropylens query --help" in line
    assert "--format" in err("analyze", runs, "run_summary", "-f", "xml")
    assert "No such option: --nope" in err("runs", runs, "--nope")
    assert "Missing argument 'PATH'" in err("runs")
    assert "No such command 'nope'" in err("nope")
    assert "Usage" in runner.invoke(app, []).output  # no arguments: still the help


def test_empty_opt_in_analysis_says_how_to_enable_it(runs):
    """`analyze PATH probe_vs_measured` on runs without probes prints `(no rows)` and one line on how to
    enable the opt-in analysis; an analysis with rows prints no note."""
    res = runner.invoke(app, ["analyze", str(runs), "probe_vs_measured"])
    assert res.exit_code == 0 and "(no rows)" in res.stdout
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "opt-in" in lines[0] and "--probe-every K" in lines[0] and "Recorder.probe" in lines[0]
    res = runner.invoke(app, ["analyze", str(runs), "run_summary"])
    assert res.exit_code == 0 and res.stderr.strip() == ""  # no note where there are rows


def test_help_shows_plain_metavars():
    """Help shows `--quick`, `PATH`, `--run RUN`; never `<bool>`, `{path}`, `<list[str]>`."""
    for cmd in ("demo", "query", "analyze", "report", "runs", "schema"):
        text = ok(cmd, "--help")
        for bad in ("<bool>", "{", "<list[str]>", "<str>", "<path>", "<int>"):
            assert bad not in text, (cmd, bad, text)
    assert "PATH SQL" in ok("query", "--help")
    assert "RUN " in ok("query", "--help") and "repeatable" in ok("query", "--help")
    demo = ok("demo", "--help")
    assert "--quick " in demo and "--workers" in demo and "--overwrite" in demo


def test_bad_parameter_values_are_refused(runs):
    """Out-of-range parameters (bins=0, tau=1.5, band_low above band_high, points=0) are refused with the
    parameter's name, not answered with rows like `bin -1 prob_lo -inf`; the edge values pass."""
    assert "bins" in err("analyze", runs, "drift_by_prob_bin", "--param", "bins=0")
    assert "bins" in err("analyze", runs, "clipped_prob_distribution", "--param", "bins=-3")
    assert "whole number" in err("analyze", runs, "drift_by_prob_bin", "--param", "bins=2.5")
    from entropylens.read.params import ParamError, check

    with pytest.raises(ParamError, match=r"tau \(probability threshold\) must be in \[0, 1\], got 1.5"):
        check({"tau": 1.5})  # any analysis that takes a probability
    assert "must be below band_high" in err("analyze", runs, "entropy_ratio_by_step", "-p", "band_low=1.1")
    assert "points" in err("analyze", runs, "ratio_vs_prob", "--param", "points=0")
    ok("analyze", runs, "clipped_prob_distribution", "--param", "bins=1")  # the edge passes
    check({"tau": 0, "bins": 1, "band_low": 0.5, "band_high": 2})


def test_table_prints_integers_as_integers_and_folds_wide_text(runs):
    """A sum of counts prints as 1966080, not 1.96608e+06; a config JSON is folded in tables."""
    n = int(ok("query", runs, "SELECT sum(n_tokens) AS n FROM steps", "--format", "csv").split()[1])
    out = ok("query", runs, "SELECT sum(n_tokens) * 49152 AS big, 0.25 AS f FROM steps")  # HUGEINT -> float64
    assert out.split() == ["big", "f", str(n * 49152), "0.25"]
    sql = "SELECT run, config || repeat(' ', 200) || '}' AS config FROM runs ORDER BY run"  # a 200+ wide JSON cell
    wide = ok("query", runs, sql)
    assert max(len(line) for line in wide.splitlines()) < 100
    assert "(config folded to 60 characters; --format json prints them whole)" in wide
    full = json.loads(ok("query", runs, sql, "--format", "json"))
    assert all(len(r["config"]) > 200 for r in full)  # json keeps it whole


def test_query_is_read_only(runs, tmp_path):
    """`query` does not run COPY / CREATE / INSERT / ATTACH / INSTALL, which write files. Only one
    read-only statement runs; the others are refused (one line, exit 2) before anything is written."""
    target = tmp_path / "out.csv"
    for sql, word in (
        (f"COPY (SELECT 1) TO '{target}'", "COPY"),
        ("CREATE TABLE t AS SELECT 1", "CREATE"),
        ("INSERT INTO steps SELECT * FROM steps", "INSERT"),
        (f"ATTACH '{tmp_path / 'x.db'}' AS x", "ATTACH"),
        ("INSTALL httpfs", "INSTALL"),
        ("SET threads = 1", "SET"),
        (f"EXPORT DATABASE '{tmp_path / 'exp'}'", "EXPORT"),
        ("DROP VIEW tokens", "DROP"),
        ("PRAGMA enable_profiling", "PRAGMA enable_profiling"),
    ):
        line = err("query", runs, sql)
        assert word in line and "read-only" in line, line
    assert "2 statements" in err("query", runs, f"SELECT 1; COPY (SELECT 1) TO '{target}'")
    assert not target.exists() and not (tmp_path / "x.db").exists() and not (tmp_path / "exp").exists()
    # reading statements still run
    assert ok("query", runs, "WITH t AS (SELECT run FROM runs) SELECT count(*) AS n FROM t").split() == ["n", "2"]
    assert "column_name" in ok("query", runs, "DESCRIBE steps")
    assert "tokens" in ok("query", runs, "SHOW TABLES")
    assert "column_name" in ok("query", runs, "SUMMARIZE SELECT step FROM steps")
    assert "physical_plan" in ok("query", runs, "EXPLAIN SELECT count(*) FROM tokens")
    assert "name" in ok("query", runs, "PRAGMA table_info('runs')")
    assert ok("query", runs, "FROM runs SELECT run ORDER BY run").split() == ["run", "a", "b"]
    help_text = ok("query", "--help")
    assert "read-only" in help_text and "COPY" in help_text


def test_query_sql_may_start_with_a_comment_or_come_from_stdin(runs, tmp_path):
    """SQL starting with `--` (an SQL comment) is SQL, not an unknown option; SQL may also come from stdin."""
    sql = "-- tokens per run\nSELECT run, count(*) AS n FROM tokens GROUP BY run ORDER BY run"
    want = ["run", "n", "a", "12", "b", "4"]
    assert ok("query", runs, sql).split() == want
    assert ok("query", runs, sql, "--run", "b").split() == ["run", "n", "b", "4"]  # options after it still work
    assert ok("query", "--format", "csv", runs, sql) == "run,n\na,12\nb,4\n"
    assert ok("query", runs, "--", sql).split() == want  # the usual `--` separator works too
    res = runner.invoke(app, ["query", str(runs), "-"], input=sql)  # `-`: the SQL from stdin
    assert res.exit_code == 0 and res.stdout.split() == want, res.output
    assert "No such option: --nope" in err("query", runs, "SELECT 1", "--nope")  # a real unknown option


def test_runs_shows_long_run_ids_whole(runs, tmp_path):
    """`runs` shows long run ids whole (not cut with '...'), so a run id can be copied."""
    import shutil

    name = "grpo-lr7e-4-eps0.2-0.28-beta1-0.5-a-very-long-sweep-name-so-it-can-be-copied-s0"
    assert len(name) > 60
    shutil.copytree(runs / "a", tmp_path / "sweep" / name)
    out = ok("runs", tmp_path / "sweep")
    assert name in out.split() and "..." not in out
    assert name in ok("query", tmp_path / "sweep", "SELECT run, config FROM runs").split()  # config folded, run whole


def test_demo_start_time_counts_from_the_cli_import_when_a_shell_execd_it_late(monkeypatch):
    # `pip install ... && entropylens demo`: bash execs the last command in its own process, which
    # started with pip; the demo's "start" then counts from the CLI's import, not from pip's start
    import time

    from entropylens.cli import process

    age = process.process_seconds()  # this pytest process: started long before the CLI module's import
    monkeypatch.setattr(process, "_IMPORTED_AT", time.perf_counter() - 0.5)
    monkeypatch.setattr(process, "_EXEC_GAP_S", 1e9)
    assert process.process_seconds() >= age  # the process's own age
    monkeypatch.setattr(process, "_EXEC_GAP_S", 0.0)
    assert 0.5 <= process.process_seconds() < 5.0  # since the import


def test_out_that_is_a_file_or_cannot_be_made_is_one_line(runs, tmp_path):
    """`report --out FILE` and `demo --out FILE` are one-line errors, not tracebacks, and write nothing."""
    afile = tmp_path / "notes.md"
    afile.write_text("x")
    assert err("report", runs, "--out", afile) == f"error: --out {afile} is a file; give a directory"
    assert err("demo", "--out", afile, "--quick") == f"error: --out {afile} is a file; give a directory"
    assert "is a file, not a directory" in err("report", runs, "--out", afile / "sub")
    assert afile.read_text() == "x"  # nothing written


def test_demo_refuses_existing_runs_before_starting(tmp_path):
    """A second `entropylens demo` into the same --out is refused at once, naming the runs."""
    (tmp_path / "runs" / "grpo-s0").mkdir(parents=True)
    line = err("demo", "--out", tmp_path, "--methods", "grpo,dapo")
    assert line == (
        f"error: {tmp_path / 'runs'} already holds run(s) grpo-s0; use --overwrite to replace them "
        "or --out for a new directory"
    )


def test_compact_checks_the_path_before_its_banner(tmp_path):
    res = runner.invoke(app, ["compact", str(tmp_path)])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: no entropylens run under {tmp_path} (no run.json found)"
    ]


def test_submodules_reachable_from_the_package():
    """README: `entropylens.write_report(path, out_dir)` after a plain `import entropylens`; each stage's
    subpackage is an attribute of the package."""
    import subprocess
    import sys

    code = (
        "import entropylens; print(entropylens.write_report.__name__, entropylens.connect.__name__, "
        "*(getattr(entropylens, p).__name__ for p in ('rl', 'record', 'read', 'report', 'demo', 'integrations')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [
        "write_report",
        "connect",
        *(f"entropylens.{p}" for p in ("rl", "record", "read", "report", "demo", "integrations")),
    ]


def test_table_format_prints_missing_values_as_null():
    # NULL in a table, not NaN (float) or <NA> (integer); csv leaves them empty, json null
    import numpy as np
    import pandas as pd
    from entropylens.cli.output import table_text

    df = pd.DataFrame(
        {
            "grad_norm": [0.5, np.nan],
            "n_tokens": pd.array([43, None], dtype="Int64"),
            "run": ["r", None],
            "step": [0, 1],
        }
    )
    assert [line.split() for line in table_text(df).splitlines()] == [
        ["grad_norm", "n_tokens", "run", "step"],
        ["0.5", "43", "r", "0"],
        ["NULL", "NULL", "NULL", "1"],
    ]


def test_output_extension_decides_or_is_refused(runs, tmp_path):
    """`--output x.xlsx` writes no text table into an .xlsx file: an extension entropylens does not write
    is one line, exit 2, before the query runs and without a file; .txt and no extension are text names."""
    sql = "SELECT run, count(*) AS n FROM tokens GROUP BY run ORDER BY run"
    line = err("query", runs, sql, "--output", tmp_path / "x.xlsx")
    assert line == (
        "error: --output x.xlsx: unknown extension .xlsx; entropylens writes .csv, .json, .parquet (.pq) "
        "or .txt (a text table): name the file x.csv, or leave the extension out and pick the format "
        "with --format"
    )
    assert "name the file x.json" in err("analyze", runs, "run_summary", "-f", "json", "-o", tmp_path / "x.XLSX")
    assert "unknown extension .gz" in err("query", runs, sql, "-f", "csv", "-o", tmp_path / "x.csv.gz")
    # refused before the data is touched: a path that is no run still gets the --output error
    assert "unknown extension .xlsx" in err("query", tmp_path / "missing", sql, "-o", tmp_path / "x.xlsx")
    assert not list(tmp_path.iterdir())
    # .txt: a table, or csv / json with --format; never parquet
    ok("query", runs, sql, "-o", tmp_path / "t.TXT")
    assert (tmp_path / "t.TXT").read_text().split() == ["run", "n", "a", "12", "b", "4"]
    ok("query", runs, sql, "-f", "csv", "-o", tmp_path / "c.txt")
    assert (tmp_path / "c.txt").read_text() == "run,n\na,12\nb,4\n"
    assert "or name the file p.parquet" in err("query", runs, sql, "-f", "parquet", "-o", tmp_path / "p.txt")
    # no extension: a table, or any --format (parquet included)
    ok("query", runs, sql, "-o", tmp_path / "plain")
    assert (tmp_path / "plain").read_text().split() == ["run", "n", "a", "12", "b", "4"]
    ok("query", runs, sql, "-f", "json", "-o", tmp_path / "j")
    assert json.loads((tmp_path / "j").read_text()) == [{"run": "a", "n": 12}, {"run": "b", "n": 4}]
    ok("analyze", runs, "kl_by_step", "-f", "parquet", "-o", tmp_path / "pq")
    assert pd.read_parquet(tmp_path / "pq").columns.tolist() == ["run", "method", "step", "kl"]
    for cmd in ("query", "analyze"):  # and --help says so
        words = " ".join(w for w in ok(cmd, "--help").split() if w not in "│╭╮╰╯─")
        assert "Its extension names the format: .csv .json .parquet .pq .txt or none; any other is refused." in words
