"""Keep the recorder's background thread out of torch's OpenMP thread pools.

A torch op that goes parallel on a thread starts an OpenMP team for that thread (MKL's GEMMs start one
of MKL's own thread count, even for a [2, 512] x [512, 7] product). GNU OpenMP counts
every team's threads, and once they outnumber the cores it stops spin-waiting between parallel
regions: the training thread's own team then sleeps after each region and is woken by a futex at the
next one (its effect on a step was within the benchmarks' noise here; the extra team itself is what
tests/record/test_writer_threads.py checks). :func:`serial_torch_ops` sets the calling thread's OpenMP thread count to 1 (``omp_set_num_threads``
is per thread) and, where torch's CPU library exports MKL's service functions, MKL's per-thread count
(``MKL_Set_Num_Threads_Local``) too, so its torch ops run serially and it never makes a team. ``torch.set_num_threads(1)``
would not do: it also changes the process-wide count that every thread torch initialises later reads.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_OPENMP_LIBS = ("libgomp", "libiomp", "libomp")


@functools.lru_cache(maxsize=1)
def _openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (Linux: found in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(name in line for name in _OPENMP_LIBS)}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads  # noqa: B018 - the symbol must exist
            return lib
        except (OSError, AttributeError):
            continue
    return None


def serial_torch_ops() -> bool:
    """Make the calling thread's torch CPU ops single-threaded, without touching other threads'
    settings. True when done (Linux with torch's OpenMP runtime); False where it is not available."""
    lib = _openmp_library()
    if lib is None:
        return False
    torch.get_num_threads()  # torch's per-thread lazy init runs now (it would later reset the count)
    lib.omp_set_num_threads(1)
    mkl = _mkl_service()
    if mkl is not None:
        mkl.MKL_Set_Num_Threads_Local(1)  # this thread only (C interface: the count by value)
        if mkl.MKL_Get_Max_Threads() != 1:
            return False
    return torch.get_num_threads() == 1


@functools.lru_cache(maxsize=1)
def _mkl_service() -> ctypes.CDLL | None:
    """torch's CPU library when it exports MKL's C service functions (x86 wheels link MKL into it)."""
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*")):
        try:
            lib = ctypes.CDLL(path)
            lib.MKL_Set_Num_Threads_Local, lib.MKL_Get_Max_Threads  # noqa: B018 - both must exist
            return lib
        except (OSError, AttributeError):
            continue
    return None
