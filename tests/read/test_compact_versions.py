"""A run written by two versions (files with and without a column, and with a column a newer version adds)
compacts, and reads the same after compaction as before: NULL where a file lacked the column."""

import sys
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from recorded_run import answers, record_run  # noqa: E402

from entropylens.read.compact import compact  # noqa: E402
from entropylens.read.query import connect  # noqa: E402


def _rewrite(run: Path, step: int, change) -> None:
    (f,) = (run / "tokens" / f"step={step}" / "rank=0").glob("*.parquet")
    pq.write_table(change(pq.read_table(f, partitioning=None)), f)


def test_a_run_of_two_versions_compacts_and_reads_the_same(tmp_path):
    run = record_run(tmp_path)
    _rewrite(
        run,
        0,
        lambda t: t.drop_columns(["entropy"]).replace_schema_metadata(
            {**(t.schema.metadata or {}), b"entropylens.schema_version": b"2"}
        ),
    )  # written before `entropy` existed
    _rewrite(run, 2, lambda t: t.append_column("newer", pa.array([1.5] * t.num_rows)))  # by a newer version
    newer = "SELECT step, count(newer), sum(newer) FROM tokens GROUP BY step ORDER BY step"
    before, said = answers(run)
    assert before[(0, 0)][1] == 0 and len(said) == 1  # the older file: NULL entropy, one note
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra_before = connect(run).execute(newer).fetchall()
        (res,) = compact(tmp_path, grace_s=0)
    assert res.steps == (0, 2) and res.removed > 0
    assert not list((run / "tokens").rglob("*.parquet"))  # the originals are gone: only compacted parts read
    after, _ = answers(run)
    assert after == before
    assert (
        connect(run).execute(newer).fetchall()
        == extra_before
        == [(0, 0, None), (1, 0, None), (2, before[(2, 0)][0], 1.5 * before[(2, 0)][0])]
    )
