"""Real processes, real files: SIGKILL at random moments, and two torch.distributed (gloo) ranks."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb

from entropylens.read.query import connect

CHILD = Path(__file__).parent.parent / "helpers" / "record_child.py"


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _child_until(line: str, *args: str) -> subprocess.Popen:
    """record_child.py with ``args``, once it has printed ``line`` (it goes on running)."""
    p = subprocess.Popen(
        [sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    for out in p.stdout:
        if out.strip() == line:
            break
    return p


def test_sigkill_leaves_only_whole_files_and_complete_steps(tmp_path):
    rng = random.Random(1234)
    kills = 10
    for i in range(kills):
        p = subprocess.Popen(
            [sys.executable, str(CHILD), "kill", str(tmp_path), f"k{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        line = p.stdout.readline()  # 'ready' after 3 steps: the writer is busy
        assert line.strip() == "ready", p.stderr.read()
        time.sleep(rng.uniform(0.0, 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.returncode == -signal.SIGKILL
    # every file the glob sees is whole: DuckDB reads all of them without error
    glob = f"{tmp_path}/**/*.parquet"
    n_files = duckdb.sql(
        f"SELECT count(DISTINCT filename) FROM read_parquet('{glob}', union_by_name=true, filename=true)"
    ).fetchall()[0][0]
    assert n_files > 0
    for f in tmp_path.rglob("*.parquet"):
        assert not f.name.startswith(".")
    # every step whose steps row is present has all its token rows (sample = 1)
    con = connect(tmp_path)
    bad = con.execute("""
        SELECT s.run, s.step, s.update, s.n_tokens, coalesce(t.n, 0) AS n
        FROM steps s LEFT JOIN (SELECT run, step, update, count(*) AS n FROM tokens GROUP BY ALL) t
        USING (run, step, update) WHERE s.n_tokens <> coalesce(t.n, 0)""").fetchall()
    assert bad == []
    per_run = con.execute("SELECT run, count(DISTINCT step) FROM steps GROUP BY run").fetchall()
    assert len(per_run) == kills and all(n >= 2 for _, n in per_run)  # finished steps are readable
    status = {s for (s,) in con.execute("SELECT DISTINCT status FROM runs").fetchall()}
    assert status <= {"running", "stale"}  # killed: never marked finished (stale once the heartbeat ages)


def test_sigkill_after_commit_loses_no_committed_step(tmp_path):
    # the child commits each step (Recorder.commit) and then says so; killed at random moments, every
    # step it reported committed is on disk whole: its steps rows, all their token rows, its sequences
    rng = random.Random(99)
    for i in range(4):
        p = subprocess.Popen(
            [sys.executable, str(CHILD), "commit", str(tmp_path), f"c{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        first = p.stdout.readline()
        assert first.strip() == "committed 0", p.stderr.read()
        time.sleep(rng.uniform(0.0, 1.0))
        p.send_signal(signal.SIGKILL)
        p.wait()
        lines = [first] + p.stdout.read().splitlines()
        last = int(lines[-1].split()[1])  # the last step reported committed before the kill
        con = connect(tmp_path)
        steps = con.execute(
            "SELECT step, count(*), sum(n_tokens) FROM steps WHERE run = ? GROUP BY step ORDER BY step", [f"c{i}"]
        ).fetchall()
        assert [s for s, _, _ in steps][: last + 1] == list(range(last + 1))
        for step, n_updates, n_tokens in steps[: last + 1]:
            assert n_updates == 2
            rows = con.execute("SELECT count(*) FROM tokens WHERE run = ? AND step = ?", [f"c{i}", step]).fetchone()
            seqs = con.execute("SELECT count(*) FROM sequences WHERE run = ? AND step = ?", [f"c{i}", step]).fetchone()
            assert rows == (n_tokens,) and seqs == (16,)


def test_a_step_ended_is_written_without_another_call_and_survives_a_kill(tmp_path):
    # the child ends steps 0 and 1 (Recorder.end_step) and then only sleeps (the next step's rollout):
    # without another recorder call both steps reach the disk, whole; killed then, it has lost neither
    p = _child_until("ended 1", "endstep", str(tmp_path), "e")
    steps_file = tmp_path / "e" / "steps" / "step=1" / "rank=0" / "steps.parquet"
    deadline = time.monotonic() + 30
    while not steps_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert steps_file.exists(), "step 1 was ended but not written while the job slept"
    con = connect(tmp_path)
    steps = con.execute("SELECT step, count(*), sum(n_tokens) FROM steps GROUP BY step ORDER BY step").fetchall()
    assert [(s, n) for s, n, _ in steps] == [(0, 2), (1, 2)]
    for step, _, n_tokens in steps:
        assert con.execute("SELECT count(*) FROM tokens WHERE step = ?", [step]).fetchone() == (n_tokens,)
        assert con.execute("SELECT count(*) FROM sequences WHERE step = ?", [step]).fetchone() == (16,)


def test_a_killed_run_resumes_after_its_checkpoint(tmp_path):
    # the child commits each step and is killed; the "checkpoint" is step 1 (the writer may have committed
    # later steps, and left uncommitted files of the one in progress). Resuming with resume=1 keeps steps
    # 0-1 as they were, removes the rest, and the new job records steps 2-3: every step once, its rows whole
    import json

    from entropylens import Recorder
    from entropylens.record.run_dir.run_claim import RunExistsError

    p = _child_until("committed 2", "commit", str(tmp_path), "k")
    time.sleep(0.3)  # the child goes on: later steps committed, one in progress (files of it maybe on disk)
    p.send_signal(signal.SIGKILL)
    p.wait()
    con = connect(tmp_path)
    before = con.execute("SELECT step, update, n_tokens FROM steps WHERE step <= 1 ORDER BY ALL").fetchall()
    tokens_before = con.execute("SELECT count(*) FROM tokens WHERE step <= 1").fetchone()
    started = json.loads((tmp_path / "k" / "run.json").read_text())["started_at"]
    try:
        Recorder(tmp_path, run="k")
    except RunExistsError:
        pass
    else:
        raise AssertionError("an existing run must be refused without resume")
    import pytest

    with pytest.raises(
        ValueError,
        match=r"resume=100000: step 100000 of rank 0 is not on disk in .* \(its last "
        r"written step is \d+\); resume from a checkpoint at or before step \d+, "
        r"and call commit\(\) when saving one",
    ):
        Recorder(tmp_path, run="k", resume=100_000)
    with pytest.raises(ValueError, match="holds no run to resume"):
        Recorder(tmp_path, run="nothing-here", resume=3)
    assert not (tmp_path / "nothing-here").exists()  # a refused resume creates nothing
    for bad in (-5, True, "3"):  # a negative K removed every step; True meant the last step on disk, not the checkpoint
        with pytest.raises(ValueError, match=r"resume must be the step the job resumes after \(an int >= 0"):
            Recorder(tmp_path, run="k", resume=bad)
    with pytest.raises(ValueError, match="resume needs the run id"):
        Recorder(tmp_path, resume=1)
    with pytest.raises(ValueError, match=r"resume: run 'k' was recorded with method 'grpo', config says 'dapo'"):
        Recorder(tmp_path, run="k", resume=1, config={"method": "dapo"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]
    import torch

    sys.path.insert(0, str(CHILD.parent))
    from record_child import one_update

    gen = torch.Generator().manual_seed(5)
    # what a job killed while writing leaves: a hidden temporary (of a later step, and of a kept step)
    leftover = tmp_path / "k" / "tokens" / "step=90" / "rank=0"
    leftover.mkdir(parents=True)
    (leftover / ".update-0.parquet.123.456.tmp").write_bytes(b"PAR1 half a file")
    kept_tmp = tmp_path / "k" / "steps" / "step=0" / "rank=0" / ".steps.parquet.123.456.tmp"
    kept_tmp.write_bytes(b"PAR1")
    last = con.execute("SELECT max(step) FROM steps").fetchone()[0]  # the child committed more than step 1
    assert last >= 2
    with pytest.warns(
        UserWarning,
        match=rf"resume=1 removed {last - 1} complete steps? of run 'k' \(rank 0\) "
        rf"recorded after step 1: "
        rf"{2 if last == 2 else '2, 3' if last == 3 else f'2-{last}'}; the resumed job",
    ):
        rec = Recorder(tmp_path, run="k", resume=1)  # no config: the run keeps the first job's
    with rec:
        with pytest.raises(ValueError, match="steps <= 1 are closed"):
            one_update(rec, 1, 2, 8, 64, 50, gen)
        for step in (2, 3):
            for u in range(2):
                one_update(rec, step, u, 8, 64, 50, gen, seq_offset=8 * u)
    con = connect(tmp_path)
    assert con.execute("SELECT step, update, n_tokens FROM steps WHERE step <= 1 ORDER BY ALL").fetchall() == before
    assert con.execute("SELECT count(*) FROM tokens WHERE step <= 1").fetchone() == tokens_before
    per_step = con.execute("SELECT step, count(*), sum(n_tokens) FROM steps GROUP BY step ORDER BY step").fetchall()
    assert [(s, n) for s, n, _ in per_step] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    for step, _, n_tokens in per_step:  # no row left of the killed job's steps 2-3
        assert con.execute("SELECT count(*) FROM tokens WHERE step = ?", [step]).fetchone() == (n_tokens,)
    assert con.execute("SELECT count(*) FROM sequences WHERE step >= 2").fetchone() == (0,)  # not recorded again
    info = json.loads((tmp_path / "k" / "run.json").read_text())
    assert info["status"] == "finished" and info["started_at"] == started
    assert info["method"] == "grpo" and info["config"]["method"] == "grpo" and info["loss"]["method"] == "grpo"
    assert [r["after_step"] for r in info["resumed"]] == [1]
    assert con.execute("SELECT resumes FROM runs WHERE run = 'k'").fetchone() == (1,)
    assert not leftover.exists() and not kept_tmp.exists()  # temporaries and the later step's empty dir removed
    assert (tmp_path / "k" / "steps" / "step=0" / "rank=0" / "steps.parquet").exists()


def test_a_run_compacted_while_it_trained_resumes_after_its_compacted_steps(tmp_path):
    """A run compacted while it trained (or after it was killed) stays resumable. Compacted steps
    stay (their parts span steps and ranks); resuming after them removes only later, uncompacted steps."""
    import pytest
    import torch

    from entropylens import Recorder
    from entropylens.read.compact import compact

    sys.path.insert(0, str(CHILD.parent))
    from record_child import one_update

    gen = torch.Generator().manual_seed(3)
    rec = Recorder(tmp_path, run="c", config={"method": "grpo"})
    for step in range(4):
        one_update(rec, step, 0, 4, 8, 20, gen)
    rec.commit()  # steps 0-3 on disk; the job goes on (status running)
    (done,) = compact(tmp_path, grace_s=0)
    assert done.steps == (0, 3)  # the final steps of a live run: every rank committed them
    rec.close(status="failed", _raise=False)  # then it fails (as a trainer's crash handler closes it)
    with pytest.raises(
        ValueError,
        match=r"resume=1: steps 0-3 of .* were compacted .* reach past step 1; "
        r"compacted steps cannot be removed: resume after step 3 or later",
    ):
        Recorder(tmp_path, run="c", resume=1)
    before = connect(tmp_path).execute("SELECT step, n_tokens FROM steps ORDER BY step").fetchall()
    with Recorder(tmp_path, run="c", resume=3) as again:
        for step in (4, 5):
            one_update(again, step, 0, 4, 8, 20, gen)
    con = connect(tmp_path)
    assert con.execute("SELECT step, n_tokens FROM steps WHERE step <= 3 ORDER BY step").fetchall() == before
    per_step = con.execute("SELECT step, count(*), sum(n_tokens) FROM steps GROUP BY step ORDER BY step").fetchall()
    assert [(s, n) for s, n, _ in per_step] == [(k, 1) for k in range(6)]
    for step, _, n_tokens in per_step:
        assert con.execute("SELECT count(*) FROM tokens WHERE step = ?", [step]).fetchone() == (n_tokens,)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(*args):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **_env(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(CHILD), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def test_two_distributed_ranks_write_their_own_files(tmp_path):
    procs = _two_ranks("dist", str(tmp_path), "3")
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(dict(kv.split("=") for kv in out.split()))
    assert outs[0]["run"] == outs[1]["run"]  # one run id, agreed once at start
    runs = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(runs) == 1
    files = sorted(str(f.relative_to(runs[0])) for f in runs[0].rglob("*.parquet"))
    rank0 = [f for f in files if "/rank=0/" in f]
    rank1 = [f for f in files if "/rank=1/" in f]
    assert rank0 and rank1 and len(rank0) + len(rank1) == len(files)  # no file shared
    con = connect(tmp_path)
    counts = dict(con.execute("SELECT rank, count(*) FROM tokens GROUP BY rank").fetchall())
    assert counts == {0: int(outs[0]["tokens"]), 1: int(outs[1]["tokens"])}
    steps = con.execute("SELECT rank, sum(n_tokens) FROM steps GROUP BY rank ORDER BY rank").fetchall()
    assert steps == [(0, int(outs[0]["tokens"])), (1, int(outs[1]["tokens"]))]
    assert con.execute("SELECT world_size, status FROM runs").fetchall() == [(2, "finished")]
    seqs = con.execute("SELECT rank, min(seq), max(seq) FROM tokens GROUP BY rank ORDER BY rank").fetchall()
    assert seqs == [(0, 0, 3), (1, 100, 104)]


def test_two_killed_ranks_resume_their_run_together(tmp_path):
    # two gloo ranks commit each step (a checkpoint every step), both are killed after step 2's; the
    # restarted pair resumes with resume=1 (an earlier checkpoint) and records steps 2-4: each rank's
    # steps 0-1 kept as they were, its later files removed and recorded again, every (step, rank) once
    import json

    procs = _two_ranks("distcommit", str(tmp_path), "d")
    for p in procs:
        for line in p.stdout:
            if line.strip() == "committed 2":
                break
    time.sleep(0.2)  # the ranks go on: step 3 committed or in progress
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
        assert p.returncode == -signal.SIGKILL
    con = connect(tmp_path)
    kept = con.execute("SELECT step, rank, n_tokens FROM steps WHERE step <= 1 ORDER BY ALL").fetchall()
    assert [(s, r) for s, r, _ in kept] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert con.execute("SELECT count(*) FROM steps WHERE step = 2").fetchone() == (2,)  # committed, then redone

    procs = _two_ranks("distresume", str(tmp_path), "d", "1", "5")
    recorded = {}
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert re.search(r"resume=1 removed \d+ complete steps? of run 'd' \(rank " + str(rank), err), err
        for line in out.splitlines():
            kv = dict(x.split("=") for x in line.split())
            recorded[(int(kv["step"]), rank)] = int(kv["tokens"])
    assert sorted(recorded) == [(s, r) for s in (2, 3, 4) for r in (0, 1)]
    con = connect(tmp_path)
    rows = con.execute("SELECT step, rank, n_tokens FROM steps ORDER BY ALL").fetchall()
    assert [r for r in rows if r[0] <= 1] == kept
    assert {(s, r): n for s, r, n in rows if s >= 2} == recorded
    tokens = dict(
        ((s, r), n) for s, r, n in con.execute("SELECT step, rank, count(*) FROM tokens GROUP BY ALL").fetchall()
    )
    assert tokens == {(s, r): n for s, r, n in rows}  # every step's token rows whole, none of the killed job's
    assert con.execute("SELECT world_size, status, resumes FROM runs").fetchall() == [(2, "finished", 1)]
    info = json.loads((tmp_path / "d" / "run.json").read_text())
    assert [r["after_step"] for r in info["resumed"]] == [1]
    assert len(rows) == len({(s, r) for s, r, _ in rows})  # no (step, rank) twice


def test_a_run_resumes_on_fewer_or_more_ranks(tmp_path):
    # a job of 3 ranks commits steps 0-3 and fails; it resumes on 2 ranks after step 1: rank 0 removes
    # the later steps of rank 2 too (and its status file), whose steps 0-1 stay; then on 4 ranks after
    # step 2: rank 3 is new (nothing to remove), rank 2 sat out step 2 (a warning says so, no refusal).
    # Every (step, rank) once; the run ends finished
    import pytest

    sys.path.insert(0, str(CHILD.parent))
    import torch
    from record_child import one_update

    from entropylens import Recorder

    gen = torch.Generator().manual_seed(3)

    def job(world, steps, resume=None):
        recs = [
            Recorder(
                tmp_path,
                run="w",
                rank=r,
                world_size=world,
                resume=resume,
                config=None if resume is not None else {"method": "grpo"},
            )
            for r in range(world)
        ]
        for step in steps:
            for r, rec in enumerate(recs):
                one_update(rec, step, 0, 2 + r, 8, 20, gen, seq_offset=100 * r)
                rec.commit()
        return recs

    for rec in job(3, range(4)):
        rec.close(status="failed")
    assert (tmp_path / "w" / "ranks" / "rank-2.json").exists()
    with pytest.warns(UserWarning, match=r"resume=1 removed 2 complete steps of run 'w' \(rank [01]\)"):
        resumed = job(2, range(2, 4), resume=1)
    for rec in resumed:
        rec.close()
    con = connect(tmp_path)
    assert con.execute("SELECT step, rank FROM steps ORDER BY ALL").fetchall() == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert not (tmp_path / "w" / "ranks" / "rank-2.json").exists()
    assert con.execute("SELECT status, resumes FROM runs").fetchall() == [("finished", 1)]
    with (
        pytest.warns(UserWarning, match=r"resume=2 removed 1 complete step of run 'w'"),
        pytest.warns(UserWarning, match=r"resume=2: rank 2 has no steps 2-2 on disk .* did not take part"),
    ):
        recs = job(4, range(3, 5), resume=2)  # rank 2 sat out the 2-rank job; rank 3 is new
    for rec in recs:
        rec.close()
    con = connect(tmp_path)
    rows = con.execute("SELECT step, rank FROM steps ORDER BY ALL").fetchall()
    assert rows == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)] + [
        (s, r) for s in (3, 4) for r in range(4)
    ]
    tokens = con.execute("SELECT step, rank, count(*) FROM tokens GROUP BY ALL ORDER BY ALL").fetchall()
    n_tokens = con.execute("SELECT step, rank, n_tokens FROM steps ORDER BY ALL").fetchall()
    assert tokens == n_tokens  # every step's rows whole, none left of a removed step
    assert con.execute("SELECT world_size, status, resumes FROM runs").fetchall() == [(4, "finished", 2)]
