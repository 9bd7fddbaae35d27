"""``compile_units``: ``torch.compile`` each unit's own ``forward``, the engine's hooks outside.

A unit's hooks gather, free and reduce its parameters (collectives, side
streams, storage resizes); a graph cannot hold them, and tracing them breaks
the graph (``nn.Module.compile()`` compiles the module's whole ``__call__``,
hooks included). So only ``forward`` is compiled: ``module(...)`` runs the
pre-forward hook eagerly (the parameters are now the unsharded ones), then the
compiled ``forward``, then the post-forward hook. The hooks are also opaque to
the compiler (``step_controller.opaque_to_compiler``), for code that compiles more than
a unit.

Why the compiled code is reused every step: the hooks always swap in the same
unsharded ``nn.Parameter`` objects (their storage is freed and regathered, the
tensors stay), of the same shape, dtype and strides, so the guards compiled
against the first step hold for every later one; and all units of one class
share one compiled graph (parameters are graph inputs).
"""

from __future__ import annotations

from typing import Iterable, Type, Union

import torch
import torch.nn as nn

from .model_ops import is_sharded, sharded_state

__all__ = ["compile_units"]

_COMPILED_ATTR = "_shardwise_compiled_forward"


def compile_units(
    module: nn.Module,
    modules: Iterable[Union[Type[nn.Module], nn.Module]] | Type[nn.Module] | nn.Module | None = None,
    **compile_kwargs,
) -> list[str]:
    """Compile the ``forward`` of each unit of a ``shardwise.fully_shard``-ed ``module``.

    ``modules`` (classes or instances) picks which units; by default every
    unit that contains no other unit (an outer unit's forward would call an
    inner unit's hooks from inside its graph). ``compile_kwargs`` go to
    ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ...).
    Call it after ``fully_shard``; the root's own forward stays eager.
    Returns the names of the units compiled.
    """
    if not is_sharded(module):
        raise ValueError(
            f"{type(module).__name__} is not sharded by shardwise.fully_shard; call fully_shard(...) first"
        )
    units = sharded_state(module).units
    nested = {
        id(u) for u in units
        if any(o is not u and any(m is o.module for m in u.module.modules()) for o in units)
    }
    if modules is None:
        chosen = [u for u in units if id(u) not in nested]
    else:
        if isinstance(modules, (type, nn.Module)):
            modules = [modules]
        specs = list(modules)
        for spec in specs:
            if not (isinstance(spec, nn.Module) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
                raise TypeError(f"modules entry {spec!r} must be an nn.Module class or instance")

        def picked(unit) -> bool:
            return any(unit.module is s if isinstance(s, nn.Module) else isinstance(unit.module, s) for s in specs)

        chosen = [u for u in units if picked(u)]
        for spec in specs:
            if not any(u.module is spec if isinstance(spec, nn.Module) else isinstance(u.module, spec) for u in units):
                name = spec.__name__ if isinstance(spec, type) else type(spec).__name__
                raise ValueError(f"modules names {name}, which is not a unit of this model (see unit_modules=)")
        outer = [u.name for u in chosen if id(u) in nested]
        if outer:
            raise ValueError(
                f"units {outer} contain other units; compile the inner units instead (an outer unit's "
                "compiled forward would call the inner units' gather/free hooks from inside its graph)"
            )
    names = []
    for unit in chosen:
        m = unit.module
        if getattr(m, _COMPILED_ATTR, False):
            continue  # compiled by an earlier call
        if "forward" in vars(m):
            raise ValueError(f"unit {unit.name!r} has its own instance attribute 'forward'; cannot compile it")
        m.forward = torch.compile(m.forward, **compile_kwargs)
        setattr(m, _COMPILED_ATTR, True)
        names.append(unit.name)
    return names
