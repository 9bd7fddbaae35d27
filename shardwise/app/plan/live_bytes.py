"""Bytes of tensor storage alive at each moment of a traced step, and its peak: the allocator's view.

``LiveBytes`` is a dispatch mode that sees every tensor an op returns and keeps its storage's size until the
storage is freed (a weak reference's callback) or resized (``UntypedStorage.resize_``, which the engine uses to
free a gathered unit at rest and which no op reports). It works the same on real tensors (a gloo run) and on
FakeTensors (a simulated one), so the two can be compared allocation by allocation. Storages made before it was
entered are counted through :meth:`LiveBytes.adopt`. Ops that DTensor runs in a fake mode of its own
(sharding propagation) allocate nothing and are left out, as torch's ``MemTracker`` leaves them out.
"""

from __future__ import annotations

import weakref

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]

_DEVICE = torch.ops.prim.device.default


def _tensors(out) -> list[torch.Tensor]:
    """The tensors an op returned, in order: an aten op returns a tensor or a list or tuple of them (torch's
    ``tree_flatten``, which walks any registered container, cost an eighth of a trace)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _tensors(x)]
    return []


class LiveBytes(TorchDispatchMode):
    """Live storage bytes, the peak and where it was (``phase``), and every allocation in order (``log``)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # id of the storage's StorageImpl -> bytes
        self._refs: dict[int, weakref.ref] = {}
        self.current = self.peak = 0
        self.phase, self.peak_phase = "", ""
        self.log: list[tuple[str, str, int]] = []  # (phase, op, bytes) of each new storage, in order
        self._resize = None
        self.origin: dict[int, str] = {}  # storage -> the op that made it (for explain)
        self.explain = False
        self.at_peak: dict[str, int] = {}
        self.peaks: dict[str, int] = {}  # the peak of each phase
        self.quiet = 0  # > 0 inside a collective: its backend's own temporaries are not the step's

    # ------------------------------------------------------------------ bookkeeping
    def _track(self, t: torch.Tensor, log: bool = True, op: str = "") -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self.live:
            return
        self.live[key] = nbytes
        self.origin[key] = f"{self.phase}:{op}"
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._free(k))
        self._add(nbytes)
        if log and nbytes:
            self.log.append((self.phase, op, nbytes))

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self._refs.pop(key, None)
        self.origin.pop(key, None)
        self.current -= nbytes

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak, self.peak_phase = self.current, self.phase
            if self.explain:
                self.at_peak = {}
                for k, n in self.live.items():
                    self.at_peak[self.origin.get(k, "?")] = self.at_peak.get(self.origin.get(k, "?"), 0) + n

    def adopt(self, tensors) -> None:
        """Count storages made before the mode was entered (each once)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                local = t.to_local() if hasattr(t, "to_local") else t
                self._track(local, log=False)

    def reset_peak(self) -> None:
        self.peak, self.peak_phase, self.log, self.peaks = self.current, self.phase, [], {}

    def set_phase(self, name: str) -> None:
        """Name the moment that follows (its peak is kept apart in ``peaks``)."""
        self.phase = name
        if self.current > self.peaks.get(name, -1):
            self.peaks[name] = self.current

    # ------------------------------------------------------------------ the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
            # a FakeTensor's ``.device``: no storage, and asked thousands of times a step (autograd, the engine's
            # views); answered as FakeTensor answers it, without going through FakeTensorMode's dispatch
            return args[0].fake_device
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor turn it into ops on local tensors, which are seen here
        out = func(*args, **(kwargs or {}))
        if self.quiet:
            return out
        for t in _tensors(out):
            # DTensor's sharding propagation runs ops in a fake mode of its own: those allocate nothing
            if not t.is_meta and getattr(t, "fake_mode", None) is self._mode_on_entry:
                self._track(t, op=func.__name__)
        return out

    def __enter__(self):
        self._mode_on_entry = active_fake_mode()  # None for a real run, the simulation's FakeTensorMode else
        original = self._resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(storage, size):
            key = storage._cdata
            before = mode.live.get(key)
            result = original(storage, size)
            if before is not None:
                mode.live[key] = int(size)
                mode.current -= before
                mode._add(int(size))
                if size > before:
                    mode.log.append((mode.phase, "resize_", int(size) - before))
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)
