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

Beyond the scalars, in the same call per step (``Tracker.write``):
  histograms  ``entropylens/hist/entropy_ratio`` (rho of every masked-in token) and
              ``entropylens/hist/ratio_<quadrant>`` (r = exp(logprob - old_logprob) of the quadrant's tokens),
              exact over all the step's masked-in tokens, counted on the writer thread per update: 32
              log-spaced bins over [0.5, 2] plus an underflow (< 0.5) and an overflow (>= 2) bin, drawn one
              bin wide (step_table.HIST_EDGES, StepHistogram). A histogram without tokens is left out.
              Payload per step (5 histograms, all 34 bins filled; :data:`PAYLOAD_BYTES`): TensorBoard 3.2 KB
              of HistogramProto, W&B 3.4 KB and Trackio 3.5 KB of JSON.
  table       ``entropylens/tokens`` every ``log_table_every`` steps (0: never): 64 of the step's token rows
              (step_table.TABLE_COLUMNS), a uniform sample seeded by the step (the same rows for the same
              run), to the trackers with tables (W&B ``wandb.Table``, Trackio ``trackio.Table``; up to 8 KB).
And ``Tracker.alert`` at each live alarm finding (``Recorder(alarms=...)``): W&B ``run.alert``, Trackio
``run.alert`` (level ERROR for a ``stop_on`` rule, else WARN); TensorBoard a text summary
``entropylens/alarms`` at the finding's step.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from ..schema import QUADRANTS, quadrant_slug
from .writing.step_table import HISTOGRAMS_KEY, TABLE_KEY, StepHistogram, TokenTable

# the step aggregates logged as entropylens/<name> (TRL's report_to and Recorder(log_to=...))
LOG_KEYS = (
    "entropy_ratio_p05",
    "entropy_ratio_p50",
    "entropy_ratio_p95",
    "erc_drop_frac",
    "kl_k3",
    "clip_low_frac",
    "clip_high_frac",
    "clip_frac_pa_lp",
    "clip_frac_na_lp",
    "lgn_mean_pa_hp",
    "lgn_mean_pa_lp",
    "lgn_mean_na_hp",
    "lgn_mean_na_lp",
)
_QUADRANT_SLUGS = tuple(quadrant_slug(q) for q in QUADRANTS)  # pa_hp, pa_lp, na_hp, na_lp
SUMMARY_NAMES = LOG_KEYS + tuple(f"n_{q}" for q in _QUADRANT_SLUGS)  # what step_metrics reads (and n_tokens)
PREFIX = "entropylens/"
HIST_PREFIX = PREFIX + "hist/"  # entropylens/hist/<step_table.HISTOGRAMS name>
TABLE_NAME = PREFIX + "tokens"
EXTRA_NAMES = (HISTOGRAMS_KEY, TABLE_KEY)  # summary names that ask the writer for the histograms and the table
# bytes per step, the 5 histograms with every bin filled (tests/record/test_trackers.py measures them): TensorBoard's
# HistogramProto values in the event; W&B's and Trackio's JSON of them; one token table as W&B stores it (JSON)
PAYLOAD_BYTES = {"tensorboard": 3200, "wandb": 3450, "trackio": 3500, "table": 8000}


def step_metrics(summary: dict) -> dict[str, float]:
    """A step summary (``Recorder.step_summary``) as tracker metrics: ``entropylens/<name>`` for the
    :data:`LOG_KEYS` it has (NaN: not measured, left out) and ``entropylens/share_<quadrant>`` (the
    quadrant's share of the step's tokens). {} for a step without tokens."""
    logs = {f"{PREFIX}{k}": float(v) for k, v in summary.items() if k in LOG_KEYS and v == v}
    if summary.get("n_tokens"):
        for q in _QUADRANT_SLUGS:
            logs[f"{PREFIX}share_{q}"] = summary[f"n_{q}"] / summary["n_tokens"]
    return logs


def alert_text(finding, stop_on=()) -> tuple[str, str, str]:
    """(title, text, level) of a tracker's alert for an ``alarms.Finding``: level ERROR for a ``stop_on``
    rule (training stops), WARN otherwise."""
    stop = finding.rule in stop_on
    text = finding.line() + (" (a stop_on rule: training stops)" if stop else "")
    return f"entropylens alarm: {finding.rule}", text, "ERROR" if stop else "WARN"


class Tracker:
    """One destination of the step metrics. ``start`` is called once (with the recorder's run id and
    config), ``write(step, metrics, histograms, table)`` once per step in step order (the default calls
    ``log(step, metrics)``: a subclass may override either), ``alert(title, text, level, step)`` at each
    live alarm finding (default: nothing), ``close`` at ``Recorder.close()``. ``has_tables``: the tracker
    takes the token table."""

    name = "tracker"
    has_tables = False

    def start(self, run: str, config: dict) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def write(
        self, step: int, metrics: dict[str, float], histograms: dict[str, StepHistogram], table: TokenTable | None
    ) -> None:
        """``histograms``: full name (``entropylens/hist/...``) -> StepHistogram; ``table``: the step's
        token table on table steps (else None)."""
        if metrics:
            self.log(step, metrics)

    def alert(self, title: str, text: str, level: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


# Recorder(log_to=...): a tracker's name, a Tracker, a callable f(step, metrics); a list of these; {name: option}
TrackerLike: TypeAlias = str | Tracker | Callable[[int, dict[str, float]], Any]
LogTo: TypeAlias = TrackerLike | Sequence[TrackerLike] | Mapping[str, Any]


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
        self.writer: Any = None  # tensorboard's EventFileWriter (the package has no type information)

    def start(self, run, config):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._histo = Event, Summary, HistogramProto
        logdir = str(self.logdir) if self.logdir is not None else os.path.join("runs", run)
        os.makedirs(logdir, exist_ok=True)
        self.writer = EventFileWriter(logdir, flush_secs=self.flush_secs)

    def log(self, step, metrics):
        self.write(step, metrics, {}, None)

    def write(self, step, metrics, histograms, table):
        """One event: the scalars (simple_value) and the histograms (HistogramProto: the bins from the first
        to the last non-empty one, StepHistogram.buckets). No table (TensorBoard has none)."""
        value = self._summary.Value
        values = [value(tag=k, simple_value=v) for k, v in metrics.items()]
        for tag, h in histograms.items():
            lo, hi, limits, counts = h.buckets()
            values.append(
                value(
                    tag=tag,
                    histo=self._histo(
                        min=lo,
                        max=hi,
                        num=h.num,
                        sum=h.total,
                        sum_squares=h.sum_squares,
                        bucket_limit=limits,
                        bucket=counts,
                    ),
                )
            )
        if values:
            self.writer.add_event(
                self._event(wall_time=time.time(), step=int(step), summary=self._summary(value=values))
            )

    def alert(self, title, text, level, step):
        """A text summary ``entropylens/alarms`` at the finding's step (TensorBoard's Text tab)."""
        self.writer.add_event(
            self._event(
                wall_time=time.time(),
                step=int(step),
                summary=self._summary(value=[text_value(f"{PREFIX}alarms", f"{level}: {text}")]),
            )
        )

    def close(self):
        if self.writer is not None:
            self.writer.close()


def text_value(tag: str, text: str):
    """A TensorBoard text summary value (the text plugin's metadata and a string tensor), no TensorFlow."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.types_pb2 import DT_STRING

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    return Summary.Value(tag=tag, metadata=meta, tensor=TensorProto(dtype=DT_STRING, string_val=[text.encode()]))


def _payload(metrics: dict, histograms: dict, table, make_hist, make_table, prefix: str = "") -> dict:
    """One log call's dict for W&B / Trackio: the scalars, each histogram as ``make_hist(np_histogram=)``,
    the table as ``make_table(columns=, data=)``; names under ``prefix`` (TRL's ``train/``)."""
    out = {prefix + k: v for k, v in metrics.items()}
    out.update((prefix + k, make_hist(np_histogram=h.np_histogram())) for k, h in histograms.items())
    if table is not None:
        out[prefix + TABLE_NAME] = make_table(columns=list(table.columns), data=table.rows)
    return out


class WandB(Tracker):
    """Weights & Biases. Uses the active run (``wandb.run``) when there is one (and leaves it open);
    otherwise ``wandb.init(project=project, name=<run id>, config=<recorder config>, **init_kwargs)``
    and ``finish()`` at close. W&B's own settings apply (``WANDB_MODE=offline``, ``WANDB_PROJECT``,
    ``WANDB_DIR``, ...). Metrics go in at ``step=`` the entropylens step: W&B drops a step lower than
    one the run has logged already, so a loop logging the same run at another index should log through
    a callable instead (e.g. ``lambda s, m: run.log({**m, "el_step": s})``)."""

    name = "wandb"
    has_tables = True

    def __init__(self, project: str | None = None, **init_kwargs):
        self.project, self.kwargs = project, init_kwargs
        self.run: Any = None  # the wandb run (the package has no type information)
        self.own = False

    def start(self, run, config):
        import wandb

        self._wandb = wandb
        if wandb.run is not None:
            self.run = wandb.run
            return
        kwargs = {"name": run, "config": dict(config), **self.kwargs}
        if self.project is not None:
            kwargs["project"] = self.project
        self.run, self.own = wandb.init(**kwargs), True

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def write(self, step, metrics, histograms, table):
        """One ``run.log`` per step: the scalars, ``wandb.Histogram(np_histogram=(counts, edges))`` each,
        the table as a ``wandb.Table``."""
        payload = _payload(metrics, histograms, table, self._wandb.Histogram, self._wandb.Table)
        if payload:
            self.run.log(payload, step=step)

    def alert(self, title, text, level, step):
        self.run.alert(title=title, text=text, level=level)

    def close(self):
        if self.own and self.run is not None:
            self.run.finish()


class Trackio(Tracker):
    """Trackio (local SQLite under ``TRACKIO_DIR``, or a Space / server as trackio is set up). Uses the
    current trackio run when there is one (and leaves it open); otherwise ``trackio.init(project=project
    or "entropylens", name=<run id>, config=<recorder config>, **init_kwargs)`` and finishes it at close."""

    name = "trackio"
    has_tables = True

    def __init__(self, project: str | None = None, **init_kwargs):
        self.project, self.kwargs = project, init_kwargs
        self.run: Any = None  # the trackio run (the package has no type information)
        self.own = False

    def start(self, run, config):
        import trackio
        from trackio import context_vars

        self._trackio = trackio
        current = context_vars.current_run.get()
        if current is not None:
            self.run = current
            return
        kwargs = {"name": run, "config": dict(config), **self.kwargs}
        self.run = trackio.init(project=self.project or "entropylens", **kwargs)
        self.own = True

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def write(self, step, metrics, histograms, table):
        """One ``run.log`` per step: the scalars, ``trackio.Histogram(np_histogram=(counts, edges))`` each,
        the table as a ``trackio.Table``."""
        payload = _payload(metrics, histograms, table, self._trackio.Histogram, self._trackio.Table)
        if payload:
            self.run.log(payload, step=step)

    def alert(self, title, text, level, step):
        self.run.alert(title=title, text=text, level=self._trackio.AlertLevel(level.lower()), step=step)

    def close(self):
        if not self.own or self.run is None:
            return
        from trackio import context_vars

        if context_vars.current_run.get() is self.run:
            import trackio

            trackio.finish()
        else:
            self.run.finish()


NAMED: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def _named(name: str, option=None) -> Tracker:
    key = name.lower()
    if key not in NAMED:
        raise ValueError(
            f"log_to: unknown tracker {name!r}; use one of {', '.join(NAMED)}, a trackers.Tracker, "
            "or a callable f(step, metrics)"
        )
    import importlib.util

    if importlib.util.find_spec(_PACKAGES[key]) is None:
        raise ImportError(f"log_to={name!r} needs the {_PACKAGES[key]} package: pip install {_PACKAGES[key]}")
    if option is None:
        return NAMED[key]()
    if isinstance(option, dict):
        return NAMED[key](**option)
    return NAMED[key](option)


def resolve(log_to: LogTo | None) -> list[Tracker]:
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
    raise TypeError(
        f"log_to: expected a tracker name, a trackers.Tracker, a callable f(step, metrics), a list or "
        f"a dict of these, got {type(log_to).__name__}"
    )


class StepLog:
    """The recorder's side: step summaries asked for as steps close (``PendingSummary``-like replies),
    logged to every tracker in step order once answered. A tracker that raises warns once and is
    dropped. ``step_offset``: step S is logged at S + step_offset (TRL: 1, its global_step)."""

    def __init__(self, trackers: list[Tracker], run: str, config: dict, step_offset: int = 0):
        self.trackers: list[Tracker] = []
        self.waiting: list[tuple[int, Any]] = []  # (step, reply with .ready() / .result())
        self.step_offset = step_offset
        for t in trackers:
            if self._call(t, "start", run, config):
                self.trackers.append(t)

    @property
    def has_tables(self) -> bool:
        return any(t.has_tables for t in self.trackers)

    def _call(self, tracker: Tracker, what: str, *args) -> bool:
        try:
            getattr(tracker, what)(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            warnings.warn(
                f"entropylens: log_to tracker {tracker.name!r} failed in {what}() ({type(e).__name__}: "
                f"{e}); it gets no more metrics",
                stacklevel=4,
            )
            if tracker in self.trackers:
                self.trackers.remove(tracker)
            return False

    def add(self, step: int, reply) -> None:
        self.waiting.append((step, reply))

    def log_ready(self, wait: bool = False) -> None:
        """Log the answered summaries, in step order (all of them, waiting, with ``wait``)."""
        while self.waiting and (wait or self.waiting[0][1].ready()):
            step, reply = self.waiting.pop(0)
            self.write(step, reply.result())

    def write(self, step: int, summary: dict, scalars: bool = True) -> None:
        """One step's summary to every tracker (``scalars=False``: its histograms and table only)."""
        metrics = step_metrics(summary) if scalars else {}
        histograms = {HIST_PREFIX + k: h for k, h in (summary.get(HISTOGRAMS_KEY) or {}).items()}
        table = summary.get(TABLE_KEY)
        if metrics or histograms or table is not None:
            for t in list(self.trackers):
                self._call(t, "write", step + self.step_offset, metrics, histograms, table if t.has_tables else None)

    def alert(self, finding, stop_on=()) -> None:
        """An ``alarms.Finding`` as each tracker's own alert (a ``LiveAlarms`` listener)."""
        title, text, level = alert_text(finding, stop_on)
        for t in list(self.trackers):
            self._call(t, "alert", title, text, level, finding.step + self.step_offset)

    def close(self) -> None:
        for t in list(self.trackers):
            self._call(t, "close")
        self.trackers = []


# ---------------------------------------------------------------- TRL's report_to trackers
class _TRLTracker(Tracker):
    """The histograms, table and alerts of a TRL run, through the tracker object of one of TRL's
    ``report_to`` callbacks (transformers' TensorBoardCallback / WandbCallback / TrackioCallback), under
    TRL's ``train/`` names; the scalars go through TRL's own callbacks (``on_log``). The callback's run
    or writer is looked up at each call (it exists from ``on_train_begin`` to ``on_train_end``)."""

    prefix = "train/"

    def __init__(self, callback):
        self.callback = callback

    def log(self, step, metrics):
        pass


class TRLTensorBoard(_TRLTracker):
    """``add_histogram_raw`` on the TensorBoardCallback's ``tb_writer`` at TRL's global_step; alerts as
    ``add_text`` (tag ``train/entropylens/alarms/text_summary``: the writer adds the suffix)."""

    name = "tensorboard"

    def write(self, step, metrics, histograms, table):
        tb = self.callback.tb_writer
        if tb is None:
            return
        for tag, h in histograms.items():
            lo, hi, limits, counts = h.buckets()
            tb.add_histogram_raw(
                self.prefix + tag, lo, hi, h.num, h.total, h.sum_squares, limits, counts, global_step=step
            )

    def alert(self, title, text, level, step):
        if self.callback.tb_writer is not None:
            self.callback.tb_writer.add_text(f"{self.prefix}{PREFIX}alarms", f"{level}: {text}", step)


class TRLWandB(_TRLTracker):
    """``wandb.log`` of the histograms / table with ``train/global_step`` (as TRL's WandbCallback logs,
    W&B counting its own step); alerts by ``wandb.run.alert``."""

    name = "wandb"
    has_tables = True

    def write(self, step, metrics, histograms, table):
        wandb = self.callback._wandb
        if wandb is None or wandb.run is None:
            return
        payload = _payload({}, histograms, table, wandb.Histogram, wandb.Table, self.prefix)
        if payload:
            wandb.log({**payload, "train/global_step": step})

    def alert(self, title, text, level, step):
        wandb = self.callback._wandb
        if wandb is not None and wandb.run is not None:
            wandb.run.alert(title=title, text=text, level=level)


class TRLTrackio(_TRLTracker):
    """``trackio.log`` of the histograms / table with ``train/global_step`` (as TRL's TrackioCallback
    logs); alerts by ``trackio.alert``."""

    name = "trackio"
    has_tables = True

    def write(self, step, metrics, histograms, table):
        trackio = self.callback._trackio
        if trackio is None or not getattr(self.callback, "_initialized", False):
            return
        payload = _payload({}, histograms, table, trackio.Histogram, trackio.Table, self.prefix)
        if payload:
            trackio.log({**payload, "train/global_step": step})

    def alert(self, title, text, level, step):
        trackio = self.callback._trackio
        if trackio is not None and getattr(self.callback, "_initialized", False):
            trackio.alert(title=title, text=text, level=trackio.AlertLevel(level.lower()))


_TRL_CALLBACKS = {"TensorBoardCallback": TRLTensorBoard, "WandbCallback": TRLWandB, "TrackioCallback": TRLTrackio}


def trl_trackers(callbacks) -> list[Tracker]:
    """The trackers of TRL's ``report_to`` callbacks (``trainer.callback_handler.callbacks``) that take
    histograms, tables or alerts: TensorBoard, W&B, Trackio."""
    return [_TRL_CALLBACKS[type(cb).__name__](cb) for cb in callbacks if type(cb).__name__ in _TRL_CALLBACKS]
