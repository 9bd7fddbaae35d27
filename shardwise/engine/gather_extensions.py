"""FSDP2's all-gather extensions: parameters whose tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.

torch's FSDP2 lets a tensor subclass (torchao's float8 weights, quantised
weights) choose what travels in a parameter's all-gather and what forward
reads: ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
mp_policy)`` (or the older ``(mesh)``) turns this rank's sharded local tensor
into all-gather inputs (one or more tensors, any dtypes) and metadata;
``fsdp_post_all_gather(outputs, metadata, param_dtype)`` turns the gathered
outputs into the unsharded tensor and the inner tensors to free at reshard,
and on later gathers fills that tensor in place (``out=``).

Such parameters form a group of their own (the bucket key says so), which
keeps FSDP2's layout for them: the sharded DTensor's local tensor is an
instance of the subclass (``new_zeros`` of the padded piece, this rank's rows
copied in, narrowed to them), so the optimizer steps it through the
subclass's own ops and the hooks see the object FSDP2 would hand them. A
gather calls each parameter's pre-hook on the gather stream, all-gathers
every input over the axis that shards the parameters (one call for the
group; as bytes when the dtypes differ, as FSDP2) into outputs made at the
first gather and freed by storage at reshard, then calls the post-hooks on
the compute stream. Gradients are plain tensors reduced as every group's (a
subclass gradient is copied into a plain one first, as FSDP2's reduce-scatter
copy-in does). Groups without such parameters never call into this module while training (one
``None`` test per gather, reshard and version read).

Built for FSDP2's placements: parameters sharded like their optimizer state
over one data-parallel axis (FSDP, HSDP, one rank), on the device, in their
own dtype, along dim 0; others are refused at ``fully_shard`` by name.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from .collectives import InFlight
from .distributed_buffer import Levels
from .mesh import ShardingPlan
from .precision import MixedPrecisionPolicy
from .sharded_param import ParamRef, ShardedParam, _contiguous_stride

__all__ = ["EXTENSIONS_KIND", "has_extensions", "patched_hooks", "check_extension_group", "ExtensionParam",
           "ExtensionGather"]

EXTENSIONS_KIND = "fsdp2_extensions"  # the bucket key's gather kind: such parameters are grouped apart
PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def has_extensions(param: torch.Tensor, fqn: str = "") -> bool:
    """Whether ``param`` (its type, or its data's) defines FSDP2's all-gather hooks; one without the other is
    refused, as FSDP2 refuses it."""
    found = [t for t in (param, param.data) if hasattr(t, PRE) or hasattr(t, POST)]
    if not found:
        return False
    if not all(hasattr(t, PRE) and hasattr(t, POST) for t in found):
        raise ValueError(f"parameter {fqn!r} ({type(param).__name__}) defines only one of {PRE} and {POST}; "
                         "FSDP2's all-gather extensions need both")
    return True


def patched_hooks(name: str, fqns: Sequence[str], sharded_params: Sequence[torch.Tensor]) -> bool:
    """Whether FSDP2's hooks were patched onto the local tensors of a plain group's sharded parameters (all of
    them: shardwise gathers the group together, so some but not all is refused by name)."""
    patched = [has_extensions(p._local_tensor, fqn) for p, fqn in zip(sharded_params, fqns)]
    if any(patched) and not all(patched):
        raise NotImplementedError(
            f"FSDP2's all-gather hooks were patched onto the local tensors of {name}'s parameters "
            f"{[f for f, x in zip(fqns, patched) if x]} but not of {[f for f, x in zip(fqns, patched) if not x]}, "
            "which shardwise gathers with them (one unit's parameters of one dtype): patch all of them, or define "
            "the hooks on a tensor subclass")
    return any(patched)


class ExtensionParam(ShardedParam):
    """A parameter gathered through its hooks: its gradient reaches the flat buffers as a plain tensor."""

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None or type(grad) is torch.Tensor:
            return grad
        plain = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        plain.copy_(grad)  # FSDP2's copy-in into its plain reduce-scatter buffer reads the subclass the same way
        return plain


def check_extension_group(name: str, fqns: Sequence[str], refs: Sequence[ParamRef], plan: ShardingPlan,
                          policy: MixedPrecisionPolicy, offloaded: bool, graph_safe: bool, fp8_marked: bool,
                          dtype: torch.dtype) -> None:
    """Refuse, by parameter name, what the extension path is not built for."""
    why = None
    if plan.model_parallel or any(ref.model_parallel_dims or ref.local_axes for ref in refs):
        why = "under tensor or expert parallelism (or dp_mesh_dims) they are not built"
    elif len(plan.param_axes) != len(plan.opt_axes) or not plan.opt_axes:
        why = ("their parameters are replicated (strategy no_shard / optim / optim_grads, or HFSDP's outer axis): "
               "built for FSDP2's placements, parameters sharded like their optimizer state (optim_grads_params, "
               "HSDP)")
    elif sum(a.size > 1 for a in plan.opt_axes) > 1:
        why = f"their parameters are sharded over more than one axis ({[a.name for a in plan.opt_axes]})"
    elif any(ref.shard_dim != 0 for ref in refs):
        why = "shard_placement_fn returned Shard(dim > 0) for them; they shard along dim 0 only"
    elif offloaded:
        why = "their main weights are offloaded to the host (offload_policy)"
    elif fp8_marked:
        why = "they are also marked for shardwise's FP8 gather (convert_to_fp8(..., all_gather=True)); use one"
    elif graph_safe:
        why = "graph_safe=True keeps every buffer at one address, which the hooks' own tensors do not"
    elif policy.main_dtype(dtype) != dtype:
        why = (f"main_params_dtype={policy.main_params_dtype} would keep main weights in another dtype than the "
               f"parameters' {dtype}; FSDP2 keeps the subclass as it is (leave main_params_dtype unset)")
    if why:
        raise NotImplementedError(f"parameters {list(fqns)} of {name} define FSDP2's all-gather extensions "
                                  f"({PRE} / {POST}), but {why}")


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.itemsize
    storage = tensor.untyped_storage()
    if storage.size() != size:
        storage.resize_(size)


class ExtensionGather:
    """One group's gathers through its parameters' hooks: the sharded subclass pieces, the pre-hooks' inputs
    and metadata, the gathered outputs (made once, storage freed at reshard), the post-hooks' unsharded
    parameters and the inner tensors freed with them."""

    def __init__(self, refs: Sequence[ParamRef], levels: Levels, plan: ShardingPlan, policy: MixedPrecisionPolicy,
                 dtype: torch.dtype):
        self.fqns = [ref.fqn for ref in refs]
        self.params: list[ShardedParam] = levels.params
        self.levels = levels
        self.level = len(levels.axes)  # the optimizer level: this rank's piece (FSDP2's sharded parameter)
        axes = [a for a in levels.axes if a.size > 1] or levels.axes[-1:]
        self.axis = axes[0]
        mesh = plan.mesh
        self.mesh = mesh if mesh.ndim == 1 else mesh[self.axis.name]  # FSDP2 hands the hooks the shard mesh
        self.modules = [ref.holders[0][0] for ref in refs]  # the module that holds each parameter
        self.mp_policy = TorchMixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.grad_comm_dtype,
                                                   output_dtype=policy.output_dtype,
                                                   cast_forward_inputs=policy.cast_forward_inputs)
        # FSDP2's param_dtype or orig_dtype (no cast for non-floating parameters)
        self.param_dtype = policy.compute_dtype(dtype) if dtype.is_floating_point else dtype
        n = len(self.params)
        self.padded: list[torch.Tensor | None] = [None] * n  # each piece padded to the chunk's rows
        self.locals: list[torch.Tensor | None] = [None] * n  # this rank's real rows of it: the DTensor's local
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # 1-D gathered outputs, made once
        self.sizes: list[list[torch.Size]] = [[] for _ in range(n)]  # the inputs' sizes (to unflatten outputs)
        self.metadata: list = [None] * n
        self.inner: list[tuple[torch.Tensor, ...]] = [() for _ in range(n)]  # freed with the outputs
        self.built = [False] * n  # the unsharded parameter exists (later gathers fill it: out=)
        self._hooked: list[torch.Tensor] = []  # the locals whose hooks the current gather called

    # ------------------------------------------------------------- sharded pieces
    def padded_shape(self, i: int) -> torch.Size:
        p = self.params[i]
        return torch.Size([p.pieces[self.level - 1].chunk, *p.shape[1:]])

    @torch.no_grad()
    def shard(self, fulls: Sequence[torch.Tensor] | None, device: torch.device) -> None:
        """This rank's pieces as FSDP2 makes them (``fulls``: the full parameters, or ``None``: zeros on
        ``device`` of the subclass the pieces already have, a model built on the meta device)."""
        self.outputs = [[] for _ in self.params]  # new pieces: the first gather makes new outputs and parameters
        self.inner = [() for _ in self.params]
        self.built = [False] * len(self.params)
        for i, p in enumerate(self.params):
            start, rows = p.real_rows(self.level)
            if fulls is None:
                padded = torch.zeros_like(self.padded[i], device=device)
            else:
                full = fulls[i]
                padded = full.new_zeros(self.padded_shape(i))
                if rows:
                    padded.narrow(0, 0, rows).copy_(full.narrow(0, start, rows))
            self.padded[i] = padded
            self.locals[i] = padded.narrow(0, 0, rows)

    def adopt(self, locals_: Sequence[torch.Tensor]) -> None:
        """Take sharded locals that are not the subclass's pieces (plain views of a group's main weights, hooks
        patched onto them as instance methods) as the pieces."""
        self.padded = self.locals = list(locals_)

    def placeholders(self, device: torch.device, requires_grad: bool) -> list[nn.Parameter]:
        """What the group's unsharded parameters are until the first gather's post-hooks make them."""
        return [nn.Parameter(torch.empty(0, device=device), requires_grad=requires_grad) for _ in self.params]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.padded if t is not None)

    # -------------------------------------------------------------------- gather
    def _inputs(self, i: int, local: torch.Tensor) -> list[torch.Tensor]:
        """Parameter ``i``'s pre-hook called as FSDP2 calls it; its inputs flattened."""
        hook = getattr(local, PRE)
        count = len(inspect.signature(hook).parameters)
        if count == 1:  # the older signature: the mesh only
            inputs, self.metadata[i] = hook(self.mesh)
        elif count == 5:
            p = self.params[i]
            inputs, self.metadata[i] = hook(self.mesh, p.shape, _contiguous_stride(p.shape), self.modules[i],
                                                 self.mp_policy)
            padded = self.padded_shape(i)
            if local.size() != padded and any(t.size() != padded for t in inputs):
                raise ValueError(
                    f"parameter {self.fqns[i]!r} is sharded unevenly (size {tuple(p.shape)} over {self.axis.size} "
                    f"ranks): its {PRE} must return all-gather inputs of the padded piece's size {tuple(padded)}, "
                    f"got {[tuple(t.shape) for t in inputs]} (FSDP2's rule)")
        else:
            raise TypeError(f"parameter {self.fqns[i]!r}: {PRE}{inspect.signature(hook)} takes {count} arguments; "
                            "FSDP2 calls it as (mesh, outer_size, outer_stride, module, mp_policy) or (mesh)")
        sizes = [t.size() for t in inputs]
        if self.outputs[i] and ([o.dtype for o in self.outputs[i]] != [t.dtype for t in inputs]
                                or sizes != self.sizes[i]):
            raise ValueError(f"parameter {self.fqns[i]!r}: {PRE} returned inputs of other sizes or dtypes than at "
                             f"the first gather ({sizes} against {self.sizes[i]}); FSDP2 reuses the first outputs")
        self.sizes[i] = sizes
        return [t.reshape(-1) for t in inputs]

    def start(self, locals_: Sequence[torch.Tensor]) -> InFlight:
        """Call the pre-hooks on the sharded locals the modules' DTensors hold (``locals_``) and all-gather
        their inputs into the outputs, on the gather stream."""
        levels = self.levels
        streams = levels.streams
        self._hooked = list(locals_)  # the post-hooks are the same objects' (FSDP2 calls both on its local tensor)
        with streams.on(streams.gather), torch.no_grad():
            inputs = [self._inputs(i, local) for i, local in enumerate(locals_)]
        with levels.collectives.buffers():  # the outputs' storage, on the compute stream (freed at reshard)
            for i, ins in enumerate(inputs):
                if not self.outputs[i]:
                    self.outputs[i] = [torch.empty(t.numel() * self.axis.size, dtype=t.dtype, device=levels.device)
                                       for t in ins]
                else:
                    for out in self.outputs[i]:
                        _alloc(out)
        ins = [t for group in inputs for t in group]
        outs = [o for group in self.outputs for o in group]
        if len({t.dtype for t in ins}) > 1:  # FSDP2: inputs of several dtypes travel as bytes
            ins, outs = [t.view(torch.uint8) for t in ins], [o.view(torch.uint8) for o in outs]
        with streams.on(streams.gather), torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            if self.axis.size > 1:
                levels.collectives.gather(outs, ins, self.axis)
            elif outs:
                torch._foreach_copy_(outs, ins)
        return InFlight(streams.record(streams.gather), keepalive=tuple(ins))

    @torch.no_grad()
    def finish(self, unsharded_params: list, requires_grad: bool) -> None:
        """The post-hooks, on the compute stream once the gather is waited on: the first builds each unsharded
        parameter (``unsharded_params[i]``), later ones fill it in place (``out=``)."""
        for i, p in enumerate(self.params):
            outputs = tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs[i], self.sizes[i]))
            hook = getattr(self._hooked[i], POST)
            if self.built[i]:
                for t in self.inner[i]:
                    _alloc(t)
                hook(outputs, self.metadata[i], self.param_dtype, out=unsharded_params[i])
            else:
                tensor, inner = hook(outputs, self.metadata[i], self.param_dtype)
                unsharded = torch.as_strided(tensor, p.shape, _contiguous_stride(p.shape), 0)
                unsharded_params[i] = nn.Parameter(unsharded, requires_grad=requires_grad)
                self.inner[i] = tuple(inner)
                self.built[i] = True
            self.metadata[i] = None

    def free(self) -> None:
        """Release the gathered outputs and the post-hooks' inner tensors (their objects stay for the next
        gather, as FSDP2's)."""
        for i in range(len(self.params)):
            for t in (*self.outputs[i], *self.inner[i]):
                _free(t)

    def storage_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for i in range(len(self.params))
                   for t in (*self.outputs[i], *self.inner[i]))

