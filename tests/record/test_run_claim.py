"""One writer per run and rank: a run's rank is claimed by an exclusive create of its claim file, which
holds the writer's nonce. Writers that create one run at the same instant get one run and refusals
naming the writer that got it; a writer whose run was taken over (overwrite=True, resume=K) stops at
its next write, so a run's files never come from two writers."""

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from entropylens import Recorder, storage
from entropylens.read.query import connect
from entropylens.record.recorder import RecorderError
from entropylens.record.run_dir.run_claim import Claim, RunExistsError, claim, claim_path

HELPERS = Path(__file__).parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))  # claim_child, record_child: here and in the processes started below

from claim_child import record_steps  # noqa: E402


def _simultaneous_starts(root, run: str, n: int, env: dict | None = None) -> list[tuple]:
    """``n`` processes (forked from a fork server) that create run ``run`` under ``root`` at one moment
    (a Barrier); their reports (claim_child.start), sorted by kind."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["entropylens.record.recorder", "claim_child"])  # torch imported once
    import claim_child

    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=claim_child.start, args=(str(root), run, i, barrier, results, env or {})) for i in range(n)
    ]
    for p in procs:
        p.start()
    reports = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=120)
    assert [r for r in reports if r[0] == "error"] == []
    return sorted(reports)


def _one_run_from_one_writer(run_dir, reports, n: int) -> None:
    """Exactly one process recorded; every other got one line naming the run, the rank and that
    writer; run.json, the sequences and the claim are that writer's alone."""
    recorded = [r for r in reports if r[0] == "recorded"]
    refused = [r for r in reports if r[0] == "refused"]
    assert len(recorded) == 1 and len(refused) == n - 1, reports
    _, winner, pid, nonce = recorded[0]
    for _, _, _, message in refused:
        assert "\n" not in message
        assert message.startswith(
            f"{run_dir} already holds a run (rank 0 claimed by pid {pid} on host {socket.gethostname()}, started 20"
        ), message
    info = json.loads(storage.location(f"{run_dir}/run.json").read_text())
    assert info["config"]["seed"] == winner and info["status"] == "finished"
    con = connect(run_dir)
    assert con.execute("SELECT DISTINCT text FROM sequences").fetchall() == [(f"writer {winner}",)]
    assert con.execute("SELECT count(DISTINCT step), count(*) FROM steps").fetchone() == (2, 2)
    assert (
        con.execute("SELECT sum(n_tokens) FROM steps").fetchone()
        == con.execute("SELECT count(*) FROM tokens").fetchone()
    )
    claim_file = claim_path(storage.location(str(run_dir)), 0)
    assert json.loads(claim_file.read_bytes())["nonce"] == nonce  # kept after close


def test_twenty_simultaneous_starts_give_one_run_and_nineteen_refusals(tmp_path):
    reports = _simultaneous_starts(tmp_path, "same", 20)
    _one_run_from_one_writer(tmp_path / "same", reports, 20)


def test_two_writers_that_list_the_run_at_the_same_moment_get_one_run(tmp_path, monkeypatch):
    """The worst interleaving, forced: both writers list the empty run directory before either has
    written a file (a barrier in the listing). A list-then-write claim accepts both; the exclusive
    create accepts one."""
    import threading

    from entropylens.record.run_dir import run_claim

    real, both, first = run_claim.old_files, threading.Barrier(2, timeout=60), threading.local()

    def listing(*args, **kwargs):
        if not getattr(first, "done", False):  # each writer's first listing waits for the other's
            first.done = True
            both.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(run_claim, "old_files", listing)
    out = []

    def start(i):
        try:
            out.append(("recorded", Recorder(tmp_path, run="same", config={"seed": i})))
        except RunExistsError as e:
            out.append(("refused", e))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    for kind, rec in out:
        if kind == "recorded":
            rec.close()
    assert sorted(kind for kind, _ in out) == ["recorded", "refused"], out


def test_simultaneous_starts_on_object_storage(s3):
    """The same on S3 (moto's server): the claim is a conditional PUT (If-None-Match: *)."""
    root = s3()
    env = {
        k: os.environ[k]
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    reports = _simultaneous_starts(root, "same", 6, env)
    _one_run_from_one_writer(f"{root}/same", reports, 6)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_exclusive_create_creates_once_and_never_replaces(tmp_path, where, request):
    root = storage.location(str(tmp_path) if where == "local" else request.getfixturevalue("s3")())
    f = root / "d" / "claim.json"
    assert f.create_exclusive(b"first") is True
    assert f.create_exclusive(b"second") is False
    assert f.read_bytes() == b"first"


@pytest.mark.parametrize("how", ["overwrite", "resume"])
def test_a_writer_whose_run_was_taken_over_stops_and_writes_nothing_more(tmp_path, how):
    """Writer A records step 0; a second job takes the run over (overwrite=True replaces it, resume=0
    continues it after step 0); A's later steps raise (at a later call or at close) and never reach the run: every
    row after the takeover is B's, run.json is B's, finished."""
    gen = torch.Generator().manual_seed(0)
    a = Recorder(tmp_path, run="x", config={"method": "grpo", "seed": 1})
    record_steps(a, "A", [0], gen)
    a.commit()
    b = Recorder(
        tmp_path,
        run="x",
        config={"method": "grpo", "seed": 2},
        **({"overwrite": True} if how == "overwrite" else {"resume": 0}),
    )
    with pytest.raises(
        RecorderError,
        match=r"run 'x' \(rank 0\) in .* is no longer this writer's: another writer "
        rf"took it over \(pid \d+ on host {socket.gethostname()}, started .*: "
        r"overwrite=True or resume=K\); this writer stopped",
    ):
        record_steps(a, "A", [1, 2], gen)  # its writer stops at its first file after the takeover: a later
        a.close()  # call, or close(), raises
    with b:
        record_steps(b, "B", [1, 2], gen)
    con = connect(tmp_path / "x")
    texts = con.execute("SELECT step, text, count(*) FROM sequences GROUP BY ALL ORDER BY ALL").fetchall()
    kept = [(0, "writer A", 4)] if how == "resume" else []  # resume keeps the run's steps up to 0
    assert texts == kept + [(1, "writer B", 4), (2, "writer B", 4)]
    assert (
        con.execute("SELECT sum(n_tokens) FROM steps").fetchone()
        == con.execute("SELECT count(*) FROM tokens").fetchone()
    )
    info = json.loads((tmp_path / "x" / "run.json").read_text())
    assert info["config"]["seed"] == 2 and info["status"] == "finished"


def test_a_rank_the_overwriting_job_does_not_have_stops_too(tmp_path):
    """A 2-rank run overwritten by a 1-rank job: rank 0 of the new job removes rank 1's claim, and the
    old rank 1, still running, writes nothing more."""
    gen = torch.Generator().manual_seed(0)
    old = [Recorder(tmp_path, run="w", rank=r, world_size=2) for r in (0, 1)]
    new = Recorder(tmp_path, run="w", overwrite=True)
    for rec in old:
        with pytest.raises(RecorderError, match=rf"run 'w' \(rank {rec.rank}\) in .* is no longer this writer's"):
            record_steps(rec, "old", [0], gen)
            rec.close()
    with new:
        record_steps(new, "new", [0], gen)
    con = connect(tmp_path / "w")
    assert con.execute("SELECT rank, text, count(*) FROM sequences GROUP BY ALL").fetchall() == [(0, "writer new", 4)]
    assert list((tmp_path / "w" / "ranks").glob("*")) == []  # the old ranks wrote no status file after the takeover


def test_a_killed_jobs_claim_refuses_a_new_run_and_is_taken_over_by_resume(tmp_path):
    """A job killed with -9 leaves its claim: a plain create of the run id is refused, naming the dead
    job; resume=K takes the claim over."""
    child = subprocess.Popen(
        [sys.executable, str(HELPERS / "record_child.py"), "kill", str(tmp_path), "k"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    child.send_signal(signal.SIGKILL)
    child.wait()
    with pytest.raises(
        RunExistsError,
        match=rf"^{tmp_path}/k already holds a run \(rank 0 claimed by pid {child.pid} "
        r"on host .*, started .*; \d+ file\(s\): .*\); pass resume=K",
    ):
        Recorder(tmp_path, run="k")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "resume=1 removed step 2", where the killed job had committed it
        rec = Recorder(tmp_path, run="k", resume=1)
    with rec:
        record_steps(rec, "R", [2], torch.Generator().manual_seed(0))
    held = json.loads(claim_path(storage.location(tmp_path / "k"), 0).read_bytes())
    assert held["nonce"] == rec._claim.nonce and held["pid"] != child.pid
    con = connect(tmp_path / "k")
    assert con.execute("SELECT DISTINCT text FROM sequences WHERE step = 2").fetchall() == [("writer R",)]


def test_ranks_of_two_jobs_never_share_a_run(tmp_path):
    """Rank 0 twice (two "nodes" both of world_size 1) is refused, and so are ranks whose world sizes
    disagree with the run's other claims; a finished run stays claimed."""
    a = Recorder(tmp_path, run="n", rank=0, world_size=1)
    with pytest.raises(
        RunExistsError,
        match=rf"n already holds a run \(rank 0 claimed by pid {os.getpid()} on host "
        r".*; 1 file\(s\): run\.json\)",
    ):
        Recorder(tmp_path, run="n", rank=0, world_size=1)
    a.close()
    with pytest.raises(RunExistsError, match=r"rank 0 claimed by pid \d+ .*run\.json"):
        Recorder(tmp_path, run="n")  # finished: still claimed
    two = Recorder(tmp_path, run="m", rank=0, world_size=2)
    with pytest.raises(
        RunExistsError,
        match=r"m already holds a run: its rank 0 is claimed by pid \d+ .* with "
        r"world_size 2, not 3",
    ):
        Recorder(tmp_path, run="m", rank=1, world_size=3)
    assert not claim_path(storage.location(tmp_path / "m"), 1).exists()  # the refused rank's claim is gone
    one = Recorder(tmp_path, run="q", rank=1, world_size=2)
    with pytest.raises(
        RunExistsError,
        match=r"q already holds a run: rank 1 is claimed by pid \d+ .*, beyond "
        r"world_size 1",
    ):
        Recorder(tmp_path, run="q", rank=0, world_size=1)
    two.close()
    one.close()


def test_of_two_jobs_taking_one_claim_over_at_once_one_is_refused(tmp_path):
    """A takeover is an exclusive create keyed by the claim it replaces: a job that finds that
    takeover made already (by a job that read the same claim an instant earlier) is refused."""
    from entropylens.record.run_dir.run_claim import _read_claim, _takeover_path

    loc = storage.location(tmp_path / "t")
    first = Claim.new(loc, 0, 1)
    claim(loc, 0, 1, overwrite=False, writer=first)
    racer = Claim.new(loc, 0, 1)
    assert _takeover_path(first.path, _read_claim(first.path)).create_exclusive(racer.data)  # it won the race
    with pytest.raises(
        RunExistsError,
        match=rf"rank 0 was taken over at the same moment by another job \(pid "
        rf"{os.getpid()} on host",
    ):
        claim(loc, 0, 1, overwrite=True, writer=Claim.new(loc, 0, 1))
    first.check()  # the claim itself is untouched: the racer rewrites it, not the refused job
