"""Make Megatron-Core and Megatron-LM build and recognise shardwise's wrappers.

Megatron-LM builds its Megatron-FSDP chunks with Megatron-Core's
``FullyShardedDataParallel`` class and recognises them with ``isinstance``,
under whatever name a module imported it: ``megatron.core.distributed``'s,
``training.py``'s ``megatron_FSDP`` (core_r0.16 .. core_r0.19, where 0.16's
``get_model`` builds with it and both check it before installing
``no_sync_func`` / ``grad_sync_func``), ``dist_utils``'s (0.19),
``unwrap_model``'s (read at each call). A wrapper Megatron does not recognise
trains, but its sync functions are never installed and ``unwrap_model`` stops
at it, silently; a name left pointing at Megatron's class builds Megatron's own
FSDP, silently.

:func:`use_in_megatron` therefore replaces by identity: every attribute of
every imported ``megatron.*`` module that *is* one of Megatron's classes, whatever
its name. Modules imported later need no hook: their ``from ... import`` reads
the class from a module already replaced (the adapter module and the packages
that re-export it are imported here first). :meth:`MegatronNames.restore` (or
the end of a ``with`` block) puts Megatron's classes back, in modules imported
since too. ``megatron.core`` is imported only here, only when asked.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

from .mcore_fsdp_adapter import FullyShardedDataParallel, FullyShardedDataParallelV1, FullyShardedDataParallelV2

__all__ = ["use_in_megatron", "MegatronNames", "ShardwiseFSDPType"]

logger = logging.getLogger(__name__)

_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
_WRAPPERS = (FullyShardedDataParallelV1, FullyShardedDataParallelV2)


class _FactoryType(type):
    """A type that builds through shardwise's factory and counts V1 and V2 wrappers as instances."""

    def __call__(cls, *args, **kwargs):
        return FullyShardedDataParallel(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _WRAPPERS)

    def __subclasscheck__(cls, sub) -> bool:
        return isinstance(sub, type) and issubclass(sub, _WRAPPERS)


class ShardwiseFSDPType(metaclass=_FactoryType):
    """What Megatron's ``FullyShardedDataParallel`` class becomes after :func:`use_in_megatron`.

    Calling it is :func:`shardwise.megatron.FullyShardedDataParallel` (V1 or V2
    by ``ddp_config.megatron_fsdp_version``); ``isinstance(chunk, it)`` holds for
    both wrappers, as Megatron's own checks expect of its class.
    """


# Megatron's adapter class names and what each becomes (V1 / V2: Megatron-Core's next release has them)
_OURS = {
    "FullyShardedDataParallel": ShardwiseFSDPType,
    "FullyShardedDataParallelV1": FullyShardedDataParallelV1,
    "FullyShardedDataParallelV2": FullyShardedDataParallelV2,
}


def _rebind(pairs: list[tuple[Any, Any]]) -> list[tuple[Any, str, Any]]:
    """In every imported ``megatron.*`` module, point each attribute that is some ``old`` at its ``new``.

    ``pairs`` is ``[(old, new), ...]``; returns ``(module, attribute, old)`` for each one changed.
    """
    changed = []
    for module_name in sorted(m for m in list(sys.modules) if m == "megatron" or m.startswith("megatron.")):
        module = sys.modules.get(module_name)
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for attribute, value in list(namespace.items()):
            for old, new in pairs:
                if value is old:
                    setattr(module, attribute, new)
                    changed.append((module, attribute, old))
                    break
    return changed


class MegatronNames:
    """The Megatron module attributes :func:`use_in_megatron` replaced, and their originals."""

    def __init__(self, swaps: list[tuple[Any, Any]], replaced: list[tuple[Any, str, Any]]):
        self.swaps = swaps  # (Megatron's class, shardwise's replacement)
        self.replaced = replaced  # (module, attribute, Megatron's class)

    @property
    def modules(self) -> list[str]:
        return sorted({module.__name__ for module, _, _ in self.replaced})

    @property
    def names(self) -> list[str]:
        """``module.attribute`` of each replaced binding (``megatron.training.training.megatron_FSDP``)."""
        return [f"{module.__name__}.{attribute}" for module, attribute, _ in self.replaced]

    def restore(self) -> None:
        """Put Megatron's own classes back: where they were replaced, and in modules imported since."""
        _rebind([(ours, original) for original, ours in self.swaps])
        self.swaps, self.replaced = [], []

    def __enter__(self) -> "MegatronNames":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def use_in_megatron() -> MegatronNames:
    """Make Megatron use shardwise's Megatron-FSDP wrappers; call it before building the model.

    Megatron's ``FullyShardedDataParallel`` class becomes :class:`ShardwiseFSDPType`
    and, where Megatron has them, its ``FullyShardedDataParallelV1`` / ``V2`` become
    shardwise's classes, under every name an imported ``megatron.*`` module binds
    them to (``training.py``'s ``megatron_FSDP`` included); later imports read
    shardwise's from those modules. Says once, at INFO, what it replaced.
    ``ImportError`` with the install command when Megatron-Core is missing.
    """
    try:
        adapter = importlib.import_module(_ADAPTER)
    except ImportError as err:
        raise ImportError(
            "use_in_megatron() needs Megatron-Core (pip install megatron-core); shardwise.megatron "
            f"itself works without it ({err})"
        ) from err
    swaps = [
        (getattr(adapter, name), ours)
        for name, ours in _OURS.items()
        if isinstance(getattr(adapter, name, None), type) and getattr(adapter, name) not in _OURS.values()
    ]
    names = MegatronNames(swaps, _rebind(swaps))
    if swaps:
        logger.info(
            "use_in_megatron: Megatron's %s replaced by shardwise's in %d bindings: %s",
            ", ".join(original.__name__ for original, _ in swaps), len(names.replaced), ", ".join(names.names),
        )
    else:
        logger.info("use_in_megatron: Megatron's Megatron-FSDP classes are already shardwise's; nothing replaced")
    return names
