"""Several ranks, one run: each rank writes ranks/rank-R.json and the `runs` view's status reflects them all
(a failed rank fails the run; a rank that died without closing turns the run stale)."""

import json

from entropylens.read.query import connect
from entropylens.record.recorder import Recorder


def _status(path):
    return connect(path).execute("SELECT status FROM runs").fetchone()[0]


def test_run_status_reflects_every_rank(tmp_path):
    r0 = Recorder(tmp_path, "two", rank=0, world_size=2, config={"method": "grpo"})
    r1 = Recorder(tmp_path, "two", rank=1, world_size=2, config={"method": "grpo"})
    assert sorted(p.name for p in (tmp_path / "two" / "ranks").iterdir()) == ["rank-0.json", "rank-1.json"]
    r0.close()  # rank 0 (the one that writes run.json) finished ...
    assert json.loads((tmp_path / "two" / "run.json").read_text())["status"] == "finished"
    assert _status(tmp_path / "two") == "running"  # ... rank 1 has not
    r1.close(status="failed", _raise=False)
    assert _status(tmp_path / "two") == "failed"

    ok0 = Recorder(tmp_path, "ok", rank=0, world_size=2, config={"method": "grpo"})
    ok1 = Recorder(tmp_path, "ok", rank=1, world_size=2, config={"method": "grpo"})
    ok1.close()
    ok0.close()
    assert _status(tmp_path / "ok") == "finished"


def test_a_rank_that_died_makes_the_run_stale(tmp_path):
    r0 = Recorder(tmp_path, "dead", rank=0, world_size=2, config={"method": "grpo"})
    r0.close()
    # rank 1 was killed (kill -9) long ago: its last heartbeat is old and it never wrote a final status
    (tmp_path / "dead" / "ranks" / "rank-1.json").write_text(
        json.dumps(
            {
                "rank": 1,
                "status": "running",
                "heartbeat_at": "2020-01-01T00:00:00+00:00",
                "heartbeat_s": 10.0,
                "error": None,
            }
        )
    )
    assert _status(tmp_path / "dead") == "stale"
    # a rank that never wrote anything at all (world_size 2, one file) counts as running since the start
    (tmp_path / "dead" / "ranks" / "rank-1.json").unlink()
    info = json.loads((tmp_path / "dead" / "run.json").read_text())
    info["started_at"] = "2020-01-01T00:00:00+00:00"
    (tmp_path / "dead" / "run.json").write_text(json.dumps(info))
    assert _status(tmp_path / "dead") == "stale"


def test_sample_keeps_a_sequence_whole_across_steps(tmp_path):
    # num_iterations > 1: the same sequences (run-unique ids) are trained at two steps; the sample is
    # keyed on the seq id alone, so each sequence is kept (every row, both steps) or dropped at both
    import torch

    b, t = 64, 3
    seq = torch.arange(100, 100 + b)
    with Recorder(tmp_path, "s", sample=0.5, config={"method": "grpo"}) as rec:
        for step in (0, 1):
            lp = torch.full((b, t), -1.0)
            rec.record_update(
                step,
                0,
                mask=torch.ones(b, t, dtype=torch.bool),
                advantages=torch.ones(b),
                logprobs=lp,
                old_logprobs=lp,
                seq_ids=seq,
            )
    t_ = connect(tmp_path / "s").execute("SELECT step, seq, count(*) AS n FROM tokens GROUP BY step, seq").df()
    kept = {s: set(t_.loc[t_["step"] == s, "seq"]) for s in (0, 1)}
    assert kept[0] == kept[1] and 0 < len(kept[0]) < b  # the same half, at both steps
    assert (t_["n"] == t).all()  # every row of a kept sequence
