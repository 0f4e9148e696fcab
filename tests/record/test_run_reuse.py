"""A run directory is written by one run. Re-using a run id is refused, or replaced whole
with overwrite=True; never mixed (a 2-step run over a 5-step one must report 2 steps, none stale)."""

import json

import pytest

from entropylens import storage
from entropylens.demo.toy import config_for, train
from entropylens.read.query import connect
from entropylens.record.run_dir.run_claim import RunExistsError, claim, old_files

TINY = dict(prompts=2, group=2, minibatches=1, epochs=1, sft_steps=2)


def _steps(path):
    con = connect(path)
    return (
        con.execute("SELECT count(DISTINCT step), max(step) FROM steps").fetchone(),
        con.execute("SELECT max(step) FROM tokens").fetchone()[0],
        con.execute("SELECT status FROM runs").fetchone()[0],
    )


def test_reused_run_id_is_refused_then_overwritten_whole(tmp_path):
    train(config_for("grpo", steps=5, **TINY), tmp_path, run="x")
    with pytest.raises(RunExistsError, match=r"already holds a run .*run\.json.*overwrite=True") as e:
        train(config_for("grpo", steps=2, **TINY), tmp_path, run="x")
    assert "\n" not in str(e.value)  # one line
    assert _steps(tmp_path / "x") == ((5, 4), 4, "finished")  # the old run is untouched
    train(config_for("grpo", steps=2, **TINY), tmp_path, run="x", overwrite=True)
    assert _steps(tmp_path / "x") == ((2, 1), 1, "finished")  # only the new run's steps
    assert json.loads((tmp_path / "x" / "run.json").read_text())["config"]["steps"] == 2


def test_default_run_ids_never_collide(tmp_path):
    from entropylens import Recorder

    a = Recorder(tmp_path, config={"method": "grpo"})
    b = Recorder(tmp_path, config={"method": "grpo"})
    try:
        assert a.run != b.run and a.dir != b.dir
    finally:
        a.close()
        b.close()


def test_each_rank_claims_only_its_own_files(tmp_path):
    """Ranks never race: rank 1 removes rank=1 files only; rank 0 also run.json, compacted/ and ranks
    beyond the new world size."""
    run = tmp_path / "r"
    files = [
        "run.json",
        "ranks/rank-0.json",
        "ranks/rank-1.json",
        "ranks/rank-2.json",
        "tokens/step=0/rank=0/updates-0-1.parquet",
        "tokens/step=0/rank=1/updates-0-1.parquet",
        "tokens/step=0/rank=2/updates-0-1.parquet",
        "steps/step=0/rank=1/steps.parquet",
        "compacted/tokens/steps-0-9.part-0.parquet",
    ]
    for f in files:
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_bytes(b"x")
    loc = storage.location(run)
    rel = lambda paths: sorted(str(__import__("pathlib").Path(p).relative_to(run)) for p in paths)  # noqa: E731
    assert rel(old_files(loc, 1, 2)) == [
        "ranks/rank-1.json",
        "steps/step=0/rank=1/steps.parquet",
        "tokens/step=0/rank=1/updates-0-1.parquet",
    ]
    assert rel(old_files(loc, 0, 2)) == [
        "compacted/tokens/steps-0-9.part-0.parquet",
        "ranks/rank-0.json",
        "ranks/rank-2.json",
        "run.json",
        "tokens/step=0/rank=0/updates-0-1.parquet",
        "tokens/step=0/rank=2/updates-0-1.parquet",
    ]
    with pytest.raises(RunExistsError):
        claim(loc, 1, 2, overwrite=False)
    assert claim(loc, 1, 2, overwrite=True) == 3
    assert (run / "run.json").exists() and not (run / "ranks/rank-1.json").exists()
    assert claim(loc, 0, 2, overwrite=True) == 6
    assert loc.files() == {}
