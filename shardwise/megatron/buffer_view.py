"""``param_and_grad_buffer``: what Megatron-Core's optimizer reaches for on a Megatron-FSDP chunk.

Megatron's ``DistributedOptimizer`` leaves weights and gradients to
Megatron-FSDP when ``ddp_config.use_megatron_fsdp`` is set, and after its step
asks each model chunk's ``param_and_grad_buffer`` to rebuild the compute
weights from the updated main weights
(``copy_main_weights_to_model_weights()``); its FP8 paths also list
``parameter_groups``. This is a view onto the engine's parameter groups that
answers those calls through :mod:`shardwise.engine.model_ops`, not a second set of buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..engine.model_ops import parameter_groups, refresh_model_weights
from .nccl_ub import register_manually

__all__ = ["ParamAndGradBufferView", "ParameterGroupView"]


@dataclass(frozen=True)
class ParameterGroupView:
    """One engine parameter group as Megatron lists it: its parameters (the main-weight DTensors)
    and the dtype forward computes in."""

    params: tuple[nn.Parameter, ...]
    dtype: torch.dtype


class ParamAndGradBufferView:
    """Megatron-FSDP's ``param_and_grad_buffer`` API over a model that ``fully_shard`` wrapped."""

    def __init__(self, module: nn.Module, rebuild_now: bool = True, ddp_config=None, user_buffers=None):
        self._module = module
        self._ddp_config = ddp_config
        self._user_buffers = user_buffers  # the chunk's NcclUserBuffers (nccl_ub on NCCL), else None
        # graph-safe mode: the rebuild belongs to the next forward (inside Megatron-LM's captured
        # iteration, so every replay redoes it), never to the eager optimizer step.
        self._rebuild_now = rebuild_now

    @property
    def parameter_groups(self) -> list[ParameterGroupView]:
        return [ParameterGroupView(params, dtype) for params, dtype in parameter_groups(self._module)]

    def copy_main_weights_to_model_weights(self) -> None:
        """Rebuild the compute weights from the main weights the optimizer just stepped.

        Where parameters are replicated but the optimizer state is sharded
        (ZeRO-1/2, HFSDP's outer axis) this gathers the updated shards now; a
        ZeRO-3 unit casts and gathers at its next forward, as it always does. In graph-safe mode
        the weights are only marked changed: the next forward rebuilds them in place (a replay
        cannot run the host logic that would decide it).
        """
        if self._rebuild_now:
            refresh_model_weights(self._module)
        else:
            self._module.mark_weights_modified()

    def manual_buffer_registration(self) -> None:
        """Register the chunk's NCCL user-buffer pool now (Megatron-LM calls it after the first iteration under
        ``--use-nccl-ub``): see :func:`shardwise.megatron.nccl_ub.register_manually`."""
        register_manually(self._ddp_config, self._user_buffers)
