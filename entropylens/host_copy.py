"""The one device -> host copy of an update's packed block, without blocking the training thread.

On CUDA the block is copied into pinned host memory with ``non_blocking=True`` and a CUDA event is
recorded behind the copy on the current stream; whoever reads the block (the writer thread) waits
on that event. Nothing here synchronises the caller. On the CPU the block already is host memory.
"""

from __future__ import annotations

import time

import numpy as np
import torch


class HostCopy:
    """An int32 block on its way to the host. ``ready`` without waiting; ``wait()`` -> numpy."""

    def __init__(self, packed: torch.Tensor):
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
