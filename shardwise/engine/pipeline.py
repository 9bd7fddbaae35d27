"""Pipeline parallelism: ``torch.distributed.pipelining`` stages whose modules ``fully_shard`` wrapped.

torch's schedules drive the stages; this module only tells a stage how a
sharded module accumulates and reduces. torch's ``PipelineStage`` knows FSDP2's
and DDP's modules by type and runs any other module's backward plainly, which
would reduce a shardwise model's gradients after every micro-batch. A
:class:`ShardedPipelineStage` runs every micro-batch's backward inside the
model's ``no_sync()`` and, at the schedule's one gradient-reduction point per
step (``perform_reduce_grad``, which every torch schedule calls after a stage's
last backward), calls :func:`shardwise.engine.model_ops.finish_grad_accumulation`: the
step's one reduction per stage. Parameters are gathered per micro-batch by the
engine's own forward and backward hooks.

Each stage's module is sharded on its sub-mesh without the ``pp`` axis:
``mesh["dp_shard"]`` of a ``(pp, dp_shard)`` mesh, ``mesh["dp_outer", "dp_shard"]``
(HSDP) of a ``(pp, dp_outer, dp_shard)`` one, ``mesh["dp_shard", "tp"]`` of a
``(pp, dp_shard, tp)`` one (a tensor-parallel stage, TP inside its DTensors). Its
parameters keep the whole model's names, so the state dicts of all stages
together are the whole model's, and ``shardwise.checkpoint`` saves and loads a
rank's stage modules (with one optimizer per stage) as the whole model's
checkpoint, loadable at any other layout. Clipping spans the stages with
``clip_grad_norm_(..., extra_groups=[pp_group])`` (and TP through the DTensors).

Zero-bubble schedules (``zbv``: ``ScheduleZBVZeroBubble``, ``interleaved_zb``:
``ScheduleInterleavedZeroBubble``) split a backward in two: an input pass,
``autograd.grad`` from the stage's outputs to its inputs only, then a weight
pass, ``autograd.grad`` from the intermediate nodes the first pass saved to the
weights' gradient accumulators, writing ``weight.grad``. torch's stage hands
both passes ``submod.parameters()``: here the sharded DTensors at rest, which
are not in the graph (the forward used the gathered compute parameters the
hooks swapped in), so the weight pass would find no weights. A shardwise
stage gives both passes the gathered parameters instead
(:func:`shardwise.engine.model_ops.compute_parameters`, the same objects every step).
The engine reduces a unit when the backward of its inputs fires, which is in
the input pass, before any weight gradient exists; inside
:func:`shardwise.engine.model_ops.split_backward_input` no unit reduces (each still
frees its weights: the weight pass needs saved activations only, as linears,
embeddings and norms do; a weight gradient that reads the weight itself, such
as weight normalization's, is not supported under these schedules), and after
the weight pass :func:`shardwise.engine.model_ops.reduce_weight_grads` reduces what it
wrote into the open window, as a whole backward's end would have. The first
stage has no input gradient: torch runs its whole backward in the weight step.
``ScheduleDualPipeV`` (overlapped forward and backward) is not supported.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from .device import device_for
from .graph_safe import refuse_unless_eager
from .model_ops import (
    compute_parameters,
    finish_grad_accumulation,
    is_sharded,
    reduce_weight_grads,
    sharded_state,
    split_backward_input,
)

__all__ = ["ShardedPipelineStage", "SCHEDULES", "build_schedule", "pipeline_groups"]

# torch's schedules a ShardedPipelineStage runs; the zero-bubble ones split each backward into an
# input and a weight pass (the module docstring says how the engine takes them).
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "zbv": ScheduleZBVZeroBubble,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}


class ShardedPipelineStage(PipelineStage):
    """A ``PipelineStage`` for a module ``fully_shard`` wrapped: one gradient reduction per step.

    Arguments as ``PipelineStage``'s; ``group`` is the pipeline's process group (the
    ``pp`` axis of the mesh) and ``device`` defaults to where the module's mesh
    computes. Every micro-batch's backward accumulates (``no_sync``; a split backward's
    input pass reduces nothing, its weight pass what it computed); the schedule's
    reduce-grad point reduces, installs ``.grad`` and then divides it by the number
    of micro-batches when the schedule scales gradients.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | None = None, *, group: dist.ProcessGroup | None = None, **kwargs: Any):
        if not is_sharded(submodule):
            raise ValueError(f"ShardedPipelineStage: submodule={type(submodule).__name__} is not wrapped by "
                             "shardwise.fully_shard; shard each stage's module on its data-parallel mesh first")
        refuse_unless_eager(sharded_state(submodule).graph_safe, "ShardedPipelineStage",
                            "torch's pipeline schedules send and receive between stages with host-side "
                            "bookkeeping (shape inference, per-micro-batch Python) that a CUDA graph cannot capture")
        if device is None:
            device = device_for(group if group is not None else dist.group.WORLD)
        super().__init__(submodule, stage_index, num_stages, device, group=group, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        with self.submod.no_sync():  # accumulate; perform_reduce_grad reduces once for all micro-batches
            if backward_type == "input":  # no unit reduces: its weight gradients come in the weight pass
                with split_backward_input(self.submod):
                    return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                                bwd_kwargs["input_values"], iter(compute_parameters(self.submod)))
            if backward_type == "weight":  # .grad on the gathered parameters the graph used, then reduced
                stage_backward_weight(iter(compute_parameters(self.submod)), bwd_kwargs["param_groups"])
                reduce_weight_grads(self.submod)
                return None, None
            # torch's own stage would take its FSDPModule branch (the submodule is one): FSDP2's no-sync keeps
            # every micro-batch's gradients unsharded in the compute dtype; no_sync above accumulates them
            # reduced, in the main grads' dtype
            return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"]), None

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        finish_grad_accumulation(self.submod)
        self.scale_grads(grad_scale_factor)  # divides .grad by the micro-batch count (not FSDP2's reduce point)

    # torch infers shapes (unless given input_args/output_args) with a real forward and
    # backward on the first step: that backward accumulates without finalizing, and what it
    # left in the engine is dropped before training starts.
    def _prepare_backward_infra(self, *args: Any, **kwargs: Any):
        with self.submod.no_sync():
            return super()._prepare_backward_infra(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.submod.zero_grad_buffer()
        self.submod.reshard()


def pipeline_groups(mesh: DeviceMesh, pp_axis: str = "pp") -> tuple[dist.ProcessGroup, int, int]:
    """The pipeline's process group, this rank's place on it, and its size, from ``mesh[pp_axis]``."""
    names = mesh.mesh_dim_names or ()
    if pp_axis not in names:
        raise ValueError(f"pp_axis={pp_axis!r} is not an axis of the mesh, whose axes are {list(names)}")
    sub = mesh[pp_axis]
    return sub.get_group(), sub.get_local_rank(), sub.size()


def build_schedule(schedule: str, stages: Sequence[ShardedPipelineStage], n_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor], **kwargs: Any):
    """One of torch's schedules over this rank's ``stages``, checked before anything runs.

    ``schedule`` is a key of :data:`SCHEDULES`; ``gpipe`` and ``1f1b`` take one stage
    per rank, ``interleaved``, ``looped_bfs`` and ``interleaved_zb`` several (virtual
    stages, rank ``r`` holding ``r``, ``r + pp``...), ``zbv`` two in a V (rank ``r``
    holding ``r`` and ``2 pp - 1 - r``). Other keyword arguments go to the schedule
    (``scale_grads``, chunk specs).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported; choose one of {sorted(SCHEDULES)}")
    stages = list(stages)
    wrong = [type(s).__name__ for s in stages if not isinstance(s, ShardedPipelineStage)]
    if not stages or wrong:
        raise ValueError(f"stages must be a non-empty list of ShardedPipelineStage, got {wrong or 'none'}")
    if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches!r} must be a positive integer")
    cls = SCHEDULES[schedule]
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule={schedule!r} runs one stage per rank, got {len(stages)} stages")
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, **kwargs)
    assert issubclass(cls, PipelineScheduleMulti)
    return cls(stages, n_microbatches, loss_fn=loss_fn, **kwargs)
