"""Meta-device initialization: give meta tensors storage and values, one module at a time.

A model built under ``torch.device("meta")`` has shapes but no storage. To
shard it without ever holding the whole model, ``fully_shard(init_fn=...)``
hands each unit to an initializer just before sharding that unit. For each
module that directly holds meta tensors, the initializer

1. allocates them on the target device (new ``Parameter`` objects that keep the
   old ones' attributes, such as ``tensor_model_parallel`` / ``partition_dim``;
   a tied parameter is allocated once and re-bound everywhere it is held), then
2. calls the module's ``reset_parameters()`` (or ``_reset_parameters()``), so
   the values are the module's own initialization. A ``reset_parameters`` that
   replaces a ``Parameter`` with ``setattr`` is fine: sharding reads the
   parameters only after it returns.

A module with meta tensors and no reset method is an error naming it.

Random numbers. Built directly (no meta), a model initializes its modules in
construction order; sharded unit by unit, the engine initializes inner units
first and the root last, which would draw the same numbers in another order.
:class:`MetaInitializer` with ``replay_rng_order=True`` (the default) first
runs every reset once on throw-away storage, one module at a time, recording
the torch generator state each module starts from; the real initialization
then starts each module from its recorded state and leaves the generators
where a direct build would have left them. So a meta-built, sharded model
equals the same model built directly after the same ``torch.manual_seed``,
at the cost of running each ``reset_parameters`` twice (peak memory stays one
module's tensors).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from .device import device_for
from .replaced_params import mark_replaced
from .rng import set_torch_generator_states, torch_generator_states

__all__ = [
    "has_meta_tensors",
    "materialize_meta_module",
    "materialize_owned_meta_modules",
    "MetaInitializer",
    "default_device",
    "meta_tensor_names",
    "allocate_meta_tensors",
]


def default_device() -> torch.device:
    """Where the default process group's collectives run (``device_for()``): the current CUDA device
    under NCCL, the CPU under gloo (even on a CUDA host), and with no process group the current CUDA
    device where CUDA is available, else the CPU. The same device ``fully_shard`` builds on."""
    return device_for()


def meta_tensor_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the parameters and buffers ``module`` itself (not its children) holds on the meta device."""
    params = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
    buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
    return params, buffers


def has_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` (and, with ``recurse``, its submodules) holds parameters or buffers on meta."""
    modules = module.modules() if recurse else [module]
    return any(any(meta_tensor_names(m)) for m in modules)


def _reset_method(module: nn.Module) -> Optional[Callable[[], None]]:
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _missing_reset_error(module: nn.Module, params: list[str], buffers: list[str]) -> ValueError:
    held = params + [f"{b} (buffer)" for b in buffers]
    return ValueError(
        f"{type(module).__name__} holds {held} on the meta device but has no reset_parameters() "
        "to initialize them; give the module a reset_parameters() (or build it off the meta device)"
    )


def allocate_meta_tensors(module: nn.Module, params: list[str], buffers: list[str], device: torch.device, memo: dict) -> bool:
    """Give the named meta tensors storage on ``device``; return whether any was new (not a re-bound tie)."""
    fresh = bool(buffers)
    for name in params:
        old = module._parameters[name]
        known = memo.get(id(old))
        if known is None:
            new = nn.Parameter(torch.empty_like(old, device=device), requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)  # keeps TP marks (tensor_model_parallel, partition_dim, ...)
            memo[id(old)] = (old, new)  # holding `old` keeps its id from being reused
            mark_replaced(old, "meta materialization")  # an optimizer built before holds it
            fresh = True
        else:
            new = known[1]
        module._parameters[name] = new
    for name in buffers:
        module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
    return fresh


def _meta_and_reset(module: nn.Module):
    """``(params, buffers, reset)`` for a module's own meta tensors; None when it has none."""
    params, buffers = meta_tensor_names(module)
    if not params and not buffers:
        return None
    reset = _reset_method(module)
    if reset is None:
        raise _missing_reset_error(module, params, buffers)
    return params, buffers, reset


def materialize_meta_module(
    module: nn.Module, device: Optional[torch.device] = None, *, memo: Optional[dict] = None
) -> None:
    """Allocate ``module``'s own (not its children's) meta tensors on ``device`` and run its reset."""
    found = _meta_and_reset(module)
    if found is None:
        return
    params, buffers, reset = found
    device = torch.device(device) if device is not None else default_device()
    if not allocate_meta_tensors(module, params, buffers, device, {} if memo is None else memo):
        return  # only re-bound parameters initialized elsewhere
    with torch.no_grad():
        reset()
    left = meta_tensor_names(module)
    if any(left):
        raise ValueError(
            f"{type(module).__name__}.reset_parameters() left {left[0] + left[1]} on the meta device"
        )


def materialize_owned_meta_modules(
    module: nn.Module, device: Optional[torch.device] = None, *, memo: Optional[dict] = None
) -> None:
    """Materialize every module under ``module`` (itself included) that still holds meta tensors.

    Used per sharding unit, innermost units first, so modules of an inner unit
    are already done when the unit that contains it comes.
    """
    memo = {} if memo is None else memo
    for m in module.modules():
        materialize_meta_module(m, device, memo=memo)


class MetaInitializer:
    """``init_fn`` for :func:`shardwise.fully_shard` that materializes one unit at a time.

    Call :meth:`plan` before sharding (when ``replay_rng_order``), pass the
    object as ``init_fn``, and call :meth:`finish` after ``fully_shard`` returns.
    """

    def __init__(self, root: nn.Module, device: Optional[torch.device] = None, replay_rng_order: bool = True):
        self.root = root
        self.device = torch.device(device) if device is not None else default_device()
        self.replay_rng_order = replay_rng_order
        self.memo: dict = {}
        self._starts: dict[int, dict] = {}
        self._final: Optional[dict] = None

    def plan(self) -> None:
        """Record the generator state each module's reset starts from in a direct build (see module doc)."""
        for module in self.root.modules():
            found = _meta_and_reset(module)
            if found is None:
                continue
            params, buffers, reset = found
            if not self.replay_rng_order:
                continue
            self._starts[id(module)] = torch_generator_states(self.device)
            saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
            try:
                allocate_meta_tensors(module, params, buffers, self.device, {})
                with torch.no_grad():
                    reset()
            finally:
                module._parameters.clear()
                module._parameters.update(saved_params)
                module._buffers.clear()
                module._buffers.update(saved_buffers)
        if self.replay_rng_order:
            self._final = torch_generator_states(self.device)

    def __call__(self, owner: nn.Module, device: Optional[torch.device] = None) -> None:
        device = torch.device(device) if device is not None else self.device
        for module in owner.modules():
            if not any(meta_tensor_names(module)):
                continue
            start = self._starts.get(id(module))
            if start is not None:
                set_torch_generator_states(start, device)
            materialize_meta_module(module, device, memo=self.memo)

    def finish(self) -> None:
        """Materialize whatever no unit covered (e.g. meta buffers alone) and restore the final RNG state."""
        self(self.root, self.device)
        if self._final is not None:
            set_torch_generator_states(self._final, self.device)
