"""Megatron-Core's two configuration objects, with Megatron's field names and types.

``TransformerConfig`` carries the model and model-parallel settings the adapter
reads; ``DistributedDataParallelConfig`` the data-parallel and sharding ones.
A Megatron user can pass these, or Megatron-Core's own objects: the adapter reads
every field through :func:`as_transformer_config` / :func:`as_ddp_config`,
which copy whatever fields the given object has over the defaults below
(duck typing; ``megatron.core`` is never imported).

Each field's annotation and default are Megatron-Core's own, read from its
source for every supported release (0.16.1 and 0.19.2; ``scripts/
megatron_core_fields.py`` records them and ``tests/megatron/
test_megatron_core_real.py`` holds this mirror to them). Fields a release does
not have keep the defaults below. Only fields the adapter reads or must reject
are mirrored; unknown extra attributes of a passed-in object are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Tuple

import torch

from ..engine.placements import OUTER_STRATEGY_PLACEMENTS, STRATEGY_PLACEMENTS

__all__ = [
    "TransformerConfig",
    "DistributedDataParallelConfig",
    "as_transformer_config",
    "as_ddp_config",
    "SHARDING_STRATEGIES",
    "OUTER_SHARDING_STRATEGIES",
]

# Megatron-FSDP's strategy names are the rows of the engine's table (placements.py)
SHARDING_STRATEGIES = tuple(STRATEGY_PLACEMENTS)
OUTER_SHARDING_STRATEGIES = tuple(OUTER_STRATEGY_PLACEMENTS)

# What a declared type admits (bool is not an int here: ``bucket_size=True`` is a mistake).
_ADMITS = {
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "torch.dtype": (torch.dtype,),
}


def _declared_kind(annotation: str) -> tuple[str, bool]:
    """``(kind, optional)`` of an annotation string: ``Optional[Literal['a', 'b']]`` -> ``("str", True)``."""
    optional = annotation.startswith("Optional[")
    kind = annotation[len("Optional["):-1] if optional else annotation
    if kind.startswith("Literal["):
        kind = "str" if re.fullmatch(r"Literal\[('[^']*'(, )?)+\]", kind) else kind
    return kind, optional


def _check_field_types(config) -> None:
    """Refuse a value whose type is not the one Megatron-Core declares (``bf16="false"`` is truthy).

    ``None`` passes where the field is ``Optional`` or where Megatron's own
    default is ``None`` (``suggested_communication_unit_size: int = None``):
    every value the real classes hold by default is accepted. ``None`` in a
    ``bool`` field is what Megatron-LM passes for a flag left unset (its argparse
    default, e.g. ``--use-cpu-initialization``); Megatron-Core reads its bools
    by truth value, so the field is read as ``False``.
    """
    for f in fields(config):
        value = getattr(config, f.name)
        kind, optional = _declared_kind(str(f.type))
        admits = _ADMITS.get(kind)
        if admits is None or (value is None and (optional or f.default is None)):
            continue
        if value is None and kind == "bool":
            setattr(config, f.name, False)
            continue
        wrong_bool = isinstance(value, bool) and bool not in admits
        if wrong_bool or not isinstance(value, admits):
            nullable = optional or f.default is None
            raise TypeError(
                f"{type(config).__name__}.{f.name}={value!r} must be {'None or ' if nullable else ''}{kind}"
            )


@dataclass
class TransformerConfig:
    """Model and model-parallel settings (a subset of Megatron-Core's ``TransformerConfig``)."""

    # sizes (the adapter does not build the model; these document it)
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    # model parallelism (Megatron's ModelParallelConfig)
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
    fp8: Optional[Literal['e4m3', 'hybrid']] = None
    fp8_recipe: Optional[Literal['tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom']] = "delayed"
    fp8_param: bool = False
    fp4: Optional[Literal['e2m1']] = None
    # initialization
    init_model_with_meta_device: bool = False
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    # training-loop features that change how gradients are produced or reduced
    calculate_per_token_loss: bool = False
    gradient_accumulation_fusion: bool = False
    delay_wgrad_compute: bool = False
    gated_linear_unit: bool = False
    # CUDA graphs ("full_iteration" is 0.19's)
    cuda_graph_impl: Literal['none', 'local', 'transformer_engine', 'full_iteration'] = "none"
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
    them is HSDP, ``"optim"`` is HFSDP. ``megatron_fsdp_version`` (not in
    Megatron-Core 0.19 yet; the adapter's next API) picks the V1 or V2 wrapper
    in :func:`FullyShardedDataParallel`. ``None`` in the ``megatron_fsdp_*_dtype``
    fields is Megatron-LM's ``auto``, read as Megatron-FSDP 0.19 reads it (the
    compute dtype; :mod:`shardwise.megatron.main_dtypes`). What each field does,
    or why it is refused or ignored: :mod:`shardwise.megatron.options`.
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
    reduce_scatter_with_fp32_accumulation: bool = False
    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()
    average_in_collective: bool = False
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int = None
    delay_wgrad_compute: bool = False
    # low-precision parameter gathers
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    preserve_fp32_weights: bool = True  # 0.16's; gone in 0.19
    keep_fp8_transpose_cache: bool = False
    # Megatron-FSDP
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    megatron_fsdp_version: int = 1
    data_parallel_sharding_strategy: str = "no_shard"
    outer_dp_sharding_strategy: str = "no_shard"
    expert_data_parallel_sharding_strategy: Optional[str] = None
    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32
    megatron_fsdp_main_grads_dtype: Optional[torch.dtype] = None
    megatron_fsdp_grad_comm_dtype: Optional[torch.dtype] = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
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
        _check_field_types(obj)  # fields may have been assigned after construction
        return obj
    if obj is None:
        return cls()
    values = {f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)}
    return cls(**values)


def as_transformer_config(config: Any) -> TransformerConfig:
    """``config`` itself when it is ours; else a copy of the fields it has (e.g. Megatron-Core's own)."""
    return _copy_fields(TransformerConfig, config)


def as_ddp_config(ddp_config: Any) -> DistributedDataParallelConfig:
    """``ddp_config`` itself when it is ours; else a copy of the fields it has."""
    return _copy_fields(DistributedDataParallelConfig, ddp_config)
