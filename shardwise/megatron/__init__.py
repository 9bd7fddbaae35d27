"""The Megatron-Core face of shardwise.

Megatron-LM users build the same objects they already pass to Megatron's FSDP:

    from shardwise.megatron import (
        FullyShardedDataParallel, TransformerConfig, DistributedDataParallelConfig, build_process_groups,
    )
    model = FullyShardedDataParallel(config, ddp_config, model, pg_collection=build_process_groups())

Megatron-Core's own config and process-group objects work too (read by field
name); ``megatron.core`` is never required. Under Megatron-LM, call
``use_in_megatron()`` first: Megatron then builds and recognises these wrappers.
"""

from .config import DistributedDataParallelConfig, TransformerConfig, as_ddp_config, as_transformer_config
from .mcore_fsdp_adapter import (
    FullyShardedDataParallel,
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
)
from .base import MegatronFSDPLevel
from .buffer_view import ParamAndGradBufferView
from .install import MegatronNames, use_in_megatron
from .parallelism import MODULE_TYPE_REGISTRY, annotate_tensor_parallelism, detect_parallelism_type, mark_tensor_parallel
from .process_groups import ProcessGroupCollection, build_process_groups, rank_layout

__all__ = [
    "FullyShardedDataParallel",
    "FullyShardedDataParallelV1",
    "FullyShardedDataParallelV2",
    "MegatronFSDPLevel",
    "use_in_megatron",
    "MegatronNames",
    "ParamAndGradBufferView",
    "TransformerConfig",
    "DistributedDataParallelConfig",
    "as_transformer_config",
    "as_ddp_config",
    "ProcessGroupCollection",
    "build_process_groups",
    "rank_layout",
    "MODULE_TYPE_REGISTRY",
    "detect_parallelism_type",
    "annotate_tensor_parallelism",
    "mark_tensor_parallel",
]
