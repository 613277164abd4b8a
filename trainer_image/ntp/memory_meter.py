"""The most tensor memory a rank held at once during a phase (a step, a relayout), to check the
memory plan (`tessera_core.memory`) against: on a GPU the CUDA caching allocator's own count,
on the CPU the live tensor storages counted as they are allocated.

The CPU has no allocator statistics, so `CpuMeter` counts storages itself: at the phase's start
every storage of a tensor the garbage collector can reach (parameters, optimizer state, what the
rank keeps), then every storage an operator returns (through a dispatch mode), each counted once
and subtracted when it is freed (a finalizer on the storage). It sees tensors made on the thread
that runs the phase; the collectives' own buffers inside gloo or NCCL are not tensors it is
shown, as they are not the allocator's on a GPU either. It slows every operator down: for
checks, not for training.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Storages(TorchDispatchMode):
    """Bytes of the live storages it has seen, and the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.most = 0
        self._sizes: dict[int, int] = {}

    def see(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes or storage.device.type == "meta":
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.live += size
        self.most = max(self.most, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.live -= size

    def see_reachable(self) -> None:
        for obj in gc.get_objects():
            # type(), not isinstance: some objects warn when their __class__ is read
            if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
                self.see(obj.untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.see(leaf.untyped_storage())
        return out


class PeakMeter:
    """The peak tensor bytes of each phase this rank measures (`phase`), in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: list[int] = []

    @contextmanager
    def phase(self) -> Iterator[None]:
        """Measure what runs inside, on this thread; its peak is appended to `peaks`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peaks.append(torch.cuda.max_memory_allocated(self.device))
            return
        gc.collect()  # what only a reference cycle keeps is not the rank's
        storages = _Storages()
        storages.see_reachable()
        try:
            with storages:
                yield
        finally:
            self.peaks.append(storages.most)
