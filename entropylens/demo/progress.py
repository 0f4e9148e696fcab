"""Progress of a demo: live bars on a terminal, plain periodic lines anywhere else (CI logs, pipes).

Events (tuples, so they cross process boundaries): ("warm", label, done, total),
("start", run, 0, total), ("step", run, done, total, reward, entropy), ("done", run, total, total, seconds).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import TaskID


def make_progress(console=None, *, enabled: bool = True):
    """Bars when ``console`` (a rich Console; default one on stdout) is a terminal, else lines."""
    if not enabled:
        return Silent()
    from rich.console import Console

    console = console or Console()
    return Bars(console) if console.is_terminal else Lines(console.file)


class Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def header(self, text: str) -> None:
        pass

    def add(self, name: str, total: int, warmup: bool = False) -> None:
        pass

    def handle(self, event: tuple) -> None:
        pass


class Lines(Silent):
    """One line per event worth a line: a run's start and end, every 10% of its steps (and at
    least every ``every_s`` seconds), the warm-up at 0 / 25 / 50 / 75 / 100%. Flushed at once."""

    def __init__(self, stream=None, every_s: float = 10.0):
        self.stream = stream or sys.stdout
        self.every_s = every_s
        self.t0 = time.perf_counter()
        self.last: dict[str, float] = {}
        self.last_frac: dict[str, int] = {}

    def _say(self, text: str) -> None:
        self.stream.write(f"[{time.perf_counter() - self.t0:6.1f}s] {text}\n")
        self.stream.flush()

    def header(self, text: str) -> None:
        self._say(text)

    def handle(self, event: tuple) -> None:
        kind, name, done, total = event[:4]
        now = time.perf_counter()
        if kind == "warm":
            quarter = 4 * done // max(1, total)
            if done == 0 or quarter > self.last_frac.get(name, 0):
                self.last_frac[name] = quarter
                what = "done" if done >= total else f"step {done}/{total}"
                self._say(f"{name}: supervised pre-training before RL, {what}")
        elif kind == "start":
            self._say(f"{name}: started ({total} RL steps)")
            self.last[name] = now
        elif kind == "step":
            reward, entropy = event[4:6]
            every = max(1, total // 10)
            if done % every == 0 or done == total or now - self.last.get(name, self.t0) >= self.every_s:
                self.last[name] = now
                self._say(f"{name}: step {done}/{total}  reward {reward:.3f}  entropy {entropy:.3f}")
        elif kind == "done":
            self._say(f"{name}: finished {total} steps in {event[4]:.1f} s")


class Bars(Silent):
    """rich progress bars, one per warm-up and per run; runs wait at 0 until their worker starts."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.bar = Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def header(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def add(self, name: str, total: int, warmup: bool = False) -> None:
        info = "supervised pre-training before RL" if warmup else "waiting"
        self.tasks[name] = self.bar.add_task(name, total=total, info=info, start=warmup)

    def handle(self, event: tuple) -> None:
        kind, name, done, total = event[:4]
        t = self.tasks.get(name)
        if t is None:
            return
        if kind == "warm":
            info = "supervised pre-training before RL" if done < total else "warm-up done"
            self.bar.update(t, completed=done, info=info)
        elif kind == "start":
            self.bar.start_task(t)
            self.bar.update(t, info="first RL step (rollout, updates)")
        elif kind == "step":
            self.bar.update(t, completed=done, info=f"reward {event[4]:.3f}  entropy {event[5]:.3f}")
        elif kind == "done":
            self.bar.update(t, completed=total)
