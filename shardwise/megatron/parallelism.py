"""Tensor-parallel layout of parameters, inferred from the modules that hold them.

Sharding a tensor-parallel model over data-parallel ranks needs to know, per
parameter, whether it is split along its rows (``"column"``: a column-parallel
linear's output features, a vocab-parallel embedding's rows), along its columns
(``"row"``: a row-parallel linear's input features) or identical on every TP
rank (``"replicated"``). The rules, in order:

1. ``TELayerNormColumnParallelLinear``: its ``layer_norm_*`` tensors are
   replicated, everything else is column-parallel.
2. The holder's class name is in the registry (``column`` / ``row`` /
   ``replicated``); a row-parallel layer's bias is replicated (it is added after
   the all-reduce).
3. The holder has a ``tensor_model_parallel`` attribute: ``False`` means
   replicated, else ``partition_dim`` 0 is column and 1 is row (bias replicated).
4. The parameter itself carries ``tensor_model_parallel`` / ``partition_dim``
   (as Megatron's and shardwise's parallel layers mark them): same reading.
5. Normalization layers (class name containing ``Norm``) are replicated.
6. ``TELinear`` follows its ``parallel_mode`` (``column``, ``row``, else replicated).

Anything else is unknown: ``None``, and no attribute is set.

The engine itself reads Megatron's per-parameter marks (``tensor_model_parallel``,
``partition_dim``): :func:`mark_tensor_parallel` writes them from the detected
mode onto parameters that do not carry them yet, so a layer recognized only by
its class name is still sharded as the TP slice it is.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch.nn as nn

__all__ = [
    "MODULE_TYPE_REGISTRY",
    "detect_parallelism_type",
    "annotate_tensor_parallelism",
    "mark_tensor_parallel",
    "TENSOR_PARALLEL_MODE_ATTR",
]

TENSOR_PARALLEL_MODE_ATTR = "_tensor_parallel_mode"

MODULE_TYPE_REGISTRY: dict[str, set] = {
    "column": {
        "ColumnParallelLinear",
        "TEColumnParallelLinear",
        "TELayerNormColumnParallelLinear",
        "TEColumnParallelGroupedLinear",
        "VocabParallelEmbedding",
        "DotProductAttention",  # its attention-sink parameter is split by heads
        "TEDotProductAttention",
    },
    "row": {"RowParallelLinear", "TERowParallelLinear", "TERowParallelGroupedLinear"},
    "replicated": {
        "TENorm",
        "FusedLayerNorm",
        "WrappedTorchNorm",
        "LayerNorm",
        "RMSNorm",
        "L2Norm",
        "IdentityOp",
        "TopKRouter",
    },
}


def _is_bias(param_name: str) -> bool:
    return "bias" in param_name


def _from_partition(tensor_parallel, partition_dim, param_name: str) -> Optional[str]:
    if not tensor_parallel:
        return "replicated"
    if partition_dim == 0:
        return "column"
    if partition_dim == 1:
        return "replicated" if _is_bias(param_name) else "row"
    return None


def detect_parallelism_type(
    param_name: str, module: nn.Module, registry: Mapping[str, set] = MODULE_TYPE_REGISTRY
) -> Optional[str]:
    """``"column"``, ``"row"`` or ``"replicated"`` for ``module``'s parameter ``param_name``; else ``None``."""
    kind = type(module).__name__
    if kind == "TELayerNormColumnParallelLinear":
        fused_norm = param_name.endswith(("layer_norm_weight", "layer_norm_bias"))
        return "replicated" if fused_norm else "column"
    for mode, names in registry.items():
        if kind in names:
            return "replicated" if mode == "row" and _is_bias(param_name) else mode
    if hasattr(module, "tensor_model_parallel"):
        found = _from_partition(module.tensor_model_parallel, getattr(module, "partition_dim", None), param_name)
        if found is not None:
            return found
    param = module._parameters.get(param_name)
    if param is not None and hasattr(param, "tensor_model_parallel"):
        found = _from_partition(param.tensor_model_parallel, getattr(param, "partition_dim", None), param_name)
        if found is not None:
            return found
    if "Norm" in kind or "Normalization" in kind:
        return "replicated"
    if kind == "TELinear":
        mode = getattr(module, "parallel_mode", None)
        if mode == "column":
            return "column"
        if mode == "row":
            return "replicated" if _is_bias(param_name) else "row"
        return "replicated"
    return None


def annotate_tensor_parallelism(
    root: nn.Module, registry: Mapping[str, set] = MODULE_TYPE_REGISTRY
) -> dict[str, str]:
    """Set ``_tensor_parallel_mode`` on every parameter whose layout is known; return ``{fqn: mode}``."""
    found: dict[str, str] = {}
    for prefix, module in root.named_modules():
        for name, param in module.named_parameters(recurse=False):
            mode = detect_parallelism_type(name, module, registry)
            if mode is not None:
                setattr(param, TENSOR_PARALLEL_MODE_ATTR, mode)
                found[f"{prefix}.{name}" if prefix else name] = mode
    return found


_PARTITION_DIM = {"column": 0, "row": 1}


def mark_tensor_parallel(root: nn.Module, modes: Mapping[str, str]) -> list[str]:
    """Give every parameter the engine's tensor-parallel marks; return the names of those left unknown.

    A parameter that already carries ``tensor_model_parallel`` keeps its marks (the
    layer that split it knows best). Otherwise ``modes[name]`` decides: ``column``
    is ``tensor_model_parallel=True, partition_dim=0``, ``row`` the same with
    ``partition_dim=1``, ``replicated`` is ``tensor_model_parallel=False``. The
    parameters in neither case are returned: the engine treats them as
    replicated over the TP ranks (it broadcasts them from TP rank 0).
    """
    unknown = []
    for name, param in root.named_parameters():
        if hasattr(param, "tensor_model_parallel"):
            continue
        mode = modes.get(name)
        if mode is None:
            unknown.append(name)
        elif mode == "replicated":
            param.tensor_model_parallel = False
        else:
            param.tensor_model_parallel = True
            param.partition_dim = _PARTITION_DIM[mode]
    return unknown
