"""Where a sharded model's engine buffers live: what the graph-safe tests hold still from step to step."""

from __future__ import annotations

import torch

from shardwise.engine.model_ops import sharded_state


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.untyped_storage().nbytes() == 0 else t.untyped_storage().data_ptr()


def engine_addresses(model) -> dict:
    """Every group's buffer storage address (0: none) by ``group.buffer``, the graph-safe buffers kept for good
    (gradients, cast ``.grad`` copies) among them, and the staging pool's buffers under ``pool``."""
    state = sharded_state(model)
    out = {}
    for group in state.groups:
        buffers = {"model_shard": group.model_shard, "main": group.main, "unsharded": group.unsharded,
                   **group.window.graph_safe_buffers}
        out.update({f"{group.name}.{kind}": _address(t) for kind, t in buffers.items()})
    pool = state.streams.pool
    out["pool"] = sorted(b.data_ptr() for b in pool.buffers()) if hasattr(pool, "buffers") else None
    return out
