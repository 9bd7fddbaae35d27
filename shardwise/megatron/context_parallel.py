"""The Megatron face under context parallelism (``context_parallel_size > 1``): what is checked at wrap time.

Megatron-FSDP shards parameters and reduces gradients over ``dp_cp``: the CP
ranks of one data rank hold different tokens of the same sequences, so their
gradients sum as data parallelism's do. The wrappers already shard over
``pg_collection.dp_cp``; nothing in the engine changes under CP. What can go
wrong is around it, and is refused here by name before anything is sharded:

* the config's ``context_parallel_size`` and ``pg_collection.cp`` disagree;
* ``dp_cp`` does not hold this rank's whole CP group (the gradients of a
  sequence's tokens would not be summed);
* the model does not split its attention over that CP group. Two models are
  known to: shardwise's reference GPT built with ``GPTConfig(cp_group=...)``
  (the group's ranks must be ``pg_collection.cp``'s), and Megatron-Core's
  modules whose own ``config.context_parallel_size`` is the same size (their
  attention under CP is Transformer Engine's ``TEDotProductAttention``, GPU
  only; Megatron-Core's local ``DotProductAttention`` refuses CP itself).
  Any other model would train each rank's slice as if it were whole
  sequences: silently wrong, so refused.

The loss: each rank's gradients are averaged over ``dp_cp`` (``sum`` with
``calculate_per_token_loss``, then ``scale_gradients(1 / tokens)``), as
Megatron does. The GPT's loss is the token mean over whole sequences (the CP
group's sums over its counts), which makes that average exactly the one
loss's gradient; Megatron's ``loss_func`` (a rank's token sum over its own
tokens, averaged over ``dp_cp``) gives the same when every rank counts the
same tokens.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
import torch.nn as nn

from .process_groups import group_ranks, group_size

__all__ = ["check_context_parallel"]


def _declared_cp(module: nn.Module) -> tuple[list[list[int]], list[int]]:
    """What the model says of its own CP split: the rank lists of every shardwise ``cp_group`` found on a
    module's ``config``, and every Megatron-Core ``context_parallel_size`` found there."""
    groups, sizes = [], []
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is None:
            continue
        if hasattr(config, "cp_group"):  # shardwise's GPTConfig (None: attention over the rank's own tokens)
            if config.cp_group is not None:
                groups.append(group_ranks(config.cp_group))
        elif type(sub).__module__.startswith("megatron.core") and hasattr(config, "context_parallel_size"):
            sizes.append(int(config.context_parallel_size))
    return groups, sizes


def check_context_parallel(face: str, context_parallel_size: int, pg_collection, module: nn.Module) -> None:
    """Refuse a CP setup ``face`` (``FullyShardedDataParallelV1`` / ``V2``) cannot train right, by field and value.

    ``pg_collection=None`` means the groups are built from the config (their ``cp`` then agrees by
    construction; pass the built collection here).
    """
    cp = context_parallel_size
    cp_group: Optional[dist.ProcessGroup] = getattr(pg_collection, "cp", None)
    if group_size(cp_group) != cp:
        found = "missing" if cp_group is None else f"{group_size(cp_group)} ranks"
        raise ValueError(f"{face}: context_parallel_size={cp} needs pg_collection.cp with {cp} ranks, got {found}")
    if cp == 1:
        return
    dp_cp = getattr(pg_collection, "dp_cp", None)
    cp_ranks = group_ranks(cp_group)
    if dp_cp is None or not set(cp_ranks) <= set(group_ranks(dp_cp)):
        raise ValueError(
            f"{face}: context_parallel_size={cp}: pg_collection.dp_cp {group_ranks(dp_cp)} must hold this rank's "
            f"CP group {cp_ranks} (parameters are sharded and gradients reduced over data x context ranks)"
        )
    groups, sizes = _declared_cp(module)
    wrong = [ranks for ranks in groups if ranks != cp_ranks] + [size for size in sizes if size != cp]
    if wrong or not (groups or sizes):
        said = f"it splits over {wrong[0]}" if wrong else "it declares no context-parallel split"
        raise NotImplementedError(
            f"{face} with context_parallel_size={cp}: the model's attention must be split over pg_collection.cp "
            f"(ranks {cp_ranks}), but {said}. Built: shardwise's GPT with GPTConfig(cp_group=pg_collection.cp), "
            f"and Megatron-Core's GPTModel built with context_parallel_size={cp} (its attention under CP is "
            "Transformer Engine's TEDotProductAttention, which needs a GPU; Megatron-Core's local "
            "DotProductAttention has no context parallelism)"
        )
