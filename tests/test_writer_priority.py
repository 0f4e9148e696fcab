"""The writer thread yields the cores to training: its own nice value is raised, the trainer's is not."""

import os
import sys

import pytest

from entropylens import Recorder
from entropylens import writer_thread

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
        assert _nice(tid) == max(writer_thread.WRITER_NICE, main_before)
        assert _nice(threading.get_native_id()) == main_before  # the training thread is untouched
    finally:
        rec.close()


def test_lower_priority_never_lowers_and_zero_disables():
    import threading

    done = {}

    def body():
        tid = threading.get_native_id()
        done["off"] = writer_thread.lower_priority(0)
        done["after_off"] = _nice(tid)
        writer_thread.lower_priority(5)
        done["five"] = _nice(tid)
        writer_thread.lower_priority(3)  # asking for a higher priority again is a no-op, not an error
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

    slow = writer_thread.WriterThread._on_update

    def on_update(self, *args):
        time.sleep(0.6)
        return slow(self, *args)

    monkeypatch.setattr(writer_thread.WriterThread, "_on_update", on_update)
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
    from entropylens.query import connect

    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone() == (24,)
