"""The writer thread yields the cores to training: it runs under SCHED_IDLE at nice 19, the trainer's
thread is untouched; a writer that busy cores starve is handed to a nice-19 thread, in order, losing nothing."""

import os
import sys

import pytest

from entropylens import Recorder
from entropylens.record.writing import file_work, scheduling
from entropylens.record.writing import thread as writer_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_writer_thread_runs_at_lower_priority_than_the_trainer(tmp_path):
    import threading

    main_before = _nice(threading.get_native_id())
    rec = Recorder(tmp_path, "r")
    try:
        rec._writer.drain()  # the thread has started and handled a message: its priority is set
        tid = rec._writer._thread.native_id
        assert _nice(tid) == max(scheduling.WRITER_NICE, main_before)
        assert _nice(threading.get_native_id()) == main_before  # the training thread is untouched
    finally:
        rec.close()


def test_lower_priority_never_lowers_and_zero_disables():
    import threading

    done = {}

    def body():
        tid = threading.get_native_id()
        done["off"] = scheduling.lower_priority(0)
        done["after_off"] = _nice(tid)
        scheduling.lower_priority(5)
        done["five"] = _nice(tid)
        scheduling.lower_priority(3)  # asking for a higher priority again is a no-op, not an error
        done["three"] = _nice(tid)

    base = _nice(threading.get_native_id())
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert done["off"] is False and done["after_off"] == base
    assert done["five"] == max(5, base) and done["three"] == max(5, base)
    assert _nice(threading.get_native_id()) == base


def test_a_long_back_pressure_wait_warns_once_and_drops_nothing(tmp_path, monkeypatch):
    # a writer that cannot keep up (here: 0.6 s per update, as a starved nice-19 thread on busy cores)
    # makes the training loop wait on the full queue; past BACKPRESSURE_WARN_S one warning says why and
    # what to change; every update still arrives
    import time
    import warnings

    import torch

    slow = file_work.FileWork.update

    def on_update(self, *args):
        time.sleep(0.6)
        return slow(self, *args)

    monkeypatch.setattr(file_work.FileWork, "update", on_update)
    monkeypatch.setattr(writer_thread, "BACKPRESSURE_WARN_S", 0.5)
    lp = torch.zeros(2, 3)
    kw = dict(mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="r", queue_size=1) as rec:
            for step in range(4):
                rec.record_update(step, 0, **kw)  # each new step hands the previous one over
    waits = [w for w in caught if "for the writer thread" in str(w.message)]
    assert len(waits) == 1
    assert "queue of 1 hand-overs is full" in str(waits[0].message)
    assert "ENTROPYLENS_WRITER_NICE=0" in str(waits[0].message)
    assert waits[0].filename == __file__  # it names the caller's line, not the recorder's
    from entropylens.read.query import connect

    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone() == (24,)


needs_idle = pytest.mark.skipif(
    not scheduling.WRITER_IDLE or not hasattr(os, "SCHED_IDLE"),
    reason="SCHED_IDLE writer switched off or not available",
)


@needs_idle
def test_writer_thread_runs_under_sched_idle_and_the_trainer_does_not(tmp_path):
    import threading

    rec = Recorder(tmp_path, "r")
    try:
        rec._writer.drain()
        assert os.sched_getscheduler(rec._writer._thread.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        assert not rec._writer.rescued
    finally:
        rec.close()


def _record(rec, step, updates):
    import torch

    lp = torch.full((2, 3), -1.0)
    for u in range(updates):
        rec.record_update(
            step,
            u,
            mask=torch.ones(2, 3, dtype=torch.bool),
            advantages=torch.tensor([1.0, -1.0]),
            logprobs=lp,
            old_logprobs=lp,
            seq_ids=torch.tensor([2 * u, 2 * u + 1]),
        )


def test_a_rescue_in_the_middle_of_a_hand_over_keeps_every_message_in_order(tmp_path, monkeypatch):
    # the rescue thread goes on from the message after the one the idle thread was handling: every
    # update arrives once, in order, and the idle thread's part and the rescue thread's part add up
    import threading

    handled = []
    original = file_work.FileWork.update

    writers = []

    def on_update(self, m):
        handled.append((m.update, threading.current_thread().name))
        original(self, m)
        if m.update == 2 and not writers[0].rescued:
            writers[0]._rescue()  # as a waiting caller would, while this thread is busy with update 2

    monkeypatch.setattr(file_work.FileWork, "update", on_update)
    with Recorder(tmp_path, run="r") as rec:
        writers.append(rec._writer)
        _record(rec, 0, 6)
        rec.commit()  # one hand-over: updates 0-5 and the close
        writer = rec._writer
        assert writer.rescued and writer._thread.name.endswith("-rescue") and writer.alive
        _record(rec, 1, 2)  # the rescue thread handles what comes later
    assert [u for u, _ in handled] == [0, 1, 2, 3, 4, 5, 0, 1]
    assert {name.endswith("-rescue") for u, name in handled[:3]} == {False}
    assert {name.endswith("-rescue") for u, name in handled[3:]} == {True}
    assert writer.cpu_seconds > 0 and not writer.alive
    from entropylens.read.query import connect

    con = connect(tmp_path)
    assert con.execute("SELECT step, count(*) FROM tokens GROUP BY step ORDER BY step").fetchall() == [(0, 36), (1, 12)]
    assert con.execute("SELECT count(*) FROM steps").fetchone() == (8,)


def test_check_starved_rescues_only_a_runnable_writer_that_did_not_run(tmp_path, monkeypatch):
    # starved = runnable (state R) and under STARVED_SHARE of a core between two checks; a writer blocked
    # on I/O (not runnable) or one that ran is left alone. The kernel's side is the next test's
    import time

    cpu = {"t": 0.0}
    monkeypatch.setattr(scheduling, "idle_policy", lambda tid: True)
    monkeypatch.setattr(scheduling, "thread_cpu", lambda thread: cpu["t"])
    with Recorder(tmp_path, run="r") as rec:
        w = rec._writer
        for is_runnable, ran, expect in ((False, 0.0, False), (True, 0.2, False), (True, 0.0, True)):
            monkeypatch.setattr(scheduling, "runnable", lambda thread, r=is_runnable: r)
            w._starvation = scheduling.StarvationCheck()
            w.check_starved()  # the first sample opens the window
            time.sleep(scheduling.RESCUE_CHECK_S)
            cpu["t"] += ran  # 0.2 s of CPU in a 0.25 s window: it ran
            w.check_starved()
            assert w.rescued is expect, (is_runnable, ran)
        _record(rec, 0, 2)
    from entropylens.read.query import connect

    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone() == (12,)


@needs_idle
def test_a_writer_starved_by_busy_cores_is_rescued_and_nothing_is_lost(tmp_path):
    # real scheduler: one busy process per core at normal priority leaves a SCHED_IDLE thread almost no
    # CPU; the commit waits, finds the writer starved, and a nice-19 thread takes over
    import subprocess

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(os.sched_getaffinity(0)))]
    try:
        with Recorder(tmp_path, run="r") as rec:
            for step in range(3):
                _record(rec, step, 2)
            rec.commit()
            w = rec._writer
            assert w.rescued
            tid = w._thread.native_id
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER and _nice(tid) == max(scheduling.WRITER_NICE, 0)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    from entropylens.read.query import connect

    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone() == (36,)
