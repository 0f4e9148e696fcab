"""Step metrics to experiment trackers: TensorBoard, Weights & Biases, Trackio, or any callable.

    with Recorder("runs", log_to="tensorboard") as rec:            # TensorBoard under runs/<run id>
    with Recorder("runs", log_to={"wandb": "my-project"}) as rec:  # W&B, project my-project
    with Recorder("runs", log_to=["trackio", my_fn]) as rec:       # Trackio and my_fn(step, metrics)

Each step's metrics are the names the TRL integration gives TRL's ``report_to`` trackers
(:data:`LOG_KEYS` as ``entropylens/<name>``, and ``entropylens/share_<quadrant>``: the step's token
share of each quadrant), made by ONE function, :func:`step_metrics`, from the writer's step summary
(``Recorder.step_summary``): token-weighted over the step's updates. The recorder logs step S at
step S (each tracker's own step argument) once the writer thread has answered its summary, without
the training thread waiting for it: answered steps are logged at the next recorder call, the rest at
``close()``. Only rank 0 logs. A tracker's package is imported only when that tracker is asked for;
a tracker that fails warns once and is left out from then on (training goes on).

``log_to`` takes a name, a tracker object, a callable ``f(step, metrics)``, a list of these, or a dict
``{name: option}`` where the option is the tracker's main setting (TensorBoard: the log directory;
W&B and Trackio: the project) or a dict of its keyword arguments.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable

from .schema import QUADRANTS, quadrant_slug

# the step aggregates logged as entropylens/<name> (TRL's report_to and Recorder(log_to=...))
LOG_KEYS = ("entropy_ratio_p05", "entropy_ratio_p50", "entropy_ratio_p95", "erc_drop_frac", "kl_k3",
            "clip_low_frac", "clip_high_frac", "clip_frac_pa_lp", "clip_frac_na_lp", "lgn_mean_pa_hp",
            "lgn_mean_pa_lp", "lgn_mean_na_hp", "lgn_mean_na_lp")
_QUADRANT_SLUGS = tuple(quadrant_slug(q) for q in QUADRANTS)  # pa_hp, pa_lp, na_hp, na_lp
SUMMARY_NAMES = LOG_KEYS + tuple(f"n_{q}" for q in _QUADRANT_SLUGS)  # what step_metrics reads (and n_tokens)
PREFIX = "entropylens/"


def step_metrics(summary: dict) -> dict[str, float]:
    """A step summary (``Recorder.step_summary``) as tracker metrics: ``entropylens/<name>`` for the
    :data:`LOG_KEYS` it has (NaN: not measured, left out) and ``entropylens/share_<quadrant>`` (the
    quadrant's share of the step's tokens). {} for a step without tokens."""
    logs = {f"{PREFIX}{k}": float(v) for k, v in summary.items() if k in LOG_KEYS and v == v}
    if summary.get("n_tokens"):
        for q in _QUADRANT_SLUGS:
            logs[f"{PREFIX}share_{q}"] = summary[f"n_{q}"] / summary["n_tokens"]
    return logs


class Tracker:
    """One destination of the step metrics. ``start`` is called once (with the recorder's run id and
    config), ``log(step, metrics)`` once per step in step order, ``close`` at ``Recorder.close()``."""

    name = "tracker"

    def start(self, run: str, config: dict) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Callback(Tracker):
    """Any callable ``f(step, metrics)``."""

    def __init__(self, fn: Callable[[int, dict], Any]):
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or repr(fn)

    def log(self, step, metrics):
        self.fn(step, metrics)


class TensorBoard(Tracker):
    """TensorBoard event files in ``logdir`` (default ``runs/<run id>``), written by the ``tensorboard``
    package's own event-file writer: one event per step holding every metric (a fraction of the cost
    of one ``add_scalar`` per metric on the training thread); its thread writes the file and flushes
    every ``flush_secs``."""

    name = "tensorboard"

    def __init__(self, logdir: str | os.PathLike | None = None, flush_secs: int = 10):
        self.logdir, self.flush_secs = logdir, flush_secs
        self.writer = None

    def start(self, run, config):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        logdir = str(self.logdir) if self.logdir is not None else os.path.join("runs", run)
        os.makedirs(logdir, exist_ok=True)
        self.writer = EventFileWriter(logdir, flush_secs=self.flush_secs)

    def log(self, step, metrics):
        value = self._summary.Value
        summary = self._summary(value=[value(tag=k, simple_value=v) for k, v in metrics.items()])
        self.writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self):
        if self.writer is not None:
            self.writer.close()


class WandB(Tracker):
    """Weights & Biases. Uses the active run (``wandb.run``) when there is one (and leaves it open);
    otherwise ``wandb.init(project=project, name=<run id>, config=<recorder config>, **init_kwargs)``
    and ``finish()`` at close. W&B's own settings apply (``WANDB_MODE=offline``, ``WANDB_PROJECT``,
    ``WANDB_DIR``, ...). Metrics go in at ``step=`` the entropylens step: W&B drops a step lower than
    one the run has logged already, so a loop logging the same run at another index should log through
    a callable instead (e.g. ``lambda s, m: run.log({**m, "el_step": s})``)."""

    name = "wandb"

    def __init__(self, project: str | None = None, **init_kwargs):
        self.project, self.kwargs = project, init_kwargs
        self.run, self.own = None, False

    def start(self, run, config):
        import wandb

        if wandb.run is not None:
            self.run = wandb.run
            return
        kwargs = {"name": run, "config": dict(config), **self.kwargs}
        if self.project is not None:
            kwargs["project"] = self.project
        self.run, self.own = wandb.init(**kwargs), True

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def close(self):
        if self.own and self.run is not None:
            self.run.finish()


class Trackio(Tracker):
    """Trackio (local SQLite under ``TRACKIO_DIR``, or a Space / server as trackio is set up). Uses the
    current trackio run when there is one (and leaves it open); otherwise ``trackio.init(project=project
    or "entropylens", name=<run id>, config=<recorder config>, **init_kwargs)`` and finishes it at close."""

    name = "trackio"

    def __init__(self, project: str | None = None, **init_kwargs):
        self.project, self.kwargs = project, init_kwargs
        self.run, self.own = None, False

    def start(self, run, config):
        import trackio
        from trackio import context_vars

        current = context_vars.current_run.get()
        if current is not None:
            self.run = current
            return
        kwargs = {"name": run, "config": dict(config), **self.kwargs}
        self.run = trackio.init(project=self.project or "entropylens", **kwargs)
        self.own = True

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def close(self):
        if not self.own or self.run is None:
            return
        from trackio import context_vars

        if context_vars.current_run.get() is self.run:
            import trackio

            trackio.finish()
        else:
            self.run.finish()


NAMED = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def _named(name: str, option=None) -> Tracker:
    key = name.lower()
    if key not in NAMED:
        raise ValueError(f"log_to: unknown tracker {name!r}; use one of {', '.join(NAMED)}, a trackers.Tracker, "
                         "or a callable f(step, metrics)")
    import importlib.util

    if importlib.util.find_spec(_PACKAGES[key]) is None:
        raise ImportError(f"log_to={name!r} needs the {_PACKAGES[key]} package: pip install {_PACKAGES[key]}")
    if option is None:
        return NAMED[key]()
    if isinstance(option, dict):
        return NAMED[key](**option)
    return NAMED[key](option)


def resolve(log_to) -> list[Tracker]:
    """``Recorder(log_to=...)`` as a list of trackers (not started)."""
    if log_to is None or log_to is False:
        return []
    if isinstance(log_to, dict):
        return [_named(k, v) for k, v in log_to.items()]
    if isinstance(log_to, (list, tuple)):
        return [t for x in log_to for t in resolve(x)]
    if isinstance(log_to, str):
        return [_named(log_to)]
    if isinstance(log_to, Tracker):
        return [log_to]
    if callable(log_to):
        return [Callback(log_to)]
    raise TypeError(f"log_to: expected a tracker name, a trackers.Tracker, a callable f(step, metrics), a list or "
                    f"a dict of these, got {type(log_to).__name__}")


class StepLog:
    """The recorder's side: step summaries asked for as steps close (``PendingSummary``-like replies),
    logged to every tracker in step order once answered. A tracker that raises warns once and is
    dropped."""

    def __init__(self, trackers: list[Tracker], run: str, config: dict):
        self.trackers: list[Tracker] = []
        self.waiting: list[tuple[int, Any]] = []  # (step, reply with .ready() / .result())
        for t in trackers:
            if self._call(t, "start", run, config):
                self.trackers.append(t)

    def _call(self, tracker: Tracker, what: str, *args) -> bool:
        try:
            getattr(tracker, what)(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            warnings.warn(f"entropylens: log_to tracker {tracker.name!r} failed in {what}() ({type(e).__name__}: "
                          f"{e}); it gets no more metrics", stacklevel=4)
            if tracker in self.trackers:
                self.trackers.remove(tracker)
            return False

    def add(self, step: int, reply) -> None:
        self.waiting.append((step, reply))

    def log_ready(self, wait: bool = False) -> None:
        """Log the answered summaries, in step order (all of them, waiting, with ``wait``)."""
        while self.waiting and (wait or self.waiting[0][1].ready()):
            step, reply = self.waiting.pop(0)
            metrics = step_metrics(reply.result())
            if metrics:
                for t in list(self.trackers):
                    self._call(t, "log", step, metrics)

    def close(self) -> None:
        for t in list(self.trackers):
            self._call(t, "close")
        self.trackers = []
