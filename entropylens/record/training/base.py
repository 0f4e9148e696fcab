"""The Recorder's shared state and the calls between its parts, declared once, with types.

:class:`entropylens.record.recorder.Recorder` is put together from mixins (one module per job under
training/), and each part reads state another part owns and calls another part's methods. Every part
inherits :class:`RecorderBase`, which says what that shared state is: attribute annotations only (no
values: each attribute is set by the part that owns it, as its module docstring says), and, for the
type checker only (``if TYPE_CHECKING``), the methods one part calls on another, with their
signatures. A part's real method overrides its declaration here, so the type checker also holds the
two signatures together.

At run time the class adds nothing: it defines no attribute and no method (its annotations are strings
in ``__annotations__``), and it comes last in the Recorder's MRO, just before ``object``, so every
lookup finds what it found before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from ...alarms import LiveAlarms, ScalarLog, Thresholds
    from ...storage import Location
    from ..run_dir.run_claim import Claim
    from ..run_dir.run_info import RunInfo
    from ..trackers import LogTo, StepLog, Tracker
    from ..writing.messages import Reply
    from ..writing.thread import WriterThread
    from .steps import StepState
    from .update import LogitWatch, _Pending


class RecorderBase:
    """The state every part of the Recorder may read, by owner (module docstring)."""

    # lifecycle.py: the run's identity and settings, run.json, the writer thread, open / closed
    run: str
    root: Location
    dir: Location
    rank: int
    world_size: int
    config: dict[str, Any]
    tau: float
    sample: float
    on_error: str
    eps_low: float
    eps_high: float
    _salt: int  # blocks.run_hash(run): the seed of the row sample
    _claim: Claim
    _info: RunInfo
    _writer: WriterThread
    _disabled: bool  # on_error="warn" after a writer failure: nothing more is recorded
    _closed: bool

    # steps.py: where the steps stand
    _steps: StepState
    _probing: bool
    _warned_rescalar: bool

    # update.py: the update waiting for its backward, the logits hook
    _pending: _Pending | None
    _watch: LogitWatch | None

    # summaries.py: live alarms and trackers
    _alarm_thresholds: Thresholds | None
    _stop_on: tuple[str, ...]
    _alarms: LiveAlarms | None
    _alarm_replies: list[tuple[int, Reply]]  # (step, the writer's reply to its summary request)
    _scalars: ScalarLog | None
    _step_log: StepLog | None

    if TYPE_CHECKING:  # the calls between parts (each defined by the part named above it)
        # lifecycle.py
        def _check_alive(self) -> None: ...

        # inputs.py
        def _validate_update(
            self,
            step: int,
            update: int,
            mask: torch.Tensor,
            advantages: torch.Tensor,
            logprobs: torch.Tensor,
            old_logprobs: torch.Tensor,
            entropy: torch.Tensor | None,
            old_entropy: torch.Tensor | None,
            tokens: torch.Tensor | None,
            seq_ids: torch.Tensor | None,
            group_ids: torch.Tensor | None,
            entropy_sensitivity: torch.Tensor | None,
            temperature: float,
        ) -> None: ...

        # update.py
        def _finalize_pending(self) -> None: ...
        def _remove_hook(self) -> None: ...

        # steps.py
        def _advance_to(self, step: int) -> None: ...

        # summaries.py
        def _check_alarm_settings(self, alarms: bool | Thresholds | None, stop_on: str | Iterable[str]) -> None: ...
        def _check_tracker_settings(
            self, log_to: LogTo | None, log_histograms: bool | None, log_table_every: int | None
        ) -> tuple[list[Tracker] | None, bool, int]: ...
        def _start_step_log(self, log_to: list[Tracker] | None) -> None: ...
        def _scalar_log(self) -> ScalarLog: ...
        def _observe_alarms(self, step: int, wait: bool = True) -> None: ...
        def _observe_answered(self, wait: bool = False) -> None: ...
        def _track_step(self, step: int) -> None: ...
