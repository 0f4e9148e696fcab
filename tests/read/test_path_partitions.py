"""Step and rank come from the recorder's own path segments below the run folder, never from a folder above
it; run ids and paths with quotes and '=' are quoted wherever SQL names them."""

import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from recorded_run import record_run  # noqa: E402

from entropylens.read.query import connect, run_analysis  # noqa: E402

runner = CliRunner()
TABLES = ("tokens", "steps", "sequences")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    return record_run(tmp_path_factory.mktemp("plain"), "r", ranks=2)


def _contents(path) -> dict:
    """Every table's rows (all columns, the run column aside), sorted: what a reader answers."""
    con = connect(path)
    out = {}
    for t in TABLES:
        cols = [c for (c, *_) in con.execute(f"DESCRIBE {t}").fetchall() if c != "run"]
        quoted = ", ".join('"' + c + '"' for c in cols)
        out[t] = (cols, sorted(map(repr, con.execute(f"SELECT {quoted} FROM {t}").fetchall())))
    out["summary"] = repr(run_analysis(con, "run_summary").drop(columns=["run"]).to_dict("records"))  # NaN == NaN
    return out


@pytest.mark.parametrize("parents", ["step=7", "entropy=0", "rank=0", "lr=0.01/seed=1", "a=b/step=3/rank=1"])
def test_folders_above_the_run_change_nothing(two_ranks, tmp_path, parents):
    moved = tmp_path / parents / "r"
    shutil.copytree(two_ranks, moved)
    want = _contents(two_ranks)
    assert _contents(moved) == want
    assert _contents(tmp_path) == want  # found from above as well
    con = connect(moved)
    assert (
        con.execute("SELECT count(*) FROM tokens WHERE step = 1 AND rank = 1").fetchall()
        == connect(two_ranks).execute("SELECT count(*) FROM tokens WHERE step = 1 AND rank = 1").fetchall()
        != [(0,)]
    )
    assert (
        con.execute("SELECT count(*) FROM tokens t JOIN sequences s USING (step, rank, seq)").fetchall()
        == connect(two_ranks)
        .execute("SELECT count(*) FROM tokens t JOIN sequences s USING (step, rank, seq)")
        .fetchall()
    )


@pytest.mark.parametrize("name", ['say "hi"=1', "it's=2", "a\"b'c=d"])
def test_a_run_named_with_quotes_and_equals_works_everywhere(two_ranks, tmp_path, name):
    root = tmp_path / "runs"
    shutil.copytree(two_ranks, root / name)
    assert _contents(root / name) == _contents(two_ranks)
    res = runner.invoke(app, ["runs", str(root)])
    assert res.exit_code == 0 and name in res.stdout and "Traceback" not in res.output, res.output
    res = runner.invoke(app, ["query", str(root), "SELECT run, count(*) AS n FROM tokens GROUP BY run"])
    assert res.exit_code == 0 and name in res.stdout and res.stderr == "", res.output
    res = runner.invoke(app, ["report", str(root), "--out", str(tmp_path / "report")])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert (tmp_path / "report" / "index.html").exists()
