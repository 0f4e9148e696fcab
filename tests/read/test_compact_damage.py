"""Compaction with a damaged step, and readers that connected before a compaction."""

import sys
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from layout_run import make_run, write_step  # noqa: E402

from entropylens.read.compact import StepLeftAloneWarning, compact  # noqa: E402
from entropylens.read.query import connect, run_analysis, run_sql  # noqa: E402


def _token_rows(run: Path) -> int:
    return sum(
        pq.read_metadata(p).num_rows
        for p in run.rglob("*.parquet")
        if "/tokens/" in str(p) and "steps.parquet" not in p.name
    )


def _damage(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:20])  # truncated: no footer


def test_a_step_with_a_damaged_steps_file_is_left_alone(tmp_path):
    """Its intact token files were counted as hidden, included in the range and deleted: rows lost."""
    run = make_run(tmp_path, "a", steps=5, rows=16)
    run = Path(str(run))
    _damage(run / "steps" / "step=2" / "rank=0" / "steps.parquet")
    kept = sorted(p for p in run.rglob("step=2/rank=0/*.parquet"))
    before = _token_rows(run)
    with pytest.warns(StepLeftAloneWarning, match="step 2 not compacted"):
        res = compact(tmp_path, grace_s=0)
    assert sorted(r.steps for r in res) == [(0, 1), (3, 4)]  # no range straddles step 2
    assert all(p.exists() for p in kept)  # nothing of step 2 removed
    assert _token_rows(run) == before  # every token row is still in some file
    (run / "steps" / "step=2" / "rank=0" / "steps.parquet").unlink()  # restore the steps file: step 2 reads again
    write_step(run, 2, 0, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        con = connect(tmp_path)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM tokens").fetchone() == (5 * 16, 5)


def test_a_rank_without_a_steps_file_is_left_alone_and_the_cli_warns(tmp_path):
    run = Path(str(make_run(tmp_path, "a", steps=3, rows=16, ranks=2)))
    (run / "steps" / "step=1" / "rank=1" / "steps.parquet").unlink()  # rank 1 died between its files
    orphan = sorted(run.glob("*/step=1/rank=1/*.parquet"))
    assert orphan
    res = CliRunner().invoke(app, ["compact", str(tmp_path), "--grace", "0"])
    assert res.exit_code == 0, res.output
    assert "warning: a: step 1 not compacted" in res.stderr
    assert all(p.exists() for p in orphan)
    assert (run / "steps" / "step=1" / "rank=0" / "steps.parquet").exists()  # step 1 left whole


def test_a_damaged_token_file_is_not_compacted_over(tmp_path):
    run = Path(str(make_run(tmp_path, "a", steps=3, rows=16)))
    bad = run / "tokens" / "step=1" / "rank=0" / "update-0.parquet"
    _damage(bad)
    with pytest.warns(StepLeftAloneWarning, match="step 1"):
        res = compact(tmp_path, grace_s=0)
    assert sorted(r.steps for r in res) == [(0, 0), (2, 2)]
    assert bad.exists() and (run / "steps" / "step=1" / "rank=0" / "steps.parquet").exists()


def test_a_reader_opened_before_a_compaction_still_answers(tmp_path):
    """The views held file lists: after compaction removed the originals, every query failed with
    `IOException: No files found that match ...`. The connection re-plans once onto the compacted files."""
    make_run(tmp_path, "a", steps=4, rows=16)
    con = connect(tmp_path)
    sql = "SELECT count(*) AS n, sum(entropy)::DOUBLE AS e FROM tokens"
    want = run_sql(con, sql).values.tolist()
    seq = run_sql(con, "SELECT count(*) AS n FROM sequences")["n"].tolist()
    kl = run_analysis(con, "kl_by_step")
    compact(tmp_path, grace_s=0)
    assert not list((tmp_path / "a" / "tokens").rglob("*.parquet"))  # the originals are gone
    assert run_sql(con, sql).values.tolist() == want
    assert run_sql(con, "SELECT count(*) AS n FROM sequences")["n"].tolist() == seq
    assert run_analysis(con, "kl_by_step").equals(kl)
    write_step(tmp_path / "a", 4, 0, 16)  # later steps: still the connect-time snapshot
    compact(tmp_path, grace_s=0)
    assert run_sql(con, sql).values.tolist() == want
    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone() == (5 * 16,)  # reconnect sees it
