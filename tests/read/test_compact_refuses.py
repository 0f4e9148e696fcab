"""compact never locks a wrong step into its parts: a step whose token rows exceed its n_tokens (a copy under a
recorder's file name) and a range holding a damaged page are left as they are, with one warning naming the file
and what to do; the other steps compact."""

import shutil
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from recorded_run import answers, record_run  # noqa: E402

from entropylens.read.compact import StepLeftAloneWarning, compact  # noqa: E402


def _token_file(run: Path, step: int) -> Path:
    (f,) = (run / "tokens" / f"step={step}" / "rank=0").glob("*.parquet")
    return f


def _compact(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = compact(path, grace_s=0)
    return res, [str(w.message) for w in caught if issubclass(w.category, StepLeftAloneWarning)]


def test_a_step_with_more_token_rows_than_recorded_is_not_compacted(tmp_path):
    run = record_run(tmp_path)
    f = _token_file(run, 1)
    shutil.copy(f, f.with_name("update-1.parquet"))  # a name the recorder writes: read, and counted twice
    doubled, _ = answers(run)
    res, said = _compact(tmp_path)
    assert len(said) == 1 and "step 1 not compacted" in said[0] and "n_tokens" in said[0], said
    assert {r.steps for r in res} == {(0, 0), (2, 2)}
    assert f.exists() and f.with_name("update-1.parquet").exists()  # step 1 left for the user (verify names it)
    after, _ = answers(run)
    assert after == doubled


def test_a_range_with_a_damaged_page_is_left_as_it_is(tmp_path):
    run = record_run(tmp_path)
    clean, _ = answers(run)
    f = _token_file(run, 1)
    data = bytearray(f.read_bytes())
    data[16:216] = b"\xff" * 200  # the first data page damaged; the footer and PAR1 intact
    f.write_bytes(bytes(data))
    before = sorted(p.relative_to(run) for p in run.rglob("*.parquet"))
    res, said = _compact(tmp_path)
    assert len(said) == 1 and str(f) in said[0] and "entropylens verify" in said[0], said
    assert [r.steps for r in res] == [None]
    assert sorted(p.relative_to(run) for p in run.rglob("*.parquet")) == before  # no part left behind
