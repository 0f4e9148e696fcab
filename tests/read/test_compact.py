"""Compaction: same answers before and after, the commit rule under a concurrent reader, a crashed
compaction, a live run (only final steps), the CLI. Runs are in the recorder's layout
(tests/helpers/layout_run.py)."""

import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from layout_run import make_run, write_step  # noqa: E402

from entropylens.read import compact as compact_mod  # noqa: E402
from entropylens.read.compact import compact  # noqa: E402
from entropylens.read.query import connect, list_analyses, run_analysis  # noqa: E402

TOTALS = """SELECT (SELECT count(*) FROM tokens), (SELECT sum(entropy)::DOUBLE FROM tokens),
                   (SELECT count(*) FROM sequences), (SELECT count(*) FROM steps),
                   (SELECT coalesce(sum(n_tokens), 0) FROM steps)"""


def _parquet(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.parquet"))


def test_every_analysis_gives_the_same_rows_after_compaction(tmp_path):
    make_run(tmp_path, "a", steps=12, rows=96, ranks=2)
    make_run(tmp_path, "b", steps=5, rows=40)
    before = {name: run_analysis(connect(tmp_path), name) for name, _ in list_analyses()}
    n_before = len(_parquet(tmp_path))
    res = compact(tmp_path, grace_s=0, file_bytes=6000)
    assert [r.steps for r in res] == [(0, 11), (0, 4)]
    assert res[0].rows == 12 * 2 * 96 and res[0].files_in == 12 * 2 * 3
    after_files = _parquet(tmp_path)
    assert all("/compacted/" in str(p) for p in after_files)
    assert len(after_files) < n_before / 2  # several parts per table (file_bytes is tiny here)
    con = connect(tmp_path)
    for name, df in before.items():
        pd.testing.assert_frame_equal(
            run_analysis(con, name), df, check_exact=False, rtol=1e-9, check_dtype=False, obj=name
        )


def test_compacted_files_keep_step_and_rank_and_large_row_groups(tmp_path):
    import pyarrow.parquet as pq

    make_run(tmp_path, "a", steps=30, rows=100, ranks=2)
    compact(tmp_path, grace_s=0, row_group_rows=2000)
    tok = _parquet(tmp_path / "a" / "compacted" / "tokens")
    assert len(tok) == 1
    md = pq.read_metadata(tok[0])
    assert md.num_rows == 6000 and md.num_row_groups == 3  # 2,000-row groups of 20 (step, rank) files
    t = pq.read_table(tok[0], columns=["step", "rank"])
    steps = t.column("step").to_pylist()
    assert steps == sorted(steps) and t.column("rank").to_pylist()[:200] == [0] * 100 + [1] * 100


def test_compacted_float_columns_are_plain_and_uncompressed_with_the_same_values(tmp_path):
    import pyarrow.parquet as pq

    from entropylens.record.writing.parquet import TOKEN_FLOAT_COLUMNS

    make_run(tmp_path, "a", steps=4, rows=50, ranks=2)
    before = pq.read_table(_parquet(tmp_path / "a" / "tokens")[0]).column("entropy").to_pylist()
    compact(tmp_path, grace_s=0)
    tok = _parquet(tmp_path / "a" / "compacted" / "tokens")[0]
    rg = pq.read_metadata(tok).row_group(0)
    codec = {rg.column(i).path_in_schema: rg.column(i) for i in range(rg.num_columns)}
    floats = [c for c in TOKEN_FLOAT_COLUMNS if c in codec]
    assert "entropy" in floats and "logprob" in floats
    for c in floats:  # read back ~2.5x faster than zstd + BYTE_STREAM_SPLIT, which keeps ~93% of the bytes
        assert codec[c].compression == "UNCOMPRESSED" and "BYTE_STREAM_SPLIT" not in codec[c].encodings, c
    assert codec["seq"].compression == "ZSTD" and codec["quadrant"].compression == "ZSTD"
    after = pq.read_table(tok, filters=[("step", "=", 0), ("rank", "=", 0)]).column("entropy").to_pylist()
    assert after == before  # the same float32 values, bit for bit


def test_concurrent_reader_never_double_counts_nor_misses(tmp_path):
    """A reader connects and counts in a loop while the run grows and is compacted again and again;
    every read equals one of the committed totals, and reads happen inside the compaction windows."""
    d = make_run(tmp_path, "r", steps=0, status="running", ranks=1)
    expected: dict[int, tuple] = {}
    seen, errors = [], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.append(connect(tmp_path).execute(TOTALS).fetchall()[0])
            except Exception as e:  # noqa: BLE001 - any error fails the test
                errors.append(repr(e))

    step = 0
    th = threading.Thread(target=reader)
    th.start()
    try:
        for _round in range(4):
            for _ in range(6):
                write_step(d, step, 0, 48)
                step += 1
            write_step(d, step, 0, 48, commit=False)  # an uncommitted step is always in flight
            con = connect(tmp_path)
            expected[step] = con.execute(TOTALS).fetchall()[0]
            n_reads = len(seen)
            compact(tmp_path, grace_s=2.0)  # longer than one connect + query here
            assert len(seen) > n_reads  # the reader ran while this compaction did
            write_step(d, step, 0, 48, commit=True, seed=0)  # commit it (same rows, rewritten)
            step += 1
    finally:
        stop.set()
        th.join()
    assert not errors, errors[:3]
    assert len(seen) > 10
    for v in seen:
        n_tok, _, n_seq, n_steps, sum_n = v
        assert n_tok == sum_n == 48 * n_steps and n_seq == 6 * n_steps, v  # nothing doubled or missed
    assert {n for n, *_ in seen} <= {48 * n for n in range(step + 1)}
    assert sorted({v[0] for v in expected.values()}) == [48 * n for n in (6, 13, 20, 27)]
    final = connect(tmp_path).execute(TOTALS).fetchall()[0]
    assert final[0] == 48 * step


def test_a_crashed_compaction_changes_nothing_and_is_cleaned_up(tmp_path, monkeypatch):
    make_run(tmp_path, "a", steps=8, rows=64)
    before = connect(tmp_path).execute(TOTALS).fetchall()

    def die(*a, **k):
        raise OSError("killed before the commit")

    monkeypatch.setattr(compact_mod.pq, "write_table", die)  # the commit file's write
    with pytest.raises(OSError):
        compact(tmp_path, grace_s=0)
    monkeypatch.undo()
    orphans = _parquet(tmp_path / "a" / "compacted")
    assert orphans and all("/tokens/" in str(p) or "/sequences/" in str(p) for p in orphans)
    assert connect(tmp_path).execute(TOTALS).fetchall() == before  # parts without commit: ignored
    write_step(tmp_path / "a", 8, 0, 64)  # the run went on: the next compaction covers 0..8
    after = connect(tmp_path).execute(TOTALS).fetchall()
    (res,) = compact(tmp_path, grace_s=0)
    assert res.steps == (0, 8)
    assert connect(tmp_path).execute(TOTALS).fetchall() == after
    assert not any(p.exists() for p in orphans)  # the dead compaction's parts were removed
    assert all(p.name.startswith("steps-0-8") for p in _parquet(tmp_path / "a" / "compacted"))


def test_live_run_compacts_only_steps_every_rank_committed(tmp_path):
    d = make_run(tmp_path, "r", steps=4, rows=32, ranks=2, status="running")
    for s in (4, 5):
        write_step(d, s, 0, 32)  # rank 0 is ahead; rank 1 has committed up to step 3
    (res,) = compact(tmp_path, grace_s=0)
    assert res.steps == (0, 3)
    write_step(d, 4, 1, 32)
    write_step(d, 5, 1, 32)
    write_step(d, 6, 0, 32)
    (res,) = compact(tmp_path, grace_s=0)
    assert res.steps == (4, 5)
    got = connect(tmp_path).execute("SELECT step, count(*) FROM tokens GROUP BY step ORDER BY step").fetchall()
    assert got == [(s, 64) for s in range(6)] + [(6, 32)]


def test_cli_compact(tmp_path):
    make_run(tmp_path, "a", steps=5, rows=32)
    res = CliRunner().invoke(app, ["compact", str(tmp_path), "--grace", "0"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "a: steps 0-4: 15 files -> 3 (160 token rows), 15 originals removed"
    res = CliRunner().invoke(app, ["compact", str(tmp_path), "--grace", "0"])
    assert res.stdout.strip() == "a: nothing to compact (no final uncompacted step)"
    res = CliRunner().invoke(app, ["compact", str(tmp_path / "missing")])
    assert res.exit_code == 2 and res.stderr.startswith("error: path does not exist")
    make_run(tmp_path, "b", steps=2, rows=8)
    res = CliRunner().invoke(app, ["compact", str(tmp_path), "--grace", "0.01"])  # the wait is announced
    assert res.exit_code == 0 and "waits --grace 0.01 s" in res.stderr


def _truncate(p: Path) -> bytes:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return data


def test_truncated_commit_with_originals_gone_is_flagged_and_its_parts_kept(tmp_path):
    make_run(tmp_path, "a", steps=6, rows=32)
    want = connect(tmp_path).execute(TOTALS).fetchall()
    compact(tmp_path, grace_s=0)  # originals removed: the compacted parts are the only copy
    commit = tmp_path / "a" / "compacted" / "steps" / "steps-0-5.parquet"
    whole = _truncate(commit)
    parts = _parquet(tmp_path / "a" / "compacted" / "tokens")
    res = CliRunner().invoke(app, ["runs", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (line,) = [w for w in res.stderr.splitlines() if w.startswith("warning:")]  # one line, names the loss
    assert "steps-0-5.parquet" in line and "steps 0-5" in line and "NOT shown" in line
    (res,) = compact(tmp_path, grace_s=0)  # nothing to do; the parts are not removed as orphans
    assert res.steps is None and all(p.exists() for p in parts)
    commit.write_bytes(whole)  # restored from a copy: every row is back
    assert connect(tmp_path).execute(TOTALS).fetchall() == want


def test_truncated_commit_with_originals_kept_reads_the_originals(tmp_path):
    import shutil

    make_run(tmp_path / "c", "a", steps=6, rows=32)
    want = connect(tmp_path / "c").execute(TOTALS).fetchall()
    shutil.copytree(tmp_path / "c", tmp_path / "k")
    compact(tmp_path / "c", grace_s=0)
    shutil.copytree(tmp_path / "c" / "a" / "compacted", tmp_path / "k" / "a" / "compacted")  # died before clean-up
    _truncate(tmp_path / "k" / "a" / "compacted" / "steps" / "steps-0-5.parquet")
    with pytest.warns(UserWarning, match="original files are read instead"):
        con = connect(tmp_path / "k")
    assert con.execute(TOTALS).fetchall() == want  # every step, once, from the originals
    assert run_analysis(con, "run_summary")["steps"].iloc[0] == 6
    (res,) = compact(tmp_path / "k", grace_s=0)  # the broken range is left alone, nothing lost
    assert res.steps is None
    with pytest.warns(UserWarning):
        assert connect(tmp_path / "k").execute(TOTALS).fetchall() == want
