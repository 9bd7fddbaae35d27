"""Every option a Megatron-LM user can hand Megatron-FSDP, and what shardwise does with it: one table.

A row is a field of Megatron-Core's ``DistributedDataParallelConfig`` or
``TransformerConfig`` (read field by field from 0.16.1's and 0.19.2's source), or
an argument of the adapter's constructor, with the Megatron-LM flags that set it
(``megatron/training/arguments.py``, ``core_r0.16.0`` and ``core_r0.19.0``) and one
verdict per face:

- IMPLEMENTED: what shardwise does with it;
- REFUSED: raised at wrap time as :class:`UnsupportedMegatronOption`, naming the
  field and value, why, and what to do; only for the values ``when`` says
  (the defaults always pass);
- IGNORED: why it is harmless; logged once at wrap time when set.

:func:`check_options` is what V1 and V2 call; ``docs/megatron-options.md`` is
:func:`render_markdown` (``python -m shardwise.megatron.options`` rewrites it).
Structural rules that need the process groups or the model (strategy names,
model-parallel sizes against ``pg_collection``) stay with the code that builds
the meshes; their rows say IMPLEMENTED and where the value is checked.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = [
    "Verdict", "Handling", "Option", "OPTIONS", "UnsupportedMegatronOption",
    "check_options", "render_markdown", "V1", "V2", "GRAPH_SAFE_REFUSALS", "asks_graph_safe",
]

logger = logging.getLogger("shardwise.megatron.mcore_fsdp_adapter")

V1, V2 = "FullyShardedDataParallelV1", "FullyShardedDataParallelV2"
DDP, TC, ARG = "DistributedDataParallelConfig", "TransformerConfig", "argument"


class UnsupportedMegatronOption(ValueError, NotImplementedError):
    """An option shardwise refuses at wrap time (a ``ValueError`` and a ``NotImplementedError``)."""


class Verdict(enum.Enum):
    IMPLEMENTED = "implemented"
    REFUSED = "refused"
    IGNORED = "ignored"


@dataclass(frozen=True)
class Handling:
    verdict: Verdict
    text: str  # IMPLEMENTED: what shardwise does; REFUSED: why; IGNORED: why it is harmless
    todo: str = ""  # REFUSED: what to do instead


def implemented(text: str) -> Handling:
    return Handling(Verdict.IMPLEMENTED, text)


def refused(why: str, todo: str) -> Handling:
    return Handling(Verdict.REFUSED, why, todo)


def ignored(why: str) -> Handling:
    return Handling(Verdict.IGNORED, why)


@dataclass(frozen=True)
class When:
    """Which values a REFUSED / IGNORED verdict takes effect on (the others, defaults included, pass);
    ``given``: a condition on the other configs too (``{DDP: ..., TC: ..., ARG: ...}``), if any."""

    text: str
    test: Callable[[Any], bool]
    given: Optional[Callable[[Mapping[str, Any]], bool]] = None

    def applies(self, value: Any, sources: Mapping[str, Any]) -> bool:
        return self.test(value) and (self.given is None or self.given(sources))


SET = When("set", lambda v: bool(v))
FALSE = When("False", lambda v: v is False)
NOT_NONE = When("not None", lambda v: v is not None)
NOT_ONE = When("not 1", lambda v: v is not None and v != 1)


def asks_graph_safe(ddp_config: Any) -> bool:
    """Whether the DDP config asks for Megatron-FSDP's CUDA-graph mode (0.19's field; 0.16 has none): the
    engine's graph-safe mode (``fully_shard(graph_safe=True)``; docs/design.md, "graph-safe")."""
    return bool(getattr(ddp_config, "megatron_fsdp_cuda_graph_mode", False))


# Any CUDA graph (Megatron-LM's full iteration, or its per-layer graphs: local, transformer_engine) replays
# the wrapper's buffers at their captured addresses: only a graph-safe wrapper keeps them there, which is what
# megatron_fsdp_cuda_graph_mode asks for (Megatron-LM 0.19 sets it for every --cuda-graph-impl but none).
UNCAPTURABLE_GRAPH = When(
    "not 'none' without megatron_fsdp_cuda_graph_mode",
    lambda v: v not in (None, "none"),
    given=lambda sources: not asks_graph_safe(sources.get(DDP)))
GRAPHS_WITHOUT_GRAPH_SAFE = When("set without megatron_fsdp_cuda_graph_mode", lambda v: bool(v),
                                given=lambda sources: not asks_graph_safe(sources.get(DDP)))
PER_LAYER_GRAPHS = ("local", "transformer_engine")
WITHOUT_NCCL_UB = When("True without nccl_ub", lambda v: bool(v),
                       given=lambda sources: not _read_name(sources, DDP, "nccl_ub"))


@dataclass(frozen=True)
class Option:
    source: str  # DDP, TC or ARG
    name: str
    flags: str  # the Megatron-LM flags that set it ("" when Megatron-LM sets it otherwise, or never)
    v1: Handling
    v2: Optional[Handling] = None  # None: as V1
    when: When = SET
    releases: str = "0.16, 0.19"

    def handling(self, face: str) -> Handling:
        return self.v2 if face == V2 and self.v2 is not None else self.v1


_CUDA_GRAPHS = refused(
    "a CUDA graph replays the wrapper's gathers and reductions at the addresses it captured, which only the "
    "graph-safe wrapper keeps (megatron_fsdp_cuda_graph_mode=True; Megatron-LM 0.19 sets it for any "
    "--cuda-graph-impl, 0.16's Megatron-FSDP has no such mode)",
    "set megatron_fsdp_cuda_graph_mode=True (Megatron-LM 0.19 does with --cuda-graph-impl) or leave CUDA "
    "graphs off")
_ALLOCATOR = ignored("an allocation strategy for Megatron-FSDP's own communication buffers (persistent double "
                     "buffers); shardwise's come from PyTorch's caching allocator (with nccl_ub from its NCCL "
                     "pool), where a freed buffer is reused by the next of its size; the numbers are the same")
_FSDP_DOES_NOT_READ = "Megatron-FSDP does not read it either (plain DDP's option)"
_EP_OVERLAP = refused(
    "Megatron's EP-overlap schedule (pipeline_parallel/combined_1f1b.py, 0.19) calls each layer's submodules "
    "itself, interleaving one micro-batch's forward with another's backward, and finds the data-parallel "
    "wrapper by class (find_megatron_fsdp: isinstance MegatronFSDP) to call its per-layer release hooks and "
    "_replace_param_with_raw_if_needed; on a shardwise chunk find_megatron_fsdp returns None (measured with "
    "megatron-core 0.19.2), so the schedule would run without them (not built)",
    "drop --overlap-moe-expert-parallel-comm and --delay-wgrad-compute")
_DELAY_WGRAD = refused(
    "Megatron-Core allows it only with overlap_moe_expert_parallel_comm (TransformerConfig asserts so), "
    "which is refused", "drop --delay-wgrad-compute")

OPTIONS: tuple[Option, ...] = (
    # ------------------------------------------------ DistributedDataParallelConfig
    Option(DDP, "use_megatron_fsdp", "--use-megatron-fsdp", implemented(
        "must be True for Megatron's optimizer and finalize_model_grads to take their Megatron-FSDP paths; "
        "False is warned about (the chunk is sharded anyway)")),
    Option(DDP, "use_custom_fsdp", "--use-custom-fsdp (0.16)", ignored("the old name of use_megatron_fsdp")),
    Option(DDP, "megatron_fsdp_version", "", implemented(
        "picks V1 (1) or V2 (2) in FullyShardedDataParallel; shardwise's field (the adapter's next API)"),
        releases="shardwise"),
    Option(DDP, "use_distributed_optimizer", "--use-distributed-optimizer", ignored(
        "read by Megatron's optimizer; the main weights and their optimizer state are sharded by "
        "data_parallel_sharding_strategy")),
    Option(DDP, "data_parallel_sharding_strategy", "--data-parallel-sharding-strategy", implemented(
        "no_shard / optim / optim_grads / optim_grads_params = ZeRO-0/1/2/3; another value is refused by name")),
    Option(DDP, "outer_dp_sharding_strategy", "--outer-dp-sharding-strategy", implemented(
        "with num_distributed_optimizer_instances > 1: no_shard = HSDP, optim = HFSDP; checked by name")),
    Option(DDP, "num_distributed_optimizer_instances", "--num-distributed-optimizer-instances", implemented(
        "> 1: an outer data-parallel axis over pg_collection.inter_dist_opt (HSDP / HFSDP)")),
    Option(DDP, "expert_data_parallel_sharding_strategy", "", implemented(
        "the expert parameters' strategy over expt_dp (default: the dense one)"), releases="shardwise"),
    Option(DDP, "megatron_fsdp_main_params_dtype", "--megatron-fsdp-main-params-dtype", implemented(
        "the main weights' dtype; None (auto) = the compute weights are the main weights, as Megatron-FSDP 0.19"),
        releases="0.19"),
    Option(DDP, "megatron_fsdp_main_grads_dtype", "--megatron-fsdp-main-grads-dtype", implemented(
        "the dtype gradients are accumulated in; None (auto, Megatron-LM's default) = the compute dtype; "
        "handed to the optimizer as .grad cast to the main weights' dtype when they differ"), releases="0.19"),
    Option(DDP, "megatron_fsdp_grad_comm_dtype", "--megatron-fsdp-grad-comm-dtype", implemented(
        "the dtype gradients are reduced in; None (auto) = the main grads' dtype"), releases="0.19"),
    Option(DDP, "preserve_fp32_weights", "", implemented(
        "0.16: fp32 main weights when True (the default), else the compute weights are the main weights"),
        releases="0.16"),
    Option(DDP, "grad_reduce_in_fp32", "--accumulate-allreduce-grads-in-fp32 (on for --bf16), --grad-reduce-in-bf16",
           implemented("0.16: fp32 main grads (accumulated and reduced) when True, else the compute dtype; "
                       "0.19's Megatron-FSDP does not read it and neither does shardwise for a 0.19 config")),
    Option(DDP, "megatron_fsdp_use_decoupled_grad", "--use-precision-aware-optimizer", implemented(
        "the main grads go to param.decoupled_grad in their own dtype (uncast), where Megatron's "
        "precision-aware optimizer reads them; .grad stays None (0.16: the flag does not reach the DDP config, "
        "and 0.16's Megatron-FSDP does not set decoupled_grad either)"), releases="0.19"),
    Option(DDP, "check_for_nan_in_grad", "on by default; --no-check-for-nan-in-loss-and-grad", implemented(
        "finish_grad_sync() raises RuntimeError naming the parameters when a reduced gradient holds NaN/Inf "
        "(every rank of the chunk raises)")),
    Option(DDP, "check_for_large_grads", "--check-for-large-grads", ignored(_FSDP_DOES_NOT_READ)),
    Option(DDP, "overlap_grad_reduce", "--overlap-grad-reduce", implemented(
        "always on: each unit's gradients are reduced during backward (Megatron-FSDP forces it for ZeRO-2/3)")),
    Option(DDP, "overlap_param_gather", "--overlap-param-gather", implemented(
        "V1: prefetch the next unit's all-gather; V2 always prefetches")),
    Option(DDP, "align_param_gather", "", ignored(_FSDP_DOES_NOT_READ + "; shardwise orders its own gathers")),
    Option(DDP, "fsdp_all_gather_in_start_param_sync", "off with --cuda-graph-impl full_iteration", implemented(
        "V1, True: start_param_sync rebuilds the compute weights now (ZeRO-1/2: the all-gather of the updated "
        "shards); False: it only marks them changed and the next forward rebuilds them (inside Megatron-LM's "
        "full-iteration graph, on every replay)"),
        v2=ignored("V2 rebuilds the compute weights in forward's pre-hooks; its start_param_sync does nothing"),
        when=FALSE, releases="0.19"),
    Option(DDP, "bucket_size", "--ddp-bucket-size (Megatron-LM fills in a default)", implemented(
        "V1: caps the groups of parameters no unit owns (embeddings, head)"),
        v2=ignored("V2 forms one group per unit and one for the rest"), when=NOT_NONE),
    Option(DDP, "num_buckets", "--ddp-num-buckets", ignored(_FSDP_DOES_NOT_READ + "; groups are per unit"),
           when=NOT_NONE, releases="0.19"),
    Option(DDP, "suggested_communication_unit_size", "--suggested-communication-unit-size", ignored(
        "a communication-size hint; shardwise communicates per unit"), when=NOT_NONE),
    Option(DDP, "pad_buckets_for_high_nccl_busbw", "--ddp-pad-buckets-for-high-nccl-busbw",
           ignored(_FSDP_DOES_NOT_READ)),
    Option(DDP, "average_in_collective", "--ddp-average-in-collective", ignored(
        "the mean over data-parallel ranks is the same whether divided before or inside the collective")),
    Option(DDP, "gradient_reduce_div_fusion", "", ignored(
        "how the mean is fused into the reduction; the mean is the same"), when=FALSE),
    Option(DDP, "reduce_scatter_with_fp32_accumulation", "--ddp-reduce-scatter-with-fp32-accumulation", ignored(
        _FSDP_DOES_NOT_READ + "; the reduction dtype is megatron_fsdp_grad_comm_dtype")),
    Option(DDP, "param_name_patterns_for_fp32_local_accumulation",
           "--ddp-param-name-patterns-for-fp32-local-accumulation", ignored(
               _FSDP_DOES_NOT_READ + "; gradients accumulate in megatron_fsdp_main_grads_dtype"), releases="0.19"),
    Option(DDP, "delay_wgrad_compute", "--delay-wgrad-compute", _DELAY_WGRAD),
    Option(DDP, "fp8_param_gather", "--fp8-param-gather", refused(
        "fp8 parameter gathers (Transformer Engine fp8 parameters) are not built", "drop --fp8-param-gather")),
    Option(DDP, "fp4_param_gather", "--fp4-param-gather", refused(
        "fp4 parameter gathers are not built", "drop --fp4-param-gather"), releases="0.19"),
    Option(DDP, "reuse_grad_buf_for_mxfp8_param_ag", "--reuse-grad-buf-for-mxfp8-param-ag", refused(
        "MXFP8 parameter gathers are not built", "drop --reuse-grad-buf-for-mxfp8-param-ag")),
    Option(DDP, "keep_fp8_transpose_cache", "--keep-fp8-transpose-cache", ignored(
        "only matters for fp8 parameters, which are refused")),
    Option(DDP, "megatron_fsdp_cuda_graph_mode", "set by --cuda-graph-impl other than none", implemented(
        "the chunk is wrapped with fully_shard(graph_safe=True): gathered weights, gradient buffers and staging "
        "buffers keep their addresses, no host syncs in forward, backward and finish_grad_sync; "
        "zero_grad_buffer zeroes the gradients in place (.grad stays installed for the optimizer after a "
        "replay); the optimizer step only marks the compute weights changed, the next forward rebuilds "
        "them in place; gradient accumulation works as in eager mode (no_sync, or every micro-batch syncing "
        "and adding to the installed .grad); what cannot be captured is refused by name (the graph-mode table "
        "below). With --cuda-graph-impl local / transformer_engine (per-layer graphs, which Megatron-LM captures "
        "around each layer) the same graph-safe wrapper, as Megatron-FSDP 0.19 runs for any graph impl"),
        releases="0.19"),
    Option(DDP, "megatron_fsdp_enable_fine_grained_param_gather", "--megatron-fsdp-enable-fine-grained-param-gather",
           implemented("per-submodule gathers: the units are the submodules of each fsdp_unit_modules module that "
                       "hold parameters directly, each gathered before its own forward, freed after it and "
                       "reduced after its own backward (megatron/fine_grained.py); the numbers are the same"),
           releases="0.19"),
    Option(DDP, "nccl_ub", "--use-nccl-ub", implemented(
        "on NCCL every device buffer of the chunk (weights, gathered weights, gradients, staging) comes from one "
        "torch.cuda.MemPool over ProcessGroupNCCL.mem_allocator (ncclMemAlloc), registered with the NCCL "
        "communicators of the chunk's data-parallel groups by register_mem_pool (engine/nccl_buffers.py): at "
        "wrap time, or with fsdp_manual_registration when Megatron-LM calls param_and_grad_buffer."
        "manual_buffer_registration(); on gloo it has no effect, said by one INFO line at wrap time")),
    Option(DDP, "fsdp_manual_registration", "--fsdp-manual-registration (set by --use-nccl-ub in 0.19)", refused(
        "with nccl_ub it defers registering the pool to param_and_grad_buffer.manual_buffer_registration(), which "
        "Megatron-LM calls after the first iteration; without nccl_ub there is no pool (Megatron-LM asserts the same)",
        "add --use-nccl-ub, or drop --fsdp-manual-registration"), when=WITHOUT_NCCL_UB),
    Option(DDP, "disable_symmetric_registration", "--disable-symmetric-registration", implemented(
        "with nccl_ub: plain NCCL user-buffer registration instead of symmetric (window) registration")),
    Option(DDP, "fsdp_double_buffer", "--fsdp-double-buffer (set by --use-nccl-ub in 0.19)", _ALLOCATOR),
    Option(DDP, "megatron_fsdp_max_pool_double_buffer", "--megatron-fsdp-max-pool-double-buffer", _ALLOCATOR,
           releases="0.19"),
    Option(DDP, "fsdp_db_use_persist_buf_on_alloc_fail", "--fsdp-db-use-persist-buf-on-alloc-fail", _ALLOCATOR,
           releases="0.19"),
    Option(DDP, "fsdp_trace_pool", "", _ALLOCATOR, releases="shardwise"),
    # ------------------------------------------------ TransformerConfig
    Option(TC, "bf16", "--bf16", implemented("the compute weights are bf16")),
    Option(TC, "fp16", "--fp16", implemented("the compute weights are fp16")),
    Option(TC, "tensor_model_parallel_size", "--tensor-model-parallel-size", implemented(
        "a dp x tp mesh; must match pg_collection.tp")),
    Option(TC, "sequence_parallel", "--sequence-parallel", implemented(
        "the sequence-parallel layers' partial gradients are summed over TP")),
    Option(TC, "expert_model_parallel_size", "--expert-model-parallel-size", implemented(
        "experts over an (expert_dp, ep) mesh; must match pg_collection.ep")),
    Option(TC, "expert_tensor_parallel_size", "--expert-tensor-parallel-size", implemented(
        "Megatron-Core's expert layers: any size, over an (expert_dp, ep, tp) mesh with tp over expt_tp "
        "(Megatron-FSDP's [expt_dp, expt_tp]); shardwise's stacked experts: 1 with EP, else refused by name")),
    Option(TC, "num_moe_experts", "--num-experts", implemented("experts are the parameters under '.experts.'")),
    Option(TC, "pipeline_model_parallel_size", "--pipeline-model-parallel-size", implemented(
        "one wrapper per stage's chunk, sharded over that stage's dp_cp; must match pg_collection.pp"),
        v2=refused("composing V2 with pipeline parallelism is not built yet", "use megatron_fsdp_version=1"),
        when=NOT_ONE),
    Option(TC, "virtual_pipeline_model_parallel_size", "--num-layers-per-virtual-pipeline-stage", implemented(
        "one wrapper per virtual chunk"), when=NOT_NONE),
    Option(TC, "context_parallel_size", "--context-parallel-size", implemented(
        "the data-parallel mesh is dp_cp, as Megatron-FSDP's; the model must declare its split over "
        "pg_collection.cp (megatron/context_parallel.py)"), when=NOT_ONE),
    Option(TC, "calculate_per_token_loss", "--calculate-per-token-loss", implemented(
        "gradients are summed over data-parallel ranks; finalize_model_grads scales them by 1 / tokens"),
        v2=refused("per-token loss normalization is not built in V2", "use megatron_fsdp_version=1")),
    Option(TC, "init_model_with_meta_device", "--init-model-with-meta-device", implemented(
        "meta parameters are materialized and initialized unit by unit")),
    Option(TC, "use_cpu_initialization", "--use-cpu-initialization", ignored(
        "read by Megatron's layers when they are built; the wrapper takes the model as built")),
    Option(TC, "perform_initialization", "", ignored("read by Megatron's layers when they are built"),
           when=FALSE),
    Option(TC, "gated_linear_unit", "--swiglu", ignored("the layout of the fc1 weight; sharded like any other "
                                                       "(Megatron-LM's fsdp_dtensor checkpoints split it into _w/_v "
                                                       "halves from the parameters' megatron_fsdp_slice and "
                                                       "megatron_fsdp_dist_index: megatron/dist_index.py)")),
    Option(TC, "gradient_accumulation_fusion", "on by default; --no-gradient-accumulation-fusion", implemented(
        "the compute weights get __fsdp_param__ and get_main_grad() (their .grad): Megatron's linear layers "
        "write the fused weight gradient there and the engine reduces it")),
    Option(TC, "defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute", refused(
        "finalize_model_grads then writes the output layer's gradient into the sharded weight's main_grad, "
        "which shardwise does not keep", "drop --defer-embedding-wgrad-compute")),
    Option(TC, "delay_wgrad_compute", "--delay-wgrad-compute", _DELAY_WGRAD),
    Option(TC, "overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm", _EP_OVERLAP),
    Option(TC, "fp8", "--fp8-format", refused(
        "Transformer Engine fp8 layers have not run under shardwise (not built or tested yet)",
        "drop --fp8-format (shardwise's own fp8: shardwise.engine.fp8 with torchao)"), when=NOT_NONE),
    Option(TC, "fp8_param", "--fp8-param-gather", refused(
        "fp8 parameters are not built", "drop --fp8-param-gather")),
    Option(TC, "fp4", "--fp4-format", refused("fp4 compute is not built", "drop --fp4-format"), when=NOT_NONE),
    Option(TC, "fp4_param", "--fp4-param-gather", refused("fp4 parameters are not built", "drop --fp4-param-gather")),
    Option(TC, "enable_cuda_graph", "--enable-cuda-graph", _CUDA_GRAPHS, when=GRAPHS_WITHOUT_GRAPH_SAFE),
    Option(TC, "external_cuda_graph", "--external-cuda-graph", _CUDA_GRAPHS, when=GRAPHS_WITHOUT_GRAPH_SAFE),
    Option(TC, "cuda_graph_impl", "--cuda-graph-impl", _CUDA_GRAPHS, when=UNCAPTURABLE_GRAPH),
    # ------------------------------------------------ the constructor's arguments
    Option(ARG, "fsdp_unit_modules", "", implemented(
        "the module classes sharded as units (default: transformer, MoE and Mamba layers present)"),
        when=NOT_NONE),
    Option(ARG, "disable_bucketing", "True for virtual chunks after the first", implemented(
        "V1: one group per dtype for the parameters no unit owns"),
        v2=refused("V2 forms its own parameter groups", "leave disable_bucketing=False")),
    Option(ARG, "device", "", implemented("its type picks the mesh's device (default: CUDA with NCCL, else CPU)"),
           when=NOT_NONE),
    Option(ARG, "pg_collection", "", implemented(
        "the process groups (dp_cp, tp, ep, expt_dp, pp, ...); None: V1 builds them from the configs"),
        v2=refused("V2 needs an explicit pg_collection; its dp_cp group defines the data-parallel mesh",
                   "pass pg_collection=ProcessGroupCollection.use_mpu_process_groups()"),
        when=When("None", lambda v: v is None)),
)

_GRAPH_TODO = "leave CUDA graphs off for this run (--cuda-graph-impl none)"

# What a captured full iteration cannot hold, refused at wrap time when megatron_fsdp_cuda_graph_mode=True.
GRAPH_SAFE_REFUSALS: tuple[Option, ...] = (
    Option(DDP, "check_for_nan_in_grad", "on by default; --no-check-for-nan-in-loss-and-grad", refused(
        "the NaN check reads its verdict on the host inside finish_grad_sync, which a captured iteration cannot "
        "hold (per-layer graphs leave finish_grad_sync eager: allowed there)",
        "pass --no-check-for-nan-in-loss-and-grad (Megatron-LM requires it with full_iteration)"),
        when=When("True, unless the graphs are per-layer (cuda_graph_impl local / transformer_engine)", lambda v: bool(v),
                  given=lambda sources: _read_name(sources, TC, "cuda_graph_impl") not in PER_LAYER_GRAPHS),
        releases="0.19"),
    Option(TC, "num_moe_experts", "--num-experts", refused(
        "dynamic MoE routing gives each expert a data-dependent number of tokens (sizes read on the host)",
        _GRAPH_TODO), when=NOT_NONE, releases="0.19"),
    Option(TC, "expert_model_parallel_size", "--expert-model-parallel-size", refused(
        "expert parallelism's all-to-alls take sizes read on the host", _GRAPH_TODO), when=NOT_ONE,
        releases="0.19"),
    Option(TC, "pipeline_model_parallel_size", "--pipeline-model-parallel-size", refused(
        "pipeline schedules are not captured by the engine (its pipeline stages refuse graph_safe models)",
        _GRAPH_TODO), when=NOT_ONE, releases="0.19"),
    Option(TC, "virtual_pipeline_model_parallel_size", "--num-layers-per-virtual-pipeline-stage", refused(
        "virtual pipeline stages are pipeline schedules, which are not captured", _GRAPH_TODO), when=NOT_NONE,
        releases="0.19"),
    Option(TC, "cpu_offloading", "--cpu-offloading", refused(
        "offloading activations or weights to the host copies and waits on the host inside the step",
        _GRAPH_TODO), releases="0.19"),
    Option(TC, "fine_grained_activation_offloading", "--fine-grained-activation-offloading", refused(
        "offloading activations to the host copies and waits on the host inside the step", _GRAPH_TODO),
        releases="0.19"),
)

_BY_NAME = {(o.source, o.name): o for o in OPTIONS}


def option(source: str, name: str) -> Option:
    return _BY_NAME[(source, name)]


def _read_name(sources: Mapping[str, Any], kind: str, name: str) -> Any:
    source = sources.get(kind)
    if kind == ARG:
        return source.get(name) if source is not None else None
    return getattr(source, name, None) if source is not None else None


def _read(row: Option, sources: Mapping[str, Any]) -> Any:
    return _read_name(sources, row.source, row.name)


def refusal_message(face: str, row: Option, value: Any, context: str = "") -> str:
    handling = row.handling(face)
    return f"{face} does not support {row.name}={value!r}{context}: {handling.text}; {handling.todo}"


def check_options(face: str, config: Any, ddp_config: Any, arguments: Mapping[str, Any]) -> None:
    """Refuse, by field and value, every REFUSED option set in the configs or arguments; log the IGNORED ones.

    ``config`` / ``ddp_config`` are read as given (Megatron-Core's objects, whose
    unset Megatron-LM flags may be ``None``, or shardwise's mirrors).
    """
    sources = {DDP: ddp_config, TC: config, ARG: arguments}
    for row in OPTIONS:
        handling = row.handling(face)
        if handling.verdict is Verdict.IMPLEMENTED:
            continue
        value = _read(row, sources)
        if not row.when.applies(value, sources):
            continue
        if handling.verdict is Verdict.REFUSED:
            raise UnsupportedMegatronOption(refusal_message(face, row, value))
        logger.info("%s: %s=%r is accepted and ignored: %s", face, row.name, value, handling.text)
    if asks_graph_safe(ddp_config):
        for row in GRAPH_SAFE_REFUSALS:
            value = _read(row, sources)
            if row.when.applies(value, sources):
                raise UnsupportedMegatronOption(
                    refusal_message(face, row, value, " with megatron_fsdp_cuda_graph_mode=True"))


# ------------------------------------------------------------------ the doc page
_HEADER = """# Megatron-FSDP options in shardwise

Generated from `shardwise/megatron/options.py` (`python -m shardwise.megatron.options`); a test holds
this page to the table. Every field of Megatron-Core's `DistributedDataParallelConfig` that
Megatron-FSDP reads (0.16.1 and 0.19.2), the `TransformerConfig` fields that change what the
data-parallel wrapper must do, and the arguments of `FullyShardedDataParallel(...)`, with the
Megatron-LM flags that set them. **implemented**: what shardwise does; **refused**: raised at wrap
time (`UnsupportedMegatronOption`, a `ValueError`) naming the field and value, with what to do;
**ignored**: why it is harmless (logged at wrap time). A verdict applies to the values in *when*;
defaults always pass. V2 is as V1 unless its column says otherwise.
"""


def _cell(handling: Handling) -> str:
    text = f"**{handling.verdict.value}**: {handling.text}"
    if handling.todo:
        text += f". To do: {handling.todo}"
    return text.replace("|", "\\|")


def render_markdown() -> str:
    lines = [_HEADER]
    for source, title in ((DDP, "DistributedDataParallelConfig"), (TC, "TransformerConfig"),
                          (ARG, "FullyShardedDataParallel arguments")):
        lines += [f"## {title}", "", "| field | Megatron-LM flag | releases | when | V1 | V2 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in OPTIONS:
            if row.source != source:
                continue
            v2 = "as V1" if row.v2 is None else _cell(row.v2)
            flags = row.flags.replace("|", "\\|") or "-"
            verdicts = {row.handling(face).verdict for face in (V1, V2)}
            when = "-" if verdicts == {Verdict.IMPLEMENTED} else row.when.text
            lines.append(f"| `{row.name}` | {flags} | {row.releases} | {when} | {_cell(row.v1)} | {v2} |")
        lines.append("")
    lines += ["## With `megatron_fsdp_cuda_graph_mode=True`", "",
              "What a captured full iteration (`--cuda-graph-impl full_iteration`) cannot hold: refused at wrap "
              "time, on top of the rows above, when the DDP config asks for graph mode.", "",
              "| field | source | Megatron-LM flag | when | V1 and V2 |", "| --- | --- | --- | --- | --- |"]
    for row in GRAPH_SAFE_REFUSALS:
        flags = row.flags.replace("|", "\\|") or "-"
        lines.append(f"| `{row.name}` | {row.source} | {flags} | {row.when.text} | {_cell(row.v1)} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # rewrite the doc page
    from pathlib import Path

    Path(__file__).resolve().parents[2].joinpath("docs", "megatron-options.md").write_text(render_markdown())
