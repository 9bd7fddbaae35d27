"""Module roles a face looks up by class: which layers make units, which modules hold experts.

Model code registers its classes (``register_module_type(LAYER, TransformerLayer)``) and a
face reads :func:`module_types`, so no face imports a model package: the
dependency points down (``models`` -> this registry <- ``megatron``). The engine
reads it only to refuse MoE experts in graph-safe mode (``graph_safe``);
``fully_shard`` takes its units explicitly.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["LAYER", "EXPERTS", "LINEAR", "ROLES", "register_module_type", "module_types"]

LAYER = "layer"
"""A transformer, MoE transformer or Mamba layer: gathered and freed as one unit by default."""
EXPERTS = "experts"
"""A module holding a MoE layer's expert weights (hooked with ``parameters(recurse=True)``)."""
LINEAR = "linear"
"""A linear layer with ``weight`` (out x in), optional ``bias``, ``reset_parameters()`` and a ``tp`` size:
with ``tp == 1`` it computes ``F.linear(x, weight, bias)``, so ``shardwise.engine.fp8`` may swap in torchao's
``Float8Linear`` (keeping the module's own initialization)."""
ROLES = (LAYER, EXPERTS, LINEAR)

_TYPES: dict[str, list[type]] = {role: [] for role in ROLES}


def _check_role(role: str) -> None:
    if role not in _TYPES:
        raise ValueError(f"module role {role!r} is not one of {list(ROLES)}")


def register_module_type(role: str, cls: Optional[type] = None):
    """Record ``cls`` as a module class of ``role`` (once; registration order is kept).

    Returns ``cls``; without it, a class decorator: ``@register_module_type(LAYER)``.
    """
    _check_role(role)

    def register(kind: type) -> type:
        if not isinstance(kind, type):
            raise TypeError(f"register_module_type({role!r}, ...) needs a class, got {kind!r}")
        if kind not in _TYPES[role]:
            _TYPES[role].append(kind)
        return kind

    return register if cls is None else register(cls)


def module_types(role: str) -> tuple[type, ...]:
    """The classes registered for ``role``, in registration order."""
    _check_role(role)
    return tuple(_TYPES[role])
