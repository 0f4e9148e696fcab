"""The one device -> host copy of an update's packed block, without blocking the training thread.

On CUDA the block is copied into pinned host memory with ``non_blocking=True`` and a CUDA event is
recorded behind the copy on the current stream; whoever reads the block (the writer thread) waits
on that event. Nothing here synchronises the caller.

On the CPU the tensors already are host memory: :class:`DeferredBlock` holds a private copy of the
update (blocks.snapshot) and the writer thread builds the packed block from it when it reads
it (blocks.update_block), so the aggregates and the packing cost the training thread nothing.
Both classes answer ``on_host``, ``finite()``, ``wait()`` and ``layout`` alike.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import blocks, packed_block


class HostCopy:
    """An int32 block on its way to the host. ``ready`` without waiting; ``wait()`` -> numpy."""

    def __init__(self, packed: torch.Tensor, layout: packed_block.Layout | None = None):
        self.layout = layout
        self._event = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(packed.device))
        elif packed.device.type == "cpu":
            self._host = packed.detach()
        else:  # other accelerators: a plain (blocking) copy
            self._host = packed.detach().cpu()

    @property
    def on_host(self) -> bool:
        """True when no copy was needed (a CPU tensor): the caller may read it without waiting."""
        return self._event is None

    def finite(self) -> dict[str, bool]:
        """The input finite flags (read from the block: call only when ``on_host``)."""
        assert self.layout is not None  # an update's block (only a record_step scalars copy has no layout)
        return packed_block.read_finite(self.wait(), self.layout)

    @property
    def ready(self) -> bool:
        """True when the bytes are on the host (always on the CPU)."""
        return self._event is None or self._event.query()

    def wait(self) -> np.ndarray:
        """The host bytes, once the copy is done. Polls the event (cudaEventQuery) rather than
        synchronising on it, so no thread ever makes a synchronising CUDA call for the recorder."""
        while not self.ready:
            time.sleep(0.0002)
        return self._host.numpy()


class DeferredBlock:
    """A CPU update whose packed block is built when it is read: ``wait()`` runs
    blocks.update_block on the snapshot (on the writer thread) and returns the int32 block,
    unless :func:`build_blocks` built it already together with other updates."""

    def __init__(self, snap: blocks.Snapshot, salt: int, sample: float):
        self._snap, self._salt, self._sample = snap, salt, sample
        self._block: np.ndarray | None = None  # set by build_blocks
        self.layout: packed_block.Layout | None = None  # known once the block is built

    on_host = True  # the finite flags are host memory already

    def finite(self) -> dict[str, bool]:
        """The input finite flags, from the snapshot (no block needed)."""
        finite = self._snap.finite
        if isinstance(finite, packed_block.FiniteFlags):
            if finite.flags is None:  # nothing left to check (policy_loss checked these inputs)
                return {}
            return dict(zip(finite.names, (bool(v) for v in finite.flags.tolist())))
        return {name: bool(v) for name, v in finite.items()}

    def wait(self) -> np.ndarray:
        if self._block is None:
            with torch.inference_mode():  # no autograd bookkeeping for the writer thread's ops
                packed, self.layout = self._snap.block(self._salt, self._sample)
            self._block = packed.numpy()
        return self._block


def build_blocks(copies: list) -> None:
    """Builds the blocks of the DeferredBlocks among ``copies`` (a hand-over's updates, on the writer
    thread) with one set of ops per group of same-shaped updates (blocks.stack_snapshots):
    ~130 small ops per group instead of per update. Each block equals the one ``wait()`` builds
    alone, word for word; ``wait()`` then returns it. Other copies are left as they are."""
    groups: dict[tuple, list[DeferredBlock]] = {}
    for c in copies:
        if isinstance(c, DeferredBlock) and c._block is None:
            groups.setdefault((c._snap.signature(), c._salt, c._sample), []).append(c)
    for group in groups.values():
        if len(group) < 2:
            continue  # built alone by its wait()
        with torch.inference_mode():
            packed, layout = blocks.stack_snapshots([c._snap for c in group]).block(group[0]._salt, group[0]._sample)
        host = packed.numpy()  # [U, layout.size]
        for c, row in zip(group, host):
            c._block, c.layout = row, layout
