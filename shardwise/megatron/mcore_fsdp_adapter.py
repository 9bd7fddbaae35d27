"""The Megatron-Core FSDP adapter: ``FullyShardedDataParallel`` and its V1 and V2 wrappers.

Megatron-LM wraps each model chunk with
``FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules,
disable_bucketing, device, pg_collection)``. This module gives Megatron users
that call on top of :func:`shardwise.fully_shard`:

* :func:`FullyShardedDataParallel` picks the wrapper from
  ``ddp_config.megatron_fsdp_version`` (1 or 2).
* :class:`FullyShardedDataParallelV1` drives the engine with Megatron's
  schedule API (``start_param_sync``, ``finish_grad_sync``, ``no_sync``,
  ``broadcast_params``, ...), all four strategies and HSDP / HFSDP.
* :class:`FullyShardedDataParallelV2` lets the engine's hooks do everything,
  needs an explicit ``pg_collection`` and rejects, by field name, every option
  it does not support.

Both are faces of the one engine. Configs and process groups may be this
package's or Megatron-Core's own objects (read by field name). Both compose
FSDP with tensor parallelism (a ``dp x tp`` or ``dp_outer x dp_shard x tp``
mesh) and with expert parallelism (experts over an ``(expert_dp, ep)`` mesh,
the rest over ``dp_cp``); the model must be built with ``pg_collection``'s
``tp`` / ``ep`` groups. V1 also composes with pipeline parallelism (each
stage's chunk over that stage's ``dp_cp``, one wrapper per virtual chunk).
Not built yet, and rejected by field name: TP together with EP, expert tensor
parallelism, and (V2) pipeline or context parallelism.
"""

from __future__ import annotations

from typing import List, Optional, Type

import torch
import torch.nn as nn

from .base import _BaseDataParallel
from .config import DistributedDataParallelConfig, TransformerConfig
from .process_groups import ProcessGroupCollection
from .v1 import FullyShardedDataParallelV1
from .v2 import FullyShardedDataParallelV2

__all__ = ["FullyShardedDataParallel"]


# ------------------------------------------------------------------ factory
def FullyShardedDataParallel(
    config: TransformerConfig,
    ddp_config: DistributedDataParallelConfig,
    module: nn.Module,
    fsdp_unit_modules: Optional[List[Type[nn.Module]]] = None,
    disable_bucketing: bool = False,
    device: Optional[torch.device] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> _BaseDataParallel:
    """Construct the configured Megatron-FSDP implementation.

    A factory, not a type: ``ddp_config.megatron_fsdp_version`` 1 gives
    :class:`FullyShardedDataParallelV1`, 2 :class:`FullyShardedDataParallelV2`;
    anything else is a ``ValueError``. Use those classes for type checks.
    """
    version = getattr(ddp_config, "megatron_fsdp_version", 1)
    classes = {1: FullyShardedDataParallelV1, 2: FullyShardedDataParallelV2}
    if type(version) is not int or version not in classes:
        raise ValueError(f"megatron_fsdp_version={version!r} is not supported; expected 1 or 2")
    return classes[version](config, ddp_config, module, fsdp_unit_modules, disable_bucketing, device, pg_collection)
