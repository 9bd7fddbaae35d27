"""Megatron-Core's two configuration objects, with Megatron's field names.

``TransformerConfig`` carries the model and model-parallel settings the adapter
reads; ``DistributedDataParallelConfig`` the data-parallel and sharding ones.
A Megatron user can pass these, or Megatron's own objects: the adapter reads
every field through :func:`as_transformer_config` / :func:`as_ddp_config`,
which copy whatever fields the given object has over the defaults below
(duck typing; ``megatron.core`` is never imported).

Only fields that the adapter reads or must reject are here. Unknown extra
attributes on a passed-in object are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

__all__ = [
    "TransformerConfig",
    "DistributedDataParallelConfig",
    "as_transformer_config",
    "as_ddp_config",
    "SHARDING_STRATEGIES",
    "OUTER_SHARDING_STRATEGIES",
]

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

# The type each annotation admits (bool is not an int here: ``bucket_size=True`` is a mistake).
_ADMITS = {
    "bool": (bool,),
    "int": (int,),
    "str": (str,),
    "torch.dtype": (torch.dtype,),
}


def _check_field_types(config) -> None:
    """Refuse a field whose value is not of its declared type (``bf16="false"`` is truthy)."""
    for f in fields(config):
        value = getattr(config, f.name)
        declared = str(f.type)
        optional = declared.startswith("Optional[")
        kind = declared[len("Optional[") : -1] if optional else declared
        admits = _ADMITS.get(kind)
        if admits is None or (optional and value is None):
            continue
        wrong_bool = isinstance(value, bool) and bool not in admits
        if wrong_bool or not isinstance(value, admits):
            raise TypeError(
                f"{type(config).__name__}.{f.name}={value!r} must be {'None or ' if optional else ''}{kind}"
            )
OUTER_SHARDING_STRATEGIES = ("no_shard", "optim")


@dataclass
class TransformerConfig:
    """Model and model-parallel settings (a subset of Megatron-Core's ``TransformerConfig``)."""

    # sizes (the adapter does not build the model; these document it)
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    # model parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    # mixture of experts
    num_moe_experts: Optional[int] = None
    overlap_moe_expert_parallel_comm: bool = False
    # precision
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    fp8_param: bool = False
    fp4: Optional[str] = None
    # initialization
    init_model_with_meta_device: bool = False
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    # training-loop features that change how gradients are produced or reduced
    calculate_per_token_loss: bool = False
    gradient_accumulation_fusion: bool = False
    delay_wgrad_compute: bool = False
    gated_linear_unit: bool = False
    # CUDA graphs: "none", "local", "transformer_engine" or "full_iteration"
    cuda_graph_impl: str = "none"
    enable_cuda_graph: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)


@dataclass
class DistributedDataParallelConfig:
    """Data-parallel and sharding settings (Megatron-Core's ``DistributedDataParallelConfig``).

    ``data_parallel_sharding_strategy`` picks what is sharded over the
    data-parallel ranks: ``no_shard`` (DDP), ``optim`` (ZeRO-1), ``optim_grads``
    (ZeRO-2), ``optim_grads_params`` (ZeRO-3). With
    ``num_distributed_optimizer_instances > 1`` the data-parallel domain is split
    into that many replicas: ``outer_dp_sharding_strategy="no_shard"`` across
    them is HSDP, ``"optim"`` is HFSDP. ``megatron_fsdp_version`` picks the V1 or
    V2 wrapper in :func:`FullyShardedDataParallel`.
    """

    # gradient reduction
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    num_buckets: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    delay_wgrad_compute: bool = False
    # low-precision parameter gathers
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    # Megatron-FSDP
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    megatron_fsdp_version: int = 1
    data_parallel_sharding_strategy: str = "no_shard"
    outer_dp_sharding_strategy: str = "no_shard"
    expert_data_parallel_sharding_strategy: Optional[str] = None
    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32
    megatron_fsdp_main_grads_dtype: Optional[torch.dtype] = torch.float32
    megatron_fsdp_grad_comm_dtype: Optional[torch.dtype] = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
    megatron_fsdp_cuda_graph_mode: Optional[str] = None
    fsdp_all_gather_in_start_param_sync: bool = True
    # communication buffers (NCCL user buffers, double buffering)
    nccl_ub: bool = False
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    fsdp_trace_pool: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)


def _copy_fields(cls, obj: Any):
    if isinstance(obj, cls):
        return obj
    if obj is None:
        return cls()
    values = {f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)}
    return cls(**values)


def as_transformer_config(config: Any) -> TransformerConfig:
    """``config`` itself when it is ours; else a copy of the fields it has (e.g. Megatron's own)."""
    return _copy_fields(TransformerConfig, config)


def as_ddp_config(ddp_config: Any) -> DistributedDataParallelConfig:
    """``ddp_config`` itself when it is ours; else a copy of the fields it has."""
    return _copy_fields(DistributedDataParallelConfig, ddp_config)
