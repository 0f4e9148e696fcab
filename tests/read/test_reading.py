"""The reading layer: bad files skipped with one warning, `verify`, the step
commit rule in the views, stale heartbeats. Runs are written with entropylens.record.writing.parquet in the
recorder's layout (tests/helpers/layout_run.py)."""

import json
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from layout_run import make_run, write_run_json, write_step  # noqa: E402

from entropylens.read.query import UnreadableFileWarning, connect, run_analysis  # noqa: E402

runner = CliRunner()


def _break_files(run_dir: Path) -> list[Path]:
    """A truncated token file, an empty one, and a text file with a .parquet name."""
    tok = run_dir / "tokens"
    truncated = tok / "step=1" / "rank=0" / "update-0.parquet"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    empty = tok / "step=2" / "rank=0" / "update-1.parquet"
    empty.write_bytes(b"")
    text = run_dir / "steps" / "step=0" / "rank=0" / "notes.parquet"
    text.write_text("this is not parquet\n" * 3)
    return [truncated, empty, text]


@pytest.fixture()
def broken(tmp_path):
    a = Path(make_run(tmp_path, "a", steps=3, rows=64).path)
    make_run(tmp_path, "b", steps=2, rows=32)
    return tmp_path, _break_files(a)


def test_bad_files_are_skipped_with_one_warning_each(broken):
    root, bad = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        con = connect(root)
    msgs = [str(w.message) for w in caught if issubclass(w.category, UnreadableFileWarning)]
    assert len(msgs) == 3
    for f in bad:
        assert sum(str(f) in m for m in msgs) == 1
    # every query over the rest works: run a's step 1 lost its only token file, b is whole
    assert con.execute("SELECT run, count(*) FROM tokens GROUP BY run ORDER BY run").fetchall() == [
        ("a", 2 * 64),
        ("b", 2 * 32),
    ]
    assert con.execute("SELECT count(*) FROM steps").fetchall() == [(5,)]
    assert len(run_analysis(con, "run_summary")) == 2


def test_cli_runs_query_analyze_survive_bad_files(broken):
    root, bad = broken
    for args in (
        ["runs", str(root)],
        ["query", str(root), "SELECT count(*) AS n FROM steps"],
        ["analyze", str(root), "clip_by_quadrant"],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
        warn_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
        assert len(warn_lines) == 3 and len(res.stderr.splitlines()) == 3, res.stderr
        assert "Traceback" not in res.output


def test_unreadable_run_json_skips_only_that_run(tmp_path):
    make_run(tmp_path, "good", steps=2)
    make_run(tmp_path, "bad", steps=2)
    (tmp_path / "bad" / "run.json").write_text('{"run": "bad", "status": ')  # cut mid-write by a user copy
    res = runner.invoke(app, ["runs", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "good" in res.stdout and "bad" not in res.stdout.replace("bad/run.json", "")
    assert res.stderr.count("warning:") == 1 and "bad/run.json" in res.stderr


def test_verify_lists_every_bad_file_and_exits_1(broken):
    root, bad = broken
    (root / "b" / "run.json").write_text("not json")
    res = runner.invoke(app, ["verify", str(root)])
    assert res.exit_code == 1, res.output
    for f in [*bad, root / "b" / "run.json"]:
        assert sum(ln.startswith(f"bad: {f}:") for ln in res.stdout.splitlines()) == 1, res.stdout
    assert "4 bad file(s)" in res.stdout


def test_verify_clean_exits_0_and_finds_corrupt_pages(tmp_path):
    d = Path(make_run(tmp_path, "a", steps=2).path)
    res = runner.invoke(app, ["verify", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "0 bad file(s)" in res.stdout
    # a flipped byte inside the data pages keeps the footer and magic intact: only a full read sees it
    f = d / "tokens" / "step=0" / "rank=0" / "update-0.parquet"
    data = bytearray(f.read_bytes())
    for i in range(8, 400):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    res = runner.invoke(app, ["verify", str(tmp_path)])
    assert res.exit_code == 1 and f"bad: {f}:" in res.stdout, res.output


def test_token_rows_show_only_once_their_step_is_committed(tmp_path):
    """A kill between a step's token file and its steps file leaves tokens without a steps row:
    the views hide them, so counts from `steps` and from `tokens` agree."""
    d = make_run(tmp_path, "r", steps=2, rows=64, status="running")
    write_step(d, 2, 0, 64, commit=False)  # the process died here
    con = connect(tmp_path)
    n_steps_tokens = con.execute("SELECT sum(n_tokens) FROM steps").fetchall()[0][0]
    n_rows = con.execute("SELECT count(*) FROM tokens").fetchall()[0][0]
    assert n_steps_tokens == n_rows == 128
    assert con.execute("SELECT max(step) FROM tokens").fetchall() == [(1,)]
    assert con.execute("SELECT max(step) FROM sequences").fetchall() == [(1,)]
    summary = run_analysis(con, "run_summary")
    assert int(summary["tokens"][0]) == 128
    # once the steps file lands the step appears whole
    from entropylens.record.writing.parquet import write_steps

    write_steps(d, 2, 0, [{"update": 0, "n_tokens": 64}])
    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchall() == [(192,)]


def test_commit_is_per_rank(tmp_path):
    d = make_run(tmp_path, "r", steps=1, rows=16, ranks=2)
    write_step(d, 1, 0, 16)
    write_step(d, 1, 1, 16, commit=False)
    con = connect(tmp_path)
    got = con.execute("SELECT step, rank, count(*) FROM tokens GROUP BY ALL ORDER BY ALL").fetchall()
    assert got == [(0, 0, 16), (0, 1, 16), (1, 0, 16)]


def test_stale_heartbeat_shows_as_stale(tmp_path):
    make_run(tmp_path, "dead", steps=1, status="running", heartbeat_age_s=600)  # 60 intervals of 10 s
    make_run(tmp_path, "alive", steps=1, status="running", heartbeat_age_s=0)
    make_run(tmp_path, "done", steps=1, status="finished", heartbeat_age_s=600)
    con = connect(tmp_path)
    got = dict(con.execute("SELECT run, status FROM runs").fetchall())
    assert got == {"dead": "stale", "alive": "running", "done": "finished"}
    res = runner.invoke(app, ["runs", str(tmp_path)])
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("dead"))
    assert line.split()[-1] == "stale"


def test_stale_threshold_follows_the_run_heartbeat_interval(tmp_path):
    d = make_run(tmp_path, "r", steps=1, status="running")
    write_run_json(d, "r", "running", heartbeat_age_s=20, heartbeat_s=10.0)  # 2 intervals: alive
    assert connect(tmp_path).execute("SELECT status FROM runs").fetchall() == [("running",)]
    write_run_json(d, "r", "running", heartbeat_age_s=20, heartbeat_s=5.0)  # 4 intervals: stale
    assert connect(tmp_path).execute("SELECT status FROM runs").fetchall() == [("stale",)]
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "running"  # reading never rewrites the run's files


def test_live_recorder_keeps_its_heartbeat_during_a_long_step(tmp_path):
    """The writer thread beats while the training thread is busy: a slow step never looks stale."""
    import time

    from entropylens import Recorder

    with Recorder(tmp_path, run="r", heartbeat_s=1.0) as rec:
        rec.record_step(0, grad_norm=1.0)
        time.sleep(5.0)  # one long step: 5 intervals without a recorder call (stale after 3 + 1 s)
        assert connect(tmp_path).execute("SELECT status FROM runs").fetchall() == [("running",)]
        info = json.loads((tmp_path / "r" / "run.json").read_text())
        assert info["heartbeat_s"] == 1.0
    assert connect(tmp_path).execute("SELECT status FROM runs").fetchall() == [("finished",)]


def test_steps_read_in_parts_equal_one_read(tmp_path, monkeypatch):
    """connect reads steps / probes files MATERIALIZE_FILES at a time (one read_parquet over 24k files
    held >13 GB): read 2 files at a time, the table is the one a single read gives, a later file's
    extra metric column included (NULL in the files without it), in the same column order."""
    import entropylens.read.query as q
    import entropylens.read.views as views
    from entropylens.record.writing.parquet import write_steps

    d = make_run(tmp_path, "r", steps=5, rows=16)
    write_steps(d, 5, 0, [{"update": 0, "n_tokens": 16, "my_metric": 2.5}])  # a column only this file has
    whole = q.connect(tmp_path).execute("SELECT * FROM steps ORDER BY step, rank, update").df()
    monkeypatch.setattr(views, "MATERIALIZE_FILES", 2)
    con = q.connect(tmp_path)
    parts = con.execute("SELECT * FROM steps ORDER BY step, rank, update").df()
    assert len(whole) == 6 and list(parts.columns) == list(whole.columns)
    assert parts.equals(whole)
    assert parts["my_metric"].notna().sum() == 1
    left = con.execute("SELECT table_name FROM duckdb_tables() WHERE table_name LIKE '\\_steps\\_part%' ESCAPE '\\'")
    assert left.fetchall() == []  # the part tables are dropped
