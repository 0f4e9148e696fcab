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
