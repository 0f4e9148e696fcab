"""The Recorder's step summaries and who reads them: the caller, the live alarms, the trackers.

Part of :class:`entropylens.record.recorder.Recorder`. :class:`StepReports` (a mixin) holds
``step_summary`` / ``step_summary_later`` (:class:`PendingSummary`: answered later by the writer
thread), the live alarms (``alarms=``, ``stop_on``: ``should_stop``, ``stop_reason``, ``on_alarm``,
``observe_alarms``) and the trackers (``log_to``): a closing step's summary is asked for once, before
it closes, and read once the writer has answered, without the training thread waiting. It owns
``_alarm_thresholds``, ``_stop_on``, ``_alarms`` (alarms.LiveAlarms, made when first needed),
``_alarm_replies``, ``_scalars`` (alarms.ScalarLog) and ``_step_log`` (trackers.StepLog); which steps
were observed and asked for is in the step state (``_steps.alarms_seen``, ``_steps.logged``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .base import RecorderBase

if TYPE_CHECKING:
    from ...alarms import Finding, LiveAlarms, ScalarLog, Thresholds
    from ..trackers import LogTo, Tracker
    from ..writing.messages import Reply
    from ..writing.thread import WriterThread


class PendingSummary:
    """A step summary the writer thread answers later (:meth:`Recorder.step_summary_later`)."""

    def __init__(self, reply: Reply, writer: WriterThread) -> None:
        self._reply, self._writer = reply, writer

    def ready(self) -> bool:
        return self._reply.done() or not self._writer.alive

    def result(self) -> dict[str, float]:
        return self._writer.answer(self._reply)


class StepReports(RecorderBase):
    """Step summaries, live alarms, trackers (module docstring)."""

    # ---------------------------------------------------------------- settings (checked as the run opens)
    def _check_alarm_settings(self, alarms: bool | Thresholds | None, stop_on: str | Iterable[str]) -> None:
        """``alarms=`` (True for the defaults, or an alarms.Thresholds) and ``stop_on`` (the rules that stop);
        this part's state, empty."""
        self._alarm_thresholds = None
        if alarms:  # live alarms (entropylens.alarms): True for the defaults, or a Thresholds
            from ...alarms import Thresholds

            self._alarm_thresholds = alarms if isinstance(alarms, Thresholds) else Thresholds()
        from ...alarms import check_stop_on

        self._stop_on = check_stop_on(stop_on)
        if self._stop_on and self._alarm_thresholds is None:
            raise ValueError("stop_on needs alarms= (True or an alarms.Thresholds): the live rules that fire")
        self._alarms = None  # LiveAlarms, made at the first closed step when alarms= is set
        self._alarm_replies: list = []  # (step, the writer's reply): summaries asked for by end_step
        self._scalars = None  # alarms.ScalarLog, made at the first record_step (_scalar_log)
        self._step_log = None  # trackers.StepLog (log_to=): step summaries asked for as steps close

    def _check_tracker_settings(
        self, log_to: LogTo | None, log_histograms: bool | None, log_table_every: int | None
    ) -> tuple[list[Tracker] | None, bool, int]:
        """``log_to`` resolved (this rank's trackers: none off rank 0), ``log_histograms`` and
        ``log_table_every`` with their defaults (on where this rank logs to a tracker)."""
        if log_to is not None:  # unknown names and missing packages fail here, before anything is on disk
            from .. import trackers

            log_to = trackers.resolve(log_to) if self.rank == 0 else []
        if log_table_every is not None and (isinstance(log_table_every, bool) or int(log_table_every) < 0):
            raise ValueError(f"log_table_every must be an int >= 0 (0: no table), got {log_table_every!r}")
        tracked = bool(log_to)  # this rank logs to a tracker: the histograms and the table are on by default
        log_histograms = tracked if log_histograms is None else bool(log_histograms)
        log_table_every = (50 if tracked else 0) if log_table_every is None else int(log_table_every)
        return log_to, log_histograms, log_table_every

    def _start_step_log(self, log_to: list[Tracker] | None) -> None:
        if log_to:
            from ..trackers import StepLog

            step_log = self._step_log = StepLog(log_to, self.run, self.config)
            if self._alarm_thresholds is not None and step_log.trackers:  # findings as the trackers' alerts
                self.on_alarm(lambda finding: step_log.alert(finding, self._stop_on))

    # ---------------------------------------------------------------- public API
    def step_summary(self, step: int) -> dict[str, float]:
        """Token-weighted means of the exact aggregates over the updates of ``step`` recorded so far
        (n_* counts summed). For trainer logs (waits for the writer thread to take in the queued updates;
        :meth:`step_summary_later` does not wait).

        Args:
            step: the step to summarise.

        Returns:
            {aggregate name: value}; empty once the step has been written (or when the writer thread died).

        Raises:
            ValueError: when the pending update, finalised first, holds NaN or Inf at masked-in positions
                (``NonFiniteInput``).
        """
        return self.step_summary_later(step).result()

    def step_summary_later(self, step: int, names: tuple[str, ...] | None = None) -> PendingSummary:
        """:meth:`step_summary` without waiting: returns at once; ``.ready()`` says whether the writer
        thread has answered, ``.result()`` gives the summary (waiting if needed). For trainer logs that
        must not wait on the writer thread's disk writes (a step's files, fsync included). ``names``:
        only these aggregates (and n_tokens), the rest is not computed."""
        self._finalize_pending()
        return PendingSummary(self._writer.summary_request(int(step), names), self._writer)

    @property
    def should_stop(self) -> bool:
        """Whether a live alarm whose rule is in ``stop_on`` has fired: a training loop reads it after each
        step and stops. The rules see a step once the writer thread has its summary (no wait at the step's
        end), so the stop can come a step or two after the finding's step; the finding names its step.

        Returns:
            True once such an alarm has fired (:attr:`stop_reason` says which), else False (always False
            without ``alarms=``).
        """
        if self._alarm_replies:
            self._observe_answered()
        return self._alarms is not None and self._alarms.stop is not None

    def on_alarm(self, listener: Callable[[Finding], object]) -> None:
        """Call ``listener(finding)`` at each live alarm finding, on the training thread, as the rules see
        the step (one call per finding; a listener that raises warns). Needs ``alarms=``.

        Args:
            listener: a callable taking one ``alarms.Finding``.

        Raises:
            ValueError: when the recorder was made without ``alarms=``.
        """
        if self._alarm_thresholds is None:
            raise ValueError("on_alarm needs alarms= (True or an alarms.Thresholds): the live rules that fire")
        self._live_alarms().listeners.append(listener)

    def observe_alarms(self) -> None:
        """Run the live alarm rules now on every step closed so far, waiting for the writer's answers (its
        findings warn, reach the :meth:`on_alarm` listeners and set :attr:`should_stop`): for a trainer
        whose trackers close before the recorder does (the TRL trainer's last step)."""
        self._observe_answered(wait=True)

    @property
    def stop_reason(self) -> str | None:
        """The finding that set :attr:`should_stop`.

        Returns:
            The finding's line (``run=... step=... rule=...``), or None while :attr:`should_stop` is False.
        """
        return self._alarms.stop.line() if self._alarms is not None and self._alarms.stop is not None else None

    # ---------------------------------------------------------------- internals
    def _live_alarms(self) -> LiveAlarms:
        """The run's alarms.LiveAlarms (``alarms=`` set), made at its first use."""
        if self._alarms is None:
            from ...alarms import LiveAlarms

            self._alarms = LiveAlarms(self.run, self._alarm_thresholds, self._stop_on)
        return self._alarms

    def _scalar_log(self) -> ScalarLog:
        """record_step's values on the host side (alarms.ScalarLog: the run's one non-finite warning, and
        the live alarms' grad_norm / lr), made at the first record_step."""
        log = self._scalars
        if log is None:
            from ...alarms import ScalarLog

            log = self._scalars = ScalarLog(self.run, keep=self._alarm_thresholds is not None)
            if self._alarm_thresholds is not None:
                self._live_alarms().scalar_log = log
        return log

    def _observe_alarms(self, step: int, wait: bool = True) -> None:
        """Live alarms (``alarms=``): the closing step's summary through the rules; one warning per rule.
        Each step is observed once (a step closed by :meth:`commit` is not observed again). With
        ``wait=False`` (:meth:`end_step`) the summary is asked for now, before the step closes, and
        observed once the writer has answered (:meth:`_observe_answered`)."""
        if self._alarm_thresholds is None or step <= self._steps.alarms_seen:
            return
        self._steps.alarms_seen = step
        self._alarm_replies.append((step, self._writer.summary_request(step)))
        self._observe_answered(wait=wait)

    def _observe_answered(self, wait: bool = False) -> None:
        """Feed the live alarms the summaries the writer has answered, in step order (all of them,
        waiting, with ``wait``)."""
        while self._alarm_replies and (wait or self._alarm_replies[0][1].done()):
            step, reply = self._alarm_replies.pop(0)
            self._live_alarms().observe(step, self._writer.answer(reply))

    def _track_step(self, step: int) -> None:
        """``log_to``: ask for the summary of ``step`` (once, before it closes) without waiting."""
        if self._step_log is None or step <= self._steps.logged or self._disabled:
            return
        from ..trackers import EXTRA_NAMES, SUMMARY_NAMES

        self._steps.logged = step
        names = (
            SUMMARY_NAMES + EXTRA_NAMES
            if self._writer.work.histograms or self._writer.work.table_every
            else SUMMARY_NAMES
        )
        self._step_log.add(step, PendingSummary(self._writer.summary_request(step, names), self._writer))
