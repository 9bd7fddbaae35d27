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

The module also carries every other name the adapter's API page documents
(the mesh and placement helpers, meta-device materialization, RNG state, the
module logger), for tools built on Megatron-Core that import them from here;
each is the shardwise code that does the work (the same object, or a thin call
into it), never a second copy.
"""

from __future__ import annotations

from typing import List, Optional, Type

import torch
import torch.nn as nn

from ..engine.materialize import materialize_meta_module, materialize_owned_meta_modules
from ..engine.placements import AxisPlacements
from ..engine.rng import get_rng_state_dict, load_rng_state_dict
from .base import _BaseDataParallel, logger  # noqa: F401  (the page's module logger)
from .config import DistributedDataParallelConfig, TransformerConfig
from . import meshes
from .meshes import (  # noqa: F401  (the page documents these names in this module)
    _DATA_PARALLEL_PLACEMENTS,
    _build_hybrid_dp_mesh,
    _check_mesh_ranks_and_group_ranks_are_consistent,
    _get_dp_tp_mesh,
    _get_hsdp_tp_mesh,
)
from .process_groups import ProcessGroupCollection
from .v1 import FullyShardedDataParallelV1
from .v2 import FullyShardedDataParallelV2

__all__ = ["FullyShardedDataParallel"]

# How one mesh axis places each of MFSDP's three buffers (parameter, gradient, optimizer): the engine's.
_AxisPlacements = AxisPlacements


def _build_expert_mesh_and_placements(config, ddp_config, pg_collection, device_type: str):
    """Build the expert-DP mesh and placements, or return neither when EP is disabled (``meshes``'s, with no
    model to look for expert parameters in)."""
    return meshes._build_expert_mesh_and_placements(config, ddp_config, pg_collection, device_type)


# ------------------------------------------------------------------ meta init and RNG
def _materialize_meta_module(module: nn.Module, device: Optional[torch.device]) -> None:
    """Materialize and initialize one module's direct meta parameters (and buffers)."""
    materialize_meta_module(module, device)


def _materialize_owned_meta_modules(module: nn.Module, device: Optional[torch.device]) -> None:
    """Materialize meta parameters reachable from one FSDP unit.

    Each module's ``reset_parameters()`` runs before the unit is sharded, so a reset
    that initializes in place (PyTorch) and one that replaces its ``Parameter`` via
    ``setattr`` (Transformer Engine) both end in the parameters that get sharded.
    """
    materialize_owned_meta_modules(module, device)


def _get_rng_state_dict() -> dict:
    """Python, NumPy, torch CPU, CUDA (where present) and tensor-parallel tracker RNG states."""
    return get_rng_state_dict()


def _load_rng_state_dict(rng_state_dict: dict) -> None:
    """Restore what :func:`_get_rng_state_dict` captured."""
    load_rng_state_dict(rng_state_dict)


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
