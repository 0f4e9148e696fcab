"""Wall time of `entropylens demo` (the default unless --steps / --quick), by default vs forced to one
thread (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1), alternating, optionally with busy processes on the
cores (issue #13: under load the default must be no slower than forced one-thread, <= 1.2x). Asserts
nothing about time.

Per run: wall seconds, the demo's own phase times (its `time:` line: start, warm-up + training,
report, summary, process) and the user + sys CPU seconds of the demo's whole process tree: on Linux
this process is a child subreaper (prctl), so the fork server and its workers, orphaned when the demo
exits, are reaped here and their CPU counted (elsewhere only the demo's own process and its waited-for
children). The load average before each run is printed: a wall time is only a quiet
measurement when the 1-minute load is below ~0.5 (a `nice -n 19` job takes only idle CPU, and
shows in the load average all the same).

  python benchmarks/demo_speed.py [--repeats 2] [--busy 3] [--modes default,one-thread] [-- DEMO ARGS...]
Last line: ratio=<median default wall / median one-thread wall>
"""

import argparse
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def _subreaper() -> bool:
    """Become a child subreaper (Linux): orphaned descendants (the demo's fork server and workers) are
    re-parented to this process, so their CPU reaches RUSAGE_CHILDREN once reaped."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _reap_orphans(keep: set[int], timeout: float = 30.0) -> None:
    """Wait for this process's children other than ``keep`` (the busy processes) to exit and reap them."""
    me, end = os.getpid(), time.monotonic() + timeout
    while time.monotonic() < end:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
        left = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in keep:
                try:
                    with open(f"/proc/{d}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            left.append(d)
                except (OSError, ValueError, IndexError):
                    pass
        if not left:
            return
        time.sleep(0.05)


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def one_demo(mode: str, extra: list[str], keep: set[int] = frozenset()) -> dict:
    env = dict(os.environ)
    if mode == "one-thread":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "entropylens.cli.main", "demo", "--out", out, *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out, start_new_session=True
        )  # its own process group: stopped whole, workers too
        try:
            stdout, stderr = proc.communicate()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.perf_counter() - t0
        res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        if SUBREAPER:
            _reap_orphans(set(keep))  # the fork server and its workers: their CPU too
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode:
        raise SystemExit(f"demo failed ({mode}): {res.stderr.strip().splitlines()[-1:]}")
    line = next((x for x in res.stdout.splitlines() if x.startswith("time: ")), "")
    phases = {k: float(v) for k, v in re.findall(r"([a-z +-]+?) ([0-9.]+) s", line.removeprefix("time: "))}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dict(mode=mode, wall=wall, cpu=cpu, load=load, phases=phases)


SUBREAPER = False


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (default 2)")
    ap.add_argument("--busy", type=int, default=0, help="busy processes (python 'while 1: pass') during the runs")
    ap.add_argument("--modes", default="default,one-thread", help="comma-separated: default, one-thread")
    ap.add_argument("demo_args", nargs="*", help="arguments for `entropylens demo` after --, e.g. -- --steps 120")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill PID` still stops the busy processes
    global SUBREAPER
    SUBREAPER = sys.platform.startswith("linux") and _subreaper()
    busy = busy_processes(a.busy)
    walls: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for i in range(a.repeats):
            for m in modes if i % 2 == 0 else modes[::-1]:  # alternate the order
                r = one_demo(m, a.demo_args, {p.pid for p in busy})
                walls[m].append(r["wall"])
                ph = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
                print(
                    f"{m:10s} wall {r['wall']:6.1f} s  tree cpu {r['cpu']:6.1f} s  load1 before {r['load']:.2f}  "
                    f"busy {a.busy}  phases: {ph}",
                    flush=True,
                )
    finally:
        for p in busy:  # only the processes started here, by pid
            p.kill()
            p.wait()
    med = {m: statistics.median(w) for m, w in walls.items()}
    print("medians: " + ", ".join(f"{m} {v:.1f} s" for m, v in med.items()))
    if "default" in med and "one-thread" in med:
        print(f"ratio={med['default'] / med['one-thread']:.3f}")


if __name__ == "__main__":
    main()
