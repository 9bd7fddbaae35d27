"""Reference models in plain PyTorch: a Llama-style decoder with MoE and Mamba layers.

Build one from a :class:`GPTConfig`; ``config.layer_pattern`` mixes layer kinds
(A = attention, E = mixture of experts, M = Mamba). Every module with
parameters has ``reset_parameters()``; :func:`init_weights` calls them in a fixed
order, so meta-device construction plus ``to_empty`` reproduces a direct build.
:func:`pipeline_stage` cuts a GPT into pipeline stages under the whole model's names.
``GPTConfig(cp_group=...)`` splits each sequence over context-parallel ranks; each rank
feeds :func:`zigzag_split` of its rows (``context_parallel.py``).
"""

from ..engine.registry import EXPERTS, LAYER, LINEAR, register_module_type
from .attention import Attention
from .config import LAYER_KINDS, GPTConfig
from .context_parallel import context_parallel_attention, zigzag_split, zigzag_unsplit
from .gpt import GPT, LAYER_CLASSES, init_weights
from .mamba import MambaLayer, chunked_scan
from .mlp import MLP
from .moe import MoE, Experts, load_balancing_loss
from .norm_rope import RMSNorm, apply_rope, rope_tables
from .pipeline_split import GPTStage, StageInitializer, pipeline_stage, stage_indices, stage_layer_counts
from .tensor_parallel import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    gather_rows_from_tp_region,
    reduce_from_tp_region,
    scatter_rows_to_tp_region,
    tp_rows,
)
from .transformer import MoETransformerLayer, TransformerLayer

UNIT_MODULES = (TransformerLayer, MoETransformerLayer, MambaLayer)
"""Layer classes to hand to ``fully_shard(unit_modules=...)``."""

# The faces find these by role, without importing this package (shardwise.megatron's default units).
for _layer in UNIT_MODULES:
    register_module_type(LAYER, _layer)
register_module_type(EXPERTS, Experts)
for _linear in (Linear, ColumnParallelLinear, RowParallelLinear):  # what shardwise.engine.fp8 may convert
    register_module_type(LINEAR, _linear)
del _layer, _linear

__all__ = [
    "GPT", "GPTConfig", "LAYER_KINDS", "LAYER_CLASSES", "UNIT_MODULES", "init_weights",
    "TransformerLayer", "MoETransformerLayer", "MambaLayer", "Attention", "MLP", "MoE", "Experts",
    "RMSNorm", "rope_tables", "apply_rope", "chunked_scan", "load_balancing_loss",
    "Linear", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region",
    "GPTStage", "pipeline_stage", "stage_layer_counts", "stage_indices", "StageInitializer",
    "tp_rows", "scatter_rows_to_tp_region", "gather_rows_from_tp_region",
    "zigzag_split", "zigzag_unsplit", "context_parallel_attention",
]
