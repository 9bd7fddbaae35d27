"""Megatron's data-parallel wrapper contract, and what V1 and V2 share on top of the engine.

Megatron-LM's training loop talks to a data-parallel wrapper through a few
names: ``.module`` is what it wraps (for Megatron-FSDP a ``MegatronFSDP`` level whose
``.module`` is the model) and ``forward`` runs it; ``no_sync()`` wraps
every micro-batch but the last; ``zero_grad_buffer()`` starts a step;
``finish_grad_sync()`` and ``scale_gradients()`` end one (from
``finalize_model_grads``); ``start_param_sync()`` / ``start_grad_sync()`` are the
overlap hooks; ``state_dict`` / ``load_state_dict`` act on ``.module``.
:class:`_BaseDataParallel` is that contract; :class:`_ShardedDataParallel` fills
it in with :func:`shardwise.fully_shard`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..engine.model_ops import StepController, load_full_state_dict, sharded_state, zero_grads_in_place
from ..engine.fully_shard import fully_shard
from ..engine.materialize import MetaInitializer, has_meta_tensors
from ..engine.mesh import DENSE, EXPERT, LOCAL_EXPERT, default_device_type
from ..engine.placements import OUTER_STRATEGY_PLACEMENTS, AxisPlacements, hybrid_problem, strategy_placements
from ..engine.precision import MixedPrecisionPolicy
from ..engine.registry import LAYER, module_types
from .config import DistributedDataParallelConfig, TransformerConfig
from .dist_index import attach_checkpoint_attributes, tensor_parallel_attributes
from .meshes import _DATA_PARALLEL_PLACEMENTS, EP_AXIS, INNER_AXIS, OUTER_AXIS, TP_AXIS
from .buffer_view import ParamAndGradBufferView
from .fine_grained import fine_grained_units
from .nccl_ub import user_buffers
from .grads import grads_of
from .main_dtypes import mixed_precision_for
from .process_groups import group_size

__all__ = ["MegatronFSDPLevel", "_BaseDataParallel", "_ShardedDataParallel", "expert_plan_fn", "is_expert_param",
           "local_expert_fqns", "logger", "plan_fn_for"]

# Megatron-Core marks the parameters Megatron-FSDP manages with this attribute; its optimizer
# (grad-norm, zero counting) then reads their gradients' local shards and reduces the norm over
# the distributed optimizer's group itself instead of over each DTensor's mesh.
FSDP_PARAM_ATTR = "__fsdp_param__"

# Named after the module Megatron users know; V1, V2 and the factory all log here.
logger = logging.getLogger("shardwise.megatron.mcore_fsdp_adapter")


# ------------------------------------------------ from Megatron's configs to the engine
def _megatron_layer_types() -> list:
    """Megatron-Core's layer classes when it is installed (never required)."""
    try:
        if importlib.util.find_spec("megatron") is None:
            return []
    except (ImportError, ValueError):
        return []
    found = []
    for module_name, names in (
        ("megatron.core.transformer.transformer_layer", ("TransformerLayer", "MoETransformerLayer")),
        ("megatron.core.ssm.mamba_layer", ("MambaLayer",)),
    ):
        try:
            mod = importlib.import_module(module_name)
        except Exception:  # an installed but broken Megatron must not break shardwise
            continue
        found += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return found


def _default_unit_types() -> list:
    """Transformer, MoE transformer and Mamba layers: those registered as layers (shardwise's models
    register theirs), and Megatron-Core's when it is installed."""
    return list(module_types(LAYER)) + _megatron_layer_types()


def _present(module: nn.Module, types: list) -> list:
    """The classes in ``types`` that some submodule (not the root) is an instance of."""
    subs = [m for m in module.modules() if m is not module]
    return [t for t in types if any(isinstance(m, t) for m in subs)]


def _mixed_precision(cfg: TransformerConfig, ddp: DistributedDataParallelConfig, raw_ddp: Any,
                     module: nn.Module) -> MixedPrecisionPolicy:
    """The engine's dtypes from Megatron's configs, as the release of ``raw_ddp`` means them
    (:mod:`shardwise.megatron.main_dtypes`)."""
    return mixed_precision_for(cfg, ddp, raw_ddp, module)


def check_module(module: Any, who: str) -> None:
    """``module`` must be a ``torch.nn.Module`` (refused by name before anything reads it)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who}: module={module!r} must be a torch.nn.Module (the model chunk to shard)")


def warn_if_not_megatron_fsdp(ddp: DistributedDataParallelConfig, who: str) -> None:
    """``use_megatron_fsdp=False`` asks Megatron for plain DDP, yet this wrapper shards the model:
    say so (once per process). Megatron's optimizer and ``finalize_model_grads`` take their
    Megatron-FSDP paths only when it is True."""
    if not ddp.use_megatron_fsdp:
        warnings.warn(
            f"{who}: ddp_config.use_megatron_fsdp=False (plain DDP in Megatron), but this wrapper shards "
            "the model with shardwise; set use_megatron_fsdp=True so Megatron's optimizer and "
            "finalize_model_grads treat it as Megatron-FSDP",
            UserWarning,
            stacklevel=3,
        )


def _check_strategies(ddp: DistributedDataParallelConfig, who: str) -> None:
    strategy, outer = ddp.data_parallel_sharding_strategy, ddp.outer_dp_sharding_strategy
    if strategy not in _DATA_PARALLEL_PLACEMENTS:
        raise ValueError(
            f"{who}: data_parallel_sharding_strategy={strategy!r} is not one of {list(_DATA_PARALLEL_PLACEMENTS)}"
        )
    problem = hybrid_problem(strategy, outer, "data_parallel_sharding_strategy")
    if outer not in OUTER_STRATEGY_PLACEMENTS:
        raise ValueError(f"{who}: outer_dp_sharding_strategy={outer!r} {problem}")
    instances = ddp.num_distributed_optimizer_instances
    if not isinstance(instances, int) or instances < 1:
        raise ValueError(f"{who}: num_distributed_optimizer_instances={instances!r} must be a positive integer")
    if outer != "no_shard" and instances <= 1:
        raise ValueError(
            f"{who}: outer_dp_sharding_strategy={outer!r} needs an outer data-parallel axis, i.e. "
            f"num_distributed_optimizer_instances > 1 (got {instances})"
        )
    if problem:
        raise ValueError(f"{who}: outer_dp_sharding_strategy={outer!r} {problem}")


def _placements(ddp: DistributedDataParallelConfig, hybrid: bool) -> dict[str, AxisPlacements]:
    """The engine's strategy table read with Megatron's names (the outer axis first, as on the mesh)."""
    return strategy_placements(ddp.data_parallel_sharding_strategy,
                               ddp.outer_dp_sharding_strategy if hybrid else None,
                               inner_axis=INNER_AXIS, outer_axis=OUTER_AXIS)


def _device_type(device: Optional[torch.device]) -> str:
    return torch.device(device).type if device is not None else default_device_type()


def is_expert_param(fqn: str, param: Optional[torch.Tensor] = None) -> bool:
    """Whether a parameter is an expert weight, by Megatron-Core's layout: a MoE layer keeps its
    experts in an ``experts`` submodule (``...mlp.experts.*``), as Megatron-FSDP assumes too."""
    return ".experts." in f".{fqn}"


def expert_plan_fn(fqn: str, param: torch.Tensor) -> str:
    """The ``plan_fn`` the face hands ``fully_shard``: expert weights on the expert mesh, the rest dense."""
    return EXPERT if is_expert_param(fqn, param) else DENSE


def local_expert_fqns(module: nn.Module) -> frozenset[str]:
    """The parameters of Megatron-Core's expert modules (``...mlp.experts``: ``SequentialMLP``'s
    ``local_experts.<i>.*``, ``TEGroupedMLP``'s ``weight<i>``), named as in ``module``.

    There each expert is a tensor of its own, and ``local_experts.<i>`` is a different expert on
    each expert-parallel rank (Megatron-LM's ``handle_experts_in_state_dict`` renames it to
    ``i + ep_rank x local experts`` when it saves), so it is handed out as Megatron-FSDP hands it
    out: one tensor sharded over the expert-data-parallel ranks only (:data:`LOCAL_EXPERT`).
    Other expert modules (shardwise's MoE) stack every EP rank's experts along dim 0.
    """
    found = set()
    for name, sub in module.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and type(sub).__module__.startswith("megatron.core."):
            found.update(f"{name}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False))
    return frozenset(found)


def plan_fn_for(module: nn.Module):
    """The ``plan_fn`` the face hands ``fully_shard`` for ``module``: :func:`expert_plan_fn`, with
    Megatron-Core's experts (:func:`local_expert_fqns`) each EP rank's own tensors."""
    local = local_expert_fqns(module)

    def plan_fn(fqn: str, param: torch.Tensor) -> str:
        choice = expert_plan_fn(fqn, param)
        return LOCAL_EXPERT if choice == EXPERT and fqn in local else choice

    return plan_fn


def _has_expert_params(module: nn.Module) -> bool:
    """Whether some parameter is an expert weight (what the face puts on the expert mesh)."""
    return any(is_expert_param(name, p) for name, p in module.named_parameters())


@dataclass(frozen=True)
class _ModelParallelSizes:
    tp: int
    ep: int
    expert_tp: int


def _model_parallel_sizes(cfg: TransformerConfig, pg) -> _ModelParallelSizes:
    """TP, EP and expert-TP sizes, the config's and ``pg_collection``'s agreeing (else ``ValueError``).

    ``pg=None`` means the groups will be built from the config. An unset
    ``expert_tensor_parallel_size`` follows the TP size (Megatron's default), or
    the size of ``pg_collection.expt_tp`` when that group is given. Expert TP
    only matters for models with expert parameters (see
    :func:`_unbuilt_model_parallelism`).
    """
    sizes = {}
    for field, name, configured in (
        ("tensor_model_parallel_size", "tp", cfg.tensor_model_parallel_size),
        ("expert_model_parallel_size", "ep", cfg.expert_model_parallel_size),
        ("expert_tensor_parallel_size", "expt_tp", cfg.expert_tensor_parallel_size),
    ):
        group = getattr(pg, name, None) if pg is not None else None
        if configured is None:  # expert TP follows TP unless its group says otherwise
            sizes[name] = group_size(group) if group is not None else sizes["tp"]
            continue
        # The adapter meshes tp and ep, so they must be there; expt_tp only has to agree when given.
        if pg is not None and (group is not None or name != "expt_tp") and group_size(group) != configured:
            found = "missing" if group is None else f"{group_size(group)} ranks"
            raise ValueError(
                f"{field}={configured} needs pg_collection.{name} with {configured} ranks, got {found}"
            )
        sizes[name] = configured
    return _ModelParallelSizes(sizes["tp"], sizes["ep"], sizes["expt_tp"])


def _unbuilt_model_parallelism(sizes: _ModelParallelSizes, module: nn.Module) -> Optional[tuple[str, int, str]]:
    """``(field, value, why)`` for a tensor/expert-parallel combination the engine cannot shard yet.

    Built: TP alone; EP alone; Megatron-Core's expert layers (:func:`local_expert_fqns`) at any expert
    TP size, with or without EP (their expert mesh has a ``tp`` axis over ``expt_tp``, as
    Megatron-FSDP's ``[expt_dp, expt_tp]``); other experts (shardwise's MoE, whose experts are
    stacked and not split by TP) whole on each EP rank (``expert_tensor_parallel_size=1``) next to
    TP, or, with one EP rank, next to TP of the same expert-TP size.
    """
    experts = [n for n, p in module.named_parameters() if is_expert_param(n, p)]
    if not experts or set(experts) <= local_expert_fqns(module):
        return None
    if sizes.ep > 1 and sizes.expert_tp > 1:
        hint = (f"; next to tensor_model_parallel_size={sizes.tp}, set expert_tensor_parallel_size=1 (whole "
                "experts on each expert-parallel rank)" if sizes.tp > 1 else "; set expert_tensor_parallel_size=1")
        return ("expert_tensor_parallel_size", sizes.expert_tp,
                f"expert tensor parallelism (TP inside the expert mesh) of {experts[0]!r} (not a Megatron-Core "
                "expert layer's: its experts are stacked, not split by TP) is not built yet" + hint)
    if sizes.tp > 1 and sizes.ep == 1 and sizes.expert_tp != sizes.tp:
        return ("expert_tensor_parallel_size", sizes.expert_tp,
                f"experts other than Megatron-Core's next to tensor_model_parallel_size={sizes.tp} are only built with "
                f"the same expert tensor-parallel size (experts split like the dense layers, over the same TP group); "
                f"set expert_tensor_parallel_size={sizes.tp}")
    return None


# ----------------------------------------------------------------- the wrappers
class _BaseDataParallel(nn.Module):
    """The wrapper contract of Megatron-Core's data-parallel classes (no-op sync hooks)."""

    def __init__(self, config: Any, module: nn.Module):
        super().__init__()
        self.config = config
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def start_param_sync(self, *unused, **unused_kwargs) -> None:
        pass

    def start_grad_sync(self, *unused, **unused_kwargs) -> None:
        pass

    def finish_grad_sync(self, *unused, **unused_kwargs) -> None:
        pass

    def scale_gradients(self, scaling_factor: float) -> None:
        pass

    def zero_grad_buffer(self) -> None:
        pass

    def broadcast_params(self) -> None:
        pass

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


class MegatronFSDPLevel(nn.Module):
    """The module level Megatron-FSDP's ``MegatronFSDP`` takes between its adapter and the model.

    Megatron's adapter is ``adapter.module`` = ``MegatronFSDP``, whose ``.module`` is
    the model, and Megatron-LM is written against that nesting: ``unwrap_model``
    stops here (this is none of the classes it unwraps), so ``checkpointing.py``'s
    ``fsdp_dtensor`` state is ``{"model": this level's state_dict_for_save_checkpoint()}``
    (keys ``module.<model key>``), and the optimizer names parameters by the chunk's
    ``named_parameters()`` (``module.module.<model fqn>``). With the same level here
    every key is Megatron's adapter's: a checkpoint either wrapper writes, the other loads.
    """

    def __init__(self, module: nn.Module, config: Any = None):
        super().__init__()
        self.module = module
        self.config = config  # Megatron's adapter gives its MegatronFSDP the model config too

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """What Megatron-LM saves of an unwrapped chunk: this level's state dict (``module.<model key>``).

        Under ``--swiglu`` Megatron-LM's ``handle_swiglu_in_state_dict`` then cuts each
        ``linear_fc1`` into ``_w`` / ``_v`` halves from the parameters' Megatron-FSDP
        attributes (:mod:`shardwise.megatron.dist_index`).
        """
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


class _ShardedDataParallel(_BaseDataParallel):
    """V1 and V2's common ground: shard with the engine, clear/scale grads, load full state dicts.

    Nesting as Megatron's adapter: ``.module`` is a :class:`MegatronFSDPLevel` whose
    ``.module`` is the model; :attr:`sharded_model` is that model (what
    ``fully_shard`` wrapped, what the engine calls take).
    """

    def __init__(self, config: Any, module: nn.Module):
        super().__init__(config, MegatronFSDPLevel(module, config))

    @property
    def sharded_model(self) -> nn.Module:
        """The model ``fully_shard`` wrapped (``self.module.module``)."""
        return self.module.module

    # ----------------------------------------------------------------- wrapping
    def _shard(
        self,
        *,
        mesh: DeviceMesh,
        placements: dict[str, AxisPlacements],
        unit_types: Sequence[type],
        policy: MixedPrecisionPolicy,
        init_on_meta: bool,
        prefetch: bool,
        expert_mesh: Optional[DeviceMesh] = None,
        expert_placements: Optional[dict[str, AxisPlacements]] = None,
        gradient_reduction: str = "mean",
        bucket_size: Optional[int] = None,
        graph_safe: bool = False,
    ) -> None:
        """Shard the model (:attr:`sharded_model`) with the engine: dense parameters over ``mesh`` (its ``tp`` axis, if
        any, is tensor-parallel), expert parameters (:func:`is_expert_param`) over ``expert_mesh``
        (its ``ep`` axis). ``graph_safe`` (``megatron_fsdp_cuda_graph_mode``): ``fully_shard(graph_safe=True)``, see
        :meth:`zero_grad_buffer` and :class:`ParamAndGradBufferView` for what changes around it."""
        self.graph_safe = graph_safe
        module = self.sharded_model
        initializer = None
        if has_meta_tensors(module):
            if not init_on_meta:
                meta = [n for n, p in module.named_parameters() if p.is_meta][:4]
                raise ValueError(
                    f"the model holds meta-device tensors (e.g. {meta}); set "
                    "TransformerConfig.init_model_with_meta_device=True to initialize them unit by unit"
                )
            device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
            initializer = MetaInitializer(module, device)
            initializer.plan()
        tp_attributes = tensor_parallel_attributes(module)
        ddp_config = getattr(self, "ddp_config", None)
        buffers = user_buffers(ddp_config, (mesh, expert_mesh), type(self).__name__)  # nccl_ub: NCCL's pool
        units = list(unit_types)
        if getattr(ddp_config, "megatron_fsdp_enable_fine_grained_param_gather", False):
            units = fine_grained_units(module, units)  # each unit's submodules, gathered one by one
        fully_shard(
            module,
            mesh,
            placements=placements,
            unit_modules=units or None,
            mixed_precision=policy,
            init_fn=initializer,
            prefetch=prefetch,
            tp_axis=TP_AXIS,
            expert_mesh=expert_mesh,
            expert_placements=expert_placements,
            ep_axis=EP_AXIS,
            gradient_reduction=gradient_reduction,
            bucket_size=bucket_size,
            plan_fn=plan_fn_for(module),
            collectives=buffers,
            graph_safe=graph_safe,
            check_module_states=False,  # data-parallel ranks may differ until broadcast_params (--data-parallel-random-init)
        )
        if initializer is not None:
            initializer.finish()
        for param in module.parameters():
            setattr(param, FSDP_PARAM_ATTR, True)
        attach_checkpoint_attributes(module, tp_attributes)
        self.param_and_grad_buffer = ParamAndGradBufferView(module, rebuild_now=not graph_safe, ddp_config=ddp_config,
                                                            user_buffers=buffers)

    @property
    def sharded_state(self) -> StepController:
        """The engine's state for the wrapped model (units, parameter groups, sharding plan)."""
        return sharded_state(self.sharded_model)

    # ----------------------------------------------------------- micro-batches
    def no_sync(self):
        """Accumulate this micro-batch's gradients without finalizing them.

        Wrap every micro-batch but the last; the last backward (outside) reduces
        what was accumulated on every axis and installs ``.grad``.
        """
        return self.sharded_model.no_sync()

    # ------------------------------------------------------------------- grads
    def zero_grad_buffer(self) -> None:
        """Start a new step: the next backward overwrites the gradient buffers instead of adding.

        Clears every sharded parameter's ``.grad`` and drops what earlier
        ``no_sync`` micro-batches accumulated without a final backward. In graph-safe mode the
        gradients are zeroed in place instead and ``.grad`` stays: Megatron-LM's optimizer reads it right
        after a replay, which runs no Python to install it again.
        """
        if getattr(self, "graph_safe", False):
            zero_grads_in_place(self.sharded_model)
        else:
            self.sharded_model.zero_grad_buffer()

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiply every installed gradient (the sharded main grads, ``.grad`` or ``.decoupled_grad``) by ``scaling_factor``.

        A tensor factor (``finalize_model_grads``' ``1 / num_tokens`` with per-token loss) stays on the device:
        reading it on the host would be a sync, which a captured graph cannot hold."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for _, g in grads_of(self.sharded_model)]
        grads = [g for g in grads if g.numel()]
        if not grads:
            return
        if isinstance(scaling_factor, torch.Tensor):
            torch._foreach_mul_(grads, scaling_factor.to(grads[0].device))
        else:
            torch._foreach_mul_(grads, float(scaling_factor))

    # ------------------------------------------------------------- state dict
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True):
        """Load model weights: the sharded tensors ``state_dict()`` returns, or full (unsharded) tensors.

        Keys are those of ``state_dict()`` / ``state_dict_for_save_checkpoint()``
        (``module.<model key>``, Megatron's adapter's), or the model's own. Full tensors are cut to this rank's
        shard locally (no communication); the engine refreshes the compute weights
        at the next forward.
        """
        own = set(self.sharded_model.state_dict().keys())
        if state_dict and not own & set(state_dict) and all(k.startswith("module.") for k in state_dict):
            state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
        return load_full_state_dict(self.sharded_model, state_dict, strict=strict)
