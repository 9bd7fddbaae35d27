"""The resolutions the build and the rank-consistency check share: which modules are units, which plan a
parameter takes. Pure functions of the model and the arguments, so both read the same answer."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .mesh import PLAN_CHOICES, experts_by_mark

__all__ = ["resolve_units", "plan_choice"]


def resolve_units(root: nn.Module, unit_modules) -> list[nn.Module]:
    """The modules ``unit_modules`` (classes or instances) names inside ``root``, in module order."""
    if unit_modules is None:
        return []
    if isinstance(unit_modules, type) or isinstance(unit_modules, nn.Module):
        unit_modules = [unit_modules]
    all_modules = list(root.modules())
    ids = {id(m) for m in all_modules}
    chosen: dict[int, nn.Module] = {}
    for spec in unit_modules:
        if isinstance(spec, type):
            if not issubclass(spec, nn.Module):
                raise TypeError(f"unit_modules entry {spec!r} is not an nn.Module class")
            found = [m for m in all_modules if isinstance(m, spec) and m is not root]
            if not found:
                raise ValueError(
                    f"unit_modules names {spec.__name__}, but {type(root).__name__} contains no "
                    f"{spec.__name__} module"
                )
        elif isinstance(spec, nn.Module):
            if id(spec) not in ids or spec is root:
                raise ValueError(f"unit_modules entry {type(spec).__name__} is not a submodule of the model")
            found = [spec]
        else:
            raise TypeError(f"unit_modules entry {spec!r} must be an nn.Module class or instance")
        for m in found:
            chosen[id(m)] = m
    return [m for m in all_modules if id(m) in chosen]  # module order


def plan_choice(plan_fn: Callable | None, fqn: str, param: torch.Tensor) -> str:
    """``plan_fn(fqn, param)``, checked to be one of ``PLAN_CHOICES``; ``plan_fn=None`` is the default,
    ``mesh.experts_by_mark`` (here only)."""
    choice = (experts_by_mark if plan_fn is None else plan_fn)(fqn, param)
    if not isinstance(choice, str) or choice not in PLAN_CHOICES:
        raise ValueError(f"plan_fn returned {choice!r} for parameter {fqn!r}; it must return one of {list(PLAN_CHOICES)}")
    return choice
