"""What ``fully_shard(graph_safe=True)`` refuses: the features whose steps a CUDA graph cannot hold.

A captured graph replays fixed kernels on fixed addresses with no host in the
loop. Graph-safe mode makes the engine's own part of a step that way (static
buffers, ``GraphSafeStagingPool``; ``shardwise.engine.cuda_graphs`` captures it); these
features put the host or data-dependent sizes back into the step, so they are
refused by name when the model is wrapped, never found out at capture.
"""

from __future__ import annotations

import torch.nn as nn

from .offload import OffloadPolicy
from .registry import EXPERTS, module_types

__all__ = ["check_graph_safe", "refuse_unless_eager"]


def check_graph_safe(module: nn.Module, graph_safe: bool, offload_policy: OffloadPolicy | None,
                     expert_mesh) -> None:
    """Refuse, at wrap time, what graph-safe mode cannot capture (``graph_safe`` must be a bool)."""
    if not isinstance(graph_safe, bool):
        raise TypeError(f"graph_safe={graph_safe!r} must be a bool")
    if not graph_safe:
        return
    if offload_policy is not None and (offload_policy.units is not None or (offload_policy.fraction or 0) > 0):
        raise ValueError(
            f"graph_safe=True with offload_policy={offload_policy!r}: CPU offload steps the optimizer on the host "
            "and waits for host copies inside the step, which a CUDA graph cannot capture; use offload_policy=None")
    if expert_mesh is not None:
        raise ValueError(
            "graph_safe=True with expert_mesh: expert-parallel MoE dispatches tokens with all-to-alls whose sizes "
            "depend on the routing (read on the host), which a CUDA graph cannot capture; use graph_safe=False")
    experts = module_types(EXPERTS)
    routed = [name for name, m in module.named_modules() if experts and isinstance(m, experts)]
    if routed:
        raise ValueError(
            f"graph_safe=True with MoE experts ({', '.join(routed[:3])}{'...' if len(routed) > 3 else ''}): "
            "dynamic routing gives each expert a data-dependent number of tokens (sizes read on the host), "
            "which a CUDA graph cannot capture; use graph_safe=False")


def refuse_unless_eager(graph_safe: bool, what: str, why: str) -> None:
    """Refuse ``what`` on a graph-safe model (a feature built only for eager steps)."""
    if graph_safe:
        raise ValueError(f"{what} on a model wrapped with graph_safe=True: {why}; wrap it with graph_safe=False")
