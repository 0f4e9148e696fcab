"""The writer thread never starts an OpenMP team of its own (entropylens/record/writing/openmp.py)."""

import os
import sys
import threading

import pytest
import torch

from entropylens import Recorder
from entropylens.record.writing.openmp import serial_torch_ops

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread OpenMP counts: Linux")


def _native_threads() -> set[int]:
    """Thread ids of this process that Python did not start (OpenMP / MKL workers, ...)."""
    mine = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - mine


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn()))
    t.start()
    t.join()
    return box["v"]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # the main thread's team exists
    yield
    torch.set_num_threads(before)


def test_serial_torch_ops_is_per_thread_and_starts_no_team(two_threads):
    def body():
        if not serial_torch_ops():
            pytest.skip("no OpenMP runtime found for torch here")
        before = _native_threads()
        torch.randn(2, 512) @ torch.randn(512, 7)  # an MKL GEMM: would start a team of MKL's size
        (torch.randn(512, 512) @ torch.randn(512, 512)).exp().sum()
        return torch.get_num_threads(), _native_threads() - before

    count, new_threads = _in_thread(body)
    assert count == 1 and new_threads == set()
    assert torch.get_num_threads() == 2  # the calling (training) thread keeps its count
    # a thread started afterwards still gets the process's count (torch's global was not touched)
    assert _in_thread(torch.get_num_threads) == 2


def test_without_it_a_thread_starts_its_own_team(two_threads):
    # the control: the same GEMM on a plain thread does start worker threads (so the test above can fail)
    def body():
        before = _native_threads()
        torch.randn(2, 512) @ torch.randn(512, 7)
        (torch.randn(512, 512) @ torch.randn(512, 512)).exp().sum()  # the small GEMM alone may stay serial
        return _native_threads() - before

    assert _in_thread(body) != set()


def _record_one_step(root, run: str, check=None):
    from entropylens.rl.losses import policy_loss

    b, t = 8, 6
    with Recorder(root, run=run) as rec:
        for u in range(2):
            lp = -torch.rand(b, t)
            m = torch.ones(b, t, dtype=torch.bool)
            out = policy_loss(lp, lp - 0.01, torch.randn(b), m, entropy=torch.rand(b, t), old_entropy=torch.rand(b, t))
            rec.record_update(
                0,
                u,
                mask=m,
                advantages=torch.randn(b),
                logprobs=lp,
                old_logprobs=lp - 0.01,
                seq_ids=torch.arange(b) + b * u,
                loss=out,
            )
        rec.step_summary(0)  # the writer thread has built the blocks (aggregates: GEMMs on the CPU)
        if check is not None:
            check()


def test_the_recorders_writer_thread_leaves_no_worker_threads(two_threads, tmp_path):
    # a first recorder starts what the process keeps for good (pyarrow's and the Parquet writer's pools grow
    # on first use, more so when the machine is busy); its writer thread has ended. A second recorder's new
    # writer thread would start an OpenMP team of its own (the control test below: a new thread's team is
    # new threads), so a thread appearing now is one it started.
    _record_one_step(tmp_path, "warm")
    before = _native_threads()
    _record_one_step(tmp_path, "r", check=lambda: _check_no_new(before))


def _check_no_new(before):
    assert _native_threads() - before == set()
