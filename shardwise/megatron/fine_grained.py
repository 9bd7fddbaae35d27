"""``megatron_fsdp_enable_fine_grained_param_gather``: per-submodule gathers instead of per-layer ones.

Megatron-FSDP 0.19 then gathers each submodule's own parameters in that
submodule's forward pre-hook (``parameters(recurse=False)``) instead of a whole
FSDP unit's at the unit's forward. The engine's granularity is its units, so the
same thing is the units replaced by their submodules that hold parameters
directly: each is gathered before its own forward, freed after it, and reduced
after its own backward. The numbers are the same (a gather copies, a reduction
averages element by element); what changes is how many weights are gathered at
once and how many collectives a layer takes.

One exception, Megatron's own: a linear layer with ``skip_bias_add`` hands its bias
*Parameter* to the layer, which adds it after the linear returned
(``bias_dropout_add``); freed at the linear's end, it would be read from released
memory. Such a submodule is no unit of its own: its parameters stay with the
layer's unit, gathered for the layer's whole forward (with ``--disable-bias-linear``,
as the Llama recipes run, there is no bias and every submodule is its own unit).
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

__all__ = ["fine_grained_units"]


def _hands_out_a_parameter(module: nn.Module) -> bool:
    """Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` with ``skip_bias_add`` return ``self.bias``."""
    return bool(getattr(module, "skip_bias_add", False)) and isinstance(getattr(module, "bias", None), nn.Parameter)


def fine_grained_units(model: nn.Module, unit_types: Sequence[type]) -> list[nn.Module]:
    """The engine's units for per-submodule gathers: the submodules of every ``unit_types`` module of ``model``
    that hold a parameter directly, and the module itself where it holds one or a submodule hands one out."""
    types = tuple(unit_types)
    units: list[nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if module is model or not isinstance(module, types) or id(module) in seen:
            continue
        whole = next(module.parameters(recurse=False), None) is not None
        for sub in module.modules():
            if sub is module or id(sub) in seen or next(sub.parameters(recurse=False), None) is None:
                continue
            if _hands_out_a_parameter(sub):
                whole = True  # its parameters stay with ``module``'s unit
                continue
            seen.add(id(sub))
            units.append(sub)
        if whole:
            seen.add(id(module))
            units.append(module)
    return units
