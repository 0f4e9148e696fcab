"""Every file is checked against the schema contract before a view reads it: a run written by two versions
reads right, file by file; a file of the wrong types, a foreign table, a file the recorder did not name or a
stray folder never changes the other files' answers and is named; run.json values of the wrong type and
damaged pages are named, never a traceback."""

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from recorded_run import answers, record_run  # noqa: E402

from entropylens.read.query import QueryError, connect, run_analysis, run_sql  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return record_run(tmp_path_factory.mktemp("clean"))


@pytest.fixture()
def run(clean, tmp_path) -> Path:
    """A copy of the clean run to tamper with."""
    return Path(shutil.copytree(clean, tmp_path / "r"))


def _token_file(run: Path, step: int) -> Path:
    (f,) = (run / "tokens" / f"step={step}" / "rank=0").glob("*.parquet")
    return f


def _older(t: pa.Table, *drop: str) -> pa.Table:
    """``t`` as an older version wrote it: without ``drop``, schema version 2 in its metadata."""
    t = t.drop_columns(list(drop))
    return t.replace_schema_metadata({**(t.schema.metadata or {}), b"entropylens.schema_version": b"2"})


def _rewrite(f: Path, change) -> None:
    t = pq.read_table(f, partitioning=None)
    pq.write_table(change(t), f)


def test_a_run_written_by_two_versions_reads_right_file_by_file(clean, run):
    base, said = answers(clean)
    assert said == [] and len(base) == 3
    _rewrite(_token_file(run, 0), lambda t: _older(t, "entropy"))  # an older version
    _rewrite(_token_file(run, 2), lambda t: t.append_column("newer", pa.array([1.5] * t.num_rows)))  # a newer one
    got, said = answers(run)
    assert got[(1, 0)] == base[(1, 0)] and got[(2, 0)] == base[(2, 0)]  # untouched columns: the same answers
    n, n_entropy, entropy, *rest, n_rho = got[(0, 0)]
    assert (n, n_entropy, entropy, n_rho) == (base[(0, 0)][0], 0, None, 0)  # NULL for that file only
    assert rest == list(base[(0, 0)][3:-1])
    assert len(said) == 1 and "1 tokens file(s) written before column(s) `entropy` existed" in said[0], said
    assert str(_token_file(run, 0)) in said[0]
    with pytest.warns(UserWarning, match="written before column"):  # said again by every new connection
        con = connect(run)
    assert con.execute("SELECT step, count(newer) FROM tokens GROUP BY step ORDER BY step").fetchall() == [
        (0, 0),
        (1, 0),
        (2, base[(2, 0)][0]),
    ]
    assert len(run_analysis(con, "run_summary")) == 1


def test_the_last_file_lacking_a_column_loses_nothing_else(clean, run):
    base, _ = answers(clean)
    _rewrite(_token_file(run, 2), lambda t: _older(t, "entropy", "old_entropy"))
    got, said = answers(run)
    assert got[(0, 0)] == base[(0, 0)] and got[(1, 0)] == base[(1, 0)]
    assert got[(2, 0)][:3] == (base[(2, 0)][0], 0, None) and got[(2, 0)][3:-1] == base[(2, 0)][3:-1]
    assert len(said) == 1 and "column(s) `entropy`, `old_entropy`" in said[0], said


def test_a_file_of_the_wrong_type_is_left_out_and_named(clean, run):
    base, _ = answers(clean)
    f = _token_file(run, 1)
    _rewrite(f, lambda t: t.set_column(t.column_names.index("entropy"), "entropy", t["entropy"].cast(pa.float64())))
    got, said = answers(run)
    assert got == {k: v for k, v in base.items() if k != (1, 0)}
    assert len(said) == 1 and str(f) in said[0] and "`entropy` is float64, not float32" in said[0], said
    res = runner.invoke(app, ["verify", str(run.parent)])
    assert res.exit_code == 1 and f"bad: {f}: " in res.stdout and "float64" in res.stdout, res.output


def test_a_foreign_table_is_left_out_and_named(clean, run):
    base, _ = answers(clean)
    f = _token_file(run, 0)
    pq.write_table(pa.table({"a": [1, 2, 3], "entropy": pa.array([0.0] * 3, pa.float32())}), f)
    got, said = answers(run)
    assert got == {k: v for k, v in base.items() if k != (0, 0)}  # the other steps' columns stay whole
    assert len(said) == 1 and str(f) in said[0] and "not an entropylens tokens file" in said[0], said
    res = runner.invoke(app, ["report", str(run), "--out", str(run.parent / "report")])
    assert "Traceback" not in res.output and f"warning: skipped {f}" in res.stderr, res.output


def test_files_the_recorder_did_not_name_are_left_out(clean, run):
    base, _ = answers(clean)
    f = _token_file(run, 1)
    copy = f.with_name(f.stem + " (copy).parquet")
    shutil.copy(f, copy)
    export = run / "tokens" / "export.parquet"
    shutil.copy(f, export)
    got, said = answers(run)
    assert got == base  # nothing counted twice
    assert sorted(m.split(":")[0] for m in said) == sorted(f"skipped {p}" for p in (copy, export)), said
    res = runner.invoke(app, ["verify", str(run)])
    assert res.exit_code == 1 and f"bad: {copy}: not a file entropylens writes" in res.stdout, res.output


def test_token_rows_beyond_n_tokens_are_named(clean, run):
    base, _ = answers(clean)
    f = _token_file(run, 1)
    shutil.copy(f, f.with_name("updates-5-6.parquet"))  # a recorder's name: read, but the count says so
    got, said = answers(run)
    assert got[(1, 0)][0] == 2 * base[(1, 0)][0]
    assert (
        len(said) == 1 and f"step 1 rank 0: its token files ({f.parent}/) hold {2 * base[(1, 0)][0]} rows" in said[0]
    ), said
    res = runner.invoke(app, ["verify", str(run)])
    assert res.exit_code == 1 and "step 1 rank 0" in res.stdout, res.output
    f.with_name("updates-5-6.parquet").unlink()
    f.unlink()  # a lost file: fewer rows than n_tokens (right only in a sampled run): verify's to name
    got, said = answers(run)
    assert (1, 0) not in got and said == []
    res = runner.invoke(app, ["verify", str(run)])
    assert res.exit_code == 1 and f"step 1 rank 0: its token files ({f.parent}/) hold 0 rows" in res.stdout, res.output
    assert runner.invoke(app, ["verify", str(clean)]).exit_code == 0


def test_stray_folders_are_ignored_with_one_note(clean, run):
    base, _ = answers(clean)
    for name in ("select", "runs", "my table"):
        (run / name).mkdir()
        shutil.copy(_token_file(run, 0), run / name / "x.parquet")
    got, said = answers(run)
    assert got == base
    assert sorted(said) == sorted(
        f"run r: folder {run / n}/ holds Parquet files but is not a table entropylens writes: ignored"
        for n in ("select", "runs", "my table")
    )
    for args in (["runs", str(run)], ["query", str(run), "SELECT count(*) FROM tokens"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert runner.invoke(app, ["verify", str(run)]).exit_code == 0  # ignored, not bad


@pytest.mark.parametrize(
    "key, value, skipped",
    [("tau", "x", False), ("seed", [1], False), ("config", 3, False), ("world_size", "a", True), ("status", 1, True)],
)
def test_run_json_of_the_wrong_types_is_named_and_the_other_runs_read(clean, tmp_path, key, value, skipped):
    good = shutil.copytree(clean, tmp_path / "good")
    bad = Path(shutil.copytree(clean, tmp_path / "bad"))
    info = json.loads((bad / "run.json").read_text())
    info[key] = value
    (bad / "run.json").write_text(json.dumps(info))
    for args in (["runs", str(tmp_path)], ["query", str(tmp_path), "SELECT run, count(*) FROM tokens GROUP BY run"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Traceback" not in res.output, res.output
        assert res.stderr.count("warning:") == 1 and f"run.json's {key!r} is {json.dumps(value)}" in res.stderr
        assert ("skipped" in res.stderr) is skipped, res.stderr
        assert ("bad" in res.stdout) is not skipped and Path(good).name in res.stdout
    with pytest.warns(UserWarning, match=f"run.json's {key!r}"):  # the same warning, from the Python API
        con = connect(tmp_path)
    if not skipped:
        assert con.execute(f"SELECT {key} FROM runs WHERE run = 'bad'").fetchall() == [
            (None if key != "config" else "{}",)
        ]
    assert runner.invoke(app, ["verify", str(tmp_path)]).exit_code == 1


def _damage_middle(f: Path) -> None:
    b = bytearray(f.read_bytes())
    for i in range(len(b) // 3, len(b) // 3 + min(2000, len(b) // 3)):
        b[i] = (b[i] * 7 + 13) % 256
    f.write_bytes(bytes(b))


def test_a_damaged_page_names_its_file(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
    from layout_run import make_run

    make_run(tmp_path, "a", steps=3, rows=4096)
    f = tmp_path / "a" / "tokens" / "step=1" / "rank=0" / "update-0.parquet"
    _damage_middle(f)
    con = connect(tmp_path)
    with pytest.raises(QueryError) as e:
        run_sql(con, "SELECT * FROM tokens")
    assert f"reading {f} (unreadable Parquet" in str(e.value) and "entropylens verify" in str(e.value)
    res = runner.invoke(app, ["query", str(tmp_path), "SELECT * FROM tokens"])
    assert res.exit_code == 2 and str(f) in res.stderr and "Traceback" not in res.output, res.output


def test_a_damaged_steps_file_is_named_and_its_step_left_out(clean, run):
    base, _ = answers(clean)
    f = run / "steps" / "step=1" / "rank=0" / "steps.parquet"
    _damage_middle(f)
    got, said = answers(run)
    assert got == {k: v for k, v in base.items() if k != (1, 0)}
    assert len(said) == 1 and said[0].startswith(f"skipped {f}: unreadable Parquet"), said
    res = runner.invoke(app, ["query", str(run), "SELECT step FROM steps ORDER BY step"])
    assert res.exit_code == 0 and "Traceback" not in res.output and str(f) in res.stderr, res.output


def test_the_file_check_benchmark_runs():
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "file_check.py"), "--steps", "3", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith("10 files") and "check_ratio=" in out.stdout.splitlines()[-1]


def test_a_file_lacking_a_column_its_own_version_writes_is_called_edited(clean, run):
    """A file of today's version without `entropy` (edited by another tool) is not an older version: the note
    says so and `verify` counts it bad; the other steps read as before."""
    base, _ = answers(clean)
    f = _token_file(run, 1)
    _rewrite(f, lambda t: t.drop_columns(["entropy"]))  # its metadata still says today's version
    got, said = answers(run)
    assert got[(0, 0)] == base[(0, 0)] and got[(2, 0)] == base[(2, 0)] and got[(1, 0)][1] == 0
    assert len(said) == 1 and "edited by another tool, or damaged?" in said[0] and "written before" not in said[0]
    res = runner.invoke(app, ["verify", str(run)])
    assert res.exit_code == 1 and f"bad: {f}" in res.output, res.output
