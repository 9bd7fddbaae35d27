"""Pipeline parallelism: ``torch.distributed.pipelining`` stages whose modules ``fully_shard`` wrapped.

torch's schedules drive the stages; this module only tells a stage how a
sharded module accumulates and reduces. torch's ``PipelineStage`` knows FSDP2's
and DDP's modules by type and runs any other module's backward plainly, which
would reduce a shardwise model's gradients after every micro-batch. A
:class:`ShardedPipelineStage` runs every micro-batch's backward inside the
model's ``no_sync()`` and, at the schedule's one gradient-reduction point per
step (``perform_reduce_grad``, which every torch schedule calls after a stage's
last backward), calls :func:`shardwise.engine.finish_grad_accumulation`: the
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

Zero-bubble schedules (``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``,
``ScheduleDualPipeV``) are refused. They split a backward in two: an input
pass, ``autograd.grad`` from the stage's outputs to its inputs only, then a
weight pass, ``autograd.grad`` from the saved intermediate nodes to the weights'
``AccumulateGrad`` nodes, writing ``weight.grad`` itself. Neither fits the
engine as it is: (1) torch hands both passes ``submod.parameters()``, the
sharded DTensors at rest, whose grad-accumulator nodes are not in the graph
(the graph used the gathered compute parameters the hooks swapped in), so the
weight pass would find no weights and drop every gradient; passing the
gathered parameters instead is possible (they are the same objects every
step); but (2) the engine reduces a unit when the backward of its inputs
fires, which is in the input pass, before any weight gradient exists (an
``autograd.grad`` to the inputs accumulates no ``.grad``), and the weight pass
fires none of the engine's hooks. Supporting it needs the engine to defer a
unit's reduction from its input pass to the end of its weight pass (a unit
state "weight gradients owed", counted per micro-batch like the forwards
owed a backward) and take the weight pass's ``.grad`` on the gathered
parameters into its accumulation window; not built.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from .device import device_for
from .engine import finish_grad_accumulation, is_sharded

__all__ = ["ShardedPipelineStage", "SCHEDULES", "build_schedule", "pipeline_groups"]

# The schedules whose backwards are whole (one autograd backward per micro-batch and stage).
# Zero-bubble schedules split it into an input and a weight pass: refused (the module docstring says why).
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
}


class ShardedPipelineStage(PipelineStage):
    """A ``PipelineStage`` for a module ``fully_shard`` wrapped: one gradient reduction per step.

    Arguments as ``PipelineStage``'s; ``group`` is the pipeline's process group (the
    ``pp`` axis of the mesh) and ``device`` defaults to where the module's mesh
    computes. Every micro-batch's backward accumulates (``no_sync``); the schedule's
    reduce-grad point reduces, installs ``.grad`` and then divides it by the number
    of micro-batches when the schedule scales gradients.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | None = None, *, group: dist.ProcessGroup | None = None, **kwargs: Any):
        if not is_sharded(submodule):
            raise ValueError(f"ShardedPipelineStage: submodule={type(submodule).__name__} is not wrapped by "
                             "shardwise.fully_shard; shard each stage's module on its data-parallel mesh first")
        if device is None:
            device = device_for(group if group is not None else dist.group.WORLD)
        super().__init__(submodule, stage_index, num_stages, device, group=group, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":
            raise NotImplementedError(
                f"ShardedPipelineStage: a {backward_type!r} backward (a zero-bubble schedule's split backward) "
                f"is not supported: the engine reduces a unit's gradients in the input pass, before the weight "
                f"pass computes them; use one of {sorted(SCHEDULES)}")
        with self.submod.no_sync():  # accumulate; perform_reduce_grad reduces once for all micro-batches
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        finish_grad_accumulation(self.submod)
        super().perform_reduce_grad(grad_scale_factor)  # divides .grad by the micro-batch count

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
    per rank, ``interleaved`` and ``looped_bfs`` several (virtual stages). Other
    keyword arguments go to the schedule (``scale_grads``, chunk specs).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported; choose one of {sorted(SCHEDULES)} "
                         "(zero-bubble schedules split backward in a way the engine cannot take yet)")
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
