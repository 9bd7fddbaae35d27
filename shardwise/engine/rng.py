"""Random number generator state: capture, restore, and keep tensor-parallel ranks in step.

A training step draws from up to four generators: Python's ``random``, NumPy's
global generator, torch's CPU generator and the current CUDA device's
generator. Tensor-parallel models add named streams (Megatron's "RNG tracker":
e.g. one stream for dropout inside TP regions, seeded differently per TP rank,
and the default stream identical on every TP rank).

* :func:`get_rng_state_dict` / :func:`load_rng_state_dict`: all of them, as a
  picklable dict (for checkpoints and broadcasts).
* :class:`RNGStatesTracker`: named streams forked from one device type's
  default generator; :func:`get_rng_tracker` returns the one in use (the
  process-wide shardwise tracker, one set with :func:`set_rng_tracker`, or
  Megatron-Core's CUDA RNG tracker when the program already imported it).
* :func:`sync_rng_states`: copy the first rank of a group's states to the
  whole group (nothing for a group of one).
* :func:`torch_generator_states` / :func:`set_torch_generator_states`: just
  the torch generators a device draws from (used by meta-device init).
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from .device import device_for

__all__ = [
    "RNGStatesTracker",
    "get_rng_tracker",
    "set_rng_tracker",
    "get_rng_state_dict",
    "load_rng_state_dict",
    "sync_rng_states",
    "torch_generator_states",
    "set_torch_generator_states",
]


def _device_type(device_type: Optional[str]) -> str:
    if device_type is not None:
        return device_type
    return device_for().type


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG streams on one device type's default generator.

    ``add(name, seed)`` creates a stream; ``with tracker.fork(name):`` draws
    from it (and advances it) while leaving the default stream untouched.
    ``get_states()`` / ``set_states()`` save and restore every stream, which is
    what checkpoints and TP synchronisation move around.
    """

    def __init__(self, device_type: Optional[str] = None):
        self.device_type = _device_type(device_type)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def is_initialized(self) -> bool:
        return bool(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        saved = _get_state(self.device_type)
        try:
            if self.device_type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self._states[name] = _get_state(self.device_type)
        finally:
            _set_state(self.device_type, saved)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} does not exist; add it with tracker.add(name, seed)")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


class _DefaultTracker(RNGStatesTracker):
    """shardwise's own tracker, made at import: its device type is what :func:`device_for` said then (a
    process group's device if one was initialized, else CUDA where available, else the CPU), asked at its
    first use. Asking CUDA at import would initialise it in every process that imports shardwise, and a
    process forked from one (the fork server of ``shardwise train``'s workers) could not use CUDA."""

    def __init__(self):
        self._type = device_for().type if dist.is_available() and dist.is_initialized() else None
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    @property
    def device_type(self) -> str:
        if self._type is None:
            self._type = "cuda" if torch.cuda.is_available() else "cpu"
        return self._type


_DEFAULT_TRACKER = _DefaultTracker()
_USER_TRACKER: Any = None


def set_rng_tracker(tracker: Any) -> None:
    """Use ``tracker`` (anything with ``get_states``/``set_states``) from now on; ``None`` restores the default."""
    global _USER_TRACKER
    if tracker is not None and not (hasattr(tracker, "get_states") and hasattr(tracker, "set_states")):
        raise TypeError(f"{type(tracker).__name__} has no get_states()/set_states()")
    _USER_TRACKER = tracker


def get_rng_tracker() -> Any:
    """The tracker in use: one set by :func:`set_rng_tracker`, else Megatron-Core's when the
    program already imported ``megatron.core.tensor_parallel`` and CUDA is there (Megatron's
    tracker holds CUDA generator states only), else shardwise's own."""
    if _USER_TRACKER is not None:
        return _USER_TRACKER
    megatron_tp = sys.modules.get("megatron.core.tensor_parallel")
    if megatron_tp is not None and hasattr(megatron_tp, "get_cuda_rng_tracker") and torch.cuda.is_available():
        return megatron_tp.get_cuda_rng_tracker()
    return _DEFAULT_TRACKER


def get_rng_state_dict() -> dict[str, Any]:
    """Every generator's state: Python, NumPy, torch CPU, current CUDA device (``None`` without CUDA), tracker."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
    }


def load_rng_state_dict(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state_dict` captured (the CUDA state only where CUDA is there)."""
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])


def sync_rng_states(group: Optional[dist.ProcessGroup]) -> bool:
    """Give every rank of ``group`` the RNG states of the group's first rank.

    A collective over ``group``. Returns whether anything was sent: a group of
    one rank (or ``None``) has nothing to synchronise.
    """
    if group is None or dist.get_world_size(group) <= 1:
        return False
    payload = [get_rng_state_dict() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    load_rng_state_dict(payload[0])
    return True


def torch_generator_states(device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """The torch generator states that drawing on ``device`` can advance (CPU, plus CUDA for a CUDA device)."""
    states = {"cpu": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return states


def set_torch_generator_states(states: dict[str, torch.Tensor], device: Optional[torch.device] = None) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], torch.device(device) if device is not None else "cuda")
