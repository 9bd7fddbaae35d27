"""Make Megatron-Core and Megatron-LM build and recognise shardwise's wrappers.

Megatron-LM builds its Megatron-FSDP chunks with the name
``FullyShardedDataParallel`` imported from ``megatron.core.distributed``, and
recognises them with ``isinstance``: ``unwrap_model`` against that name
(Megatron-Core 0.16-0.19), ``training.py`` against the V1/V2 classes (the next
release). A wrapper Megatron does not recognise trains, but its ``no_sync_func``
is never installed and ``unwrap_model`` stops at it, silently.
:func:`use_in_megatron` points those names at shardwise, in the Megatron
modules already imported and in the packages later imports read from, and
gives the change back on :meth:`MegatronNames.restore` (or at the end of a
``with`` block). ``megatron.core`` is imported only here, only when asked.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .mcore_fsdp_adapter import FullyShardedDataParallel, FullyShardedDataParallelV1, FullyShardedDataParallelV2

__all__ = ["use_in_megatron", "MegatronNames", "ShardwiseFSDPType"]

_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
_PACKAGES = ("megatron.core.distributed", "megatron.core.distributed.fsdp", _ADAPTER)
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
    """What Megatron's ``FullyShardedDataParallel`` name means after :func:`use_in_megatron`.

    Calling it is :func:`shardwise.megatron.FullyShardedDataParallel` (V1 or V2
    by ``ddp_config.megatron_fsdp_version``); ``isinstance(chunk, it)`` holds for
    both wrappers, as Megatron's own checks expect of its class.
    """


class MegatronNames:
    """The Megatron module attributes :func:`use_in_megatron` replaced, and their originals."""

    def __init__(self, replaced: list[tuple[Any, str, Any]]):
        self.replaced = replaced

    @property
    def modules(self) -> list[str]:
        return sorted({module.__name__ for module, _, _ in self.replaced})

    def restore(self) -> None:
        """Put Megatron's own classes back where they were replaced."""
        for module, name, original in reversed(self.replaced):
            setattr(module, name, original)
        self.replaced = []

    def __enter__(self) -> "MegatronNames":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def use_in_megatron() -> MegatronNames:
    """Make Megatron use shardwise's Megatron-FSDP wrappers; call it before building the model.

    ``FullyShardedDataParallel`` becomes :class:`ShardwiseFSDPType` and, where
    Megatron has them, ``FullyShardedDataParallelV1`` / ``V2`` become shardwise's
    classes: in ``megatron.core.distributed``, its ``fsdp`` package and
    ``mcore_fsdp_adapter`` (where later ``from ... import`` statements and
    ``unwrap_model`` read them), and in every already imported ``megatron.*``
    module that holds Megatron's originals (``megatron.training.training``).
    ``ImportError`` with the install command when Megatron-Core is missing.
    """
    try:
        adapter = importlib.import_module(_ADAPTER)
    except ImportError as err:
        raise ImportError(
            "use_in_megatron() needs Megatron-Core (pip install megatron-core); shardwise.megatron "
            f"itself works without it ({err})"
        ) from err
    ours = {
        "FullyShardedDataParallel": ShardwiseFSDPType,
        "FullyShardedDataParallelV1": FullyShardedDataParallelV1,
        "FullyShardedDataParallelV2": FullyShardedDataParallelV2,
    }
    originals = {name: getattr(adapter, name) for name in ours if hasattr(adapter, name)}
    originals = {name: value for name, value in originals.items() if value is not ours[name]}
    replaced = []
    for module_name in sorted({*_PACKAGES, *(m for m in list(sys.modules) if m.startswith("megatron."))}):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                replaced.append((module, name, original))
                setattr(module, name, ours[name])
    return MegatronNames(replaced)
