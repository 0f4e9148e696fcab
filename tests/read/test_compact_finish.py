"""`entropylens compact` finishes an interrupted compaction: a real `entropylens compact` process killed in
its --grace wait (commit written, originals still there) leaves the originals, and the next `compact`
removes them, leaving the files an uninterrupted compaction leaves and the same numbers per step. Hidden
temporaries of dead processes are removed; a live process's, or a running run's outside compacted/, are
kept."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from cli_calls import ok  # noqa: E402
from layout_run import make_run, write_step  # noqa: E402

from entropylens.read.compact import compact  # noqa: E402
from entropylens.read.query import connect  # noqa: E402

PER_STEP = """SELECT s.step, s.n, t.rows, t.h, q.seqs FROM
    (SELECT step, sum(n_tokens) AS n FROM steps GROUP BY step) AS s
    JOIN (SELECT step, count(*) AS rows, sum(entropy)::DOUBLE AS h FROM tokens GROUP BY step) AS t USING (step)
    JOIN (SELECT step, count(*) AS seqs FROM sequences GROUP BY step) AS q USING (step) ORDER BY step"""

# a process that writes one file through storage.Location.write_with and stays inside it (a writer or a
# compactor mid-file): prints "ready" once its hidden temporary exists
_WRITING = """
import sys, time
from entropylens.storage import location
def fill(tmp):
    with open(tmp, "wb") as f:
        f.write(b"PAR1 half a file")
    print("ready", flush=True)
    time.sleep(600)
location(sys.argv[1]).write_with(fill)
"""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _cli(*args) -> list[str]:
    return [sys.executable, "-c", "from entropylens.cli.main import main; main()", *map(str, args)]


def _killed_in_grace(root: Path, commit: Path) -> None:
    """Start `entropylens compact ROOT --grace 600`, wait until its commit file lands, kill it (SIGKILL)."""
    proc = subprocess.Popen(
        _cli("compact", root, "--grace", "600"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300
        while not commit.exists():
            assert proc.poll() is None, "compact ended before its commit"
            assert time.monotonic() < deadline, "no commit file"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def _writer(dest: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WRITING, str(dest)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _temps(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".*.tmp"))


def test_a_compaction_killed_in_its_grace_wait_is_finished_by_the_next(tmp_path):
    killed, twin = tmp_path / "killed", tmp_path / "twin"
    for root in (killed, twin):
        make_run(root, "a", steps=120, rows=64)
    before = connect(killed).execute(PER_STEP).fetchall()
    assert len(before) == 120
    commit = killed / "a" / "compacted" / "steps" / "steps-0-119.parquet"
    _killed_in_grace(killed, commit)
    left = _files(killed)
    assert len([f for f in left if "/compacted/" not in f and f.endswith(".parquet")]) == 360  # originals kept
    assert connect(killed).execute(PER_STEP).fetchall() == before  # readers: the compacted files, once
    compact(twin, grace_s=0)  # what an uninterrupted compaction leaves
    line = ok("compact", killed, "--grace", "0").strip()
    assert line == "a: finished the interrupted compaction of steps 0-119: 360 superseded originals removed"
    assert _files(killed) == _files(twin)
    assert len(_files(killed)) == 4  # run.json and the three compacted files
    assert connect(killed).execute(PER_STEP).fetchall() == before
    assert ok("compact", killed, "--grace", "0").strip() == "a: nothing to compact (no final uncompacted step)"


def test_the_rest_of_the_grace_is_waited_for(tmp_path):
    """The grace counts from the interrupted compaction's commit: with a commit written just now the next
    compact waits before removing the originals (a query planned before the commit finishes); with a
    commit written longer than --grace ago it removes them at once."""
    make_run(tmp_path, "a", steps=4, rows=16)
    commit = tmp_path / "a" / "compacted" / "steps" / "steps-0-3.parquet"
    _killed_in_grace(tmp_path, commit)
    proc = subprocess.Popen(
        _cli("compact", tmp_path, "--grace", "600"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr.readline().startswith("compacting: ")  # started; removing 12 files takes ms
        time.sleep(1)
        assert proc.poll() is None
        assert len(list((tmp_path / "a" / "tokens").rglob("*.parquet"))) == 4
    finally:
        proc.kill()
        proc.wait()
    old = time.time() - 601
    os.utime(commit, (old, old))
    line = ok("compact", tmp_path, "--grace", "600")  # no wait left
    assert "finished the interrupted compaction of steps 0-3: 12 superseded originals removed" in line
    assert not list((tmp_path / "a").glob("[!c]*/**/*.parquet"))  # only compacted/ holds Parquet files


@pytest.mark.parametrize("status", ["finished", "running"])
def test_stale_temporaries_of_dead_processes_are_removed(tmp_path, status):
    """Temporaries of killed writers (a token file) and of a killed compactor (a compacted part) are
    removed; a live writer's is kept in every case, and in a running run a dead process's temporary
    outside compacted/ is kept too (its writer may be on another host)."""
    d = make_run(tmp_path, "a", steps=3, rows=16, status=status)
    d = Path(str(d))
    dead_writer = _writer(d / "tokens" / "step=1" / "rank=0" / "update-1.parquet")
    dead_compactor = _writer(d / "compacted" / "tokens" / "steps-0-2.part-0.parquet")
    live = _writer(d / "tokens" / "step=2" / "rank=0" / "update-1.parquet")
    try:
        for p in (dead_writer, dead_compactor):
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        temps = _temps(d)
        assert len(temps) == 3 and all(
            str(live.pid) in t.name or str(dead_writer.pid) in t.name or str(dead_compactor.pid) in t.name
            for t in temps
        )
        res = compact(tmp_path, grace_s=0)
        left = _temps(d)
        assert [t for t in left if f".{live.pid}." in t.name]  # the live writer's: never touched
        assert not [t for t in left if f".{dead_compactor.pid}." in t.name]
        kept_dead = [t for t in left if f".{dead_writer.pid}." in t.name]
        assert bool(kept_dead) == (status == "running")
        assert res[0].temps == (1 if status == "running" else 2)
        assert f"{res[0].temps} stale temporary file" in res[0].summary()
    finally:
        live.kill()
        live.wait()


def test_only_files_the_commit_holds_are_removed(tmp_path):
    """A file in a committed range whose (step, rank) the commit does not hold (rank 1 of a 1-rank run,
    written after the compaction) is not removed when the interrupted compaction is finished: its rows
    are in no compacted file. A warning names it; the others are removed."""
    from entropylens.read.compact import StepLeftAloneWarning

    make_run(tmp_path, "a", steps=4, rows=16)
    _killed_in_grace(tmp_path, tmp_path / "a" / "compacted" / "steps" / "steps-0-3.parquet")
    write_step(tmp_path / "a", 1, 1, 16, commit=False)
    stray = sorted((tmp_path / "a").glob("*/step=1/rank=1/*.parquet"))
    assert len(stray) == 2
    with pytest.warns(StepLeftAloneWarning, match="rank=1") as caught:
        res = compact(tmp_path, grace_s=0)
    assert len([w for w in caught if issubclass(w.category, StepLeftAloneWarning)]) == 2
    assert res[0].removed == 12 and all(p.exists() for p in stray)
    assert not list((tmp_path / "a").glob("*/step=*/rank=0/*.parquet"))
