"""What ``Recorder.record_update(loss=...)`` reads from a loss: the interface, written down.

Three objects serve it: ``losses.PolicyLossOutput`` (what ``policy_loss`` returns), the TRL
integration's ``LossColumns`` (TRL's own loss, its columns measured beside it) and verl's
``_Columns`` (a ``policy_loss`` output with extra token columns). The recorder reads each attribute
with ``getattr`` and a default, so an object may leave any of them out (``loss=None``: none at all).

- ``columns``: per-token [B, T] tensors named as the schema's token columns, stored as they are
  (ratio, clip region, quadrant, ... are derived only where absent). Default: none.
- ``loss``: the update's scalar loss (0-dim), or None; it is the steps table's ``loss``.
- ``config``: the resolved settings (method, eps_low, eps_high, agg, tau: run.json's loss block, once;
  beta1, dual_clip, ...: the steps rows of the update, ``losses.update_settings``). Default: {}.
- ``checked`` (``PolicyLossOutput`` only): the inputs the loss found finite at masked-in positions, by
  argument name, with "mask" the mask it was given; the recorder does not check those very tensors
  again when it is given the same mask object. Default: {} (everything is checked).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LossOutput(Protocol):
    """A loss output as ``record_update(loss=...)`` reads it (module docstring)."""

    columns: dict[str, torch.Tensor]
    config: dict

    @property
    def loss(self) -> torch.Tensor | None:  # read-only: a loss whose ``loss`` is a Tensor serves it
        ...


@runtime_checkable
class CheckedLossOutput(LossOutput, Protocol):
    """A :class:`LossOutput` that also says which inputs it found finite (``PolicyLossOutput``)."""

    checked: dict[str, torch.Tensor]
