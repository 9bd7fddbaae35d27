"""What the modules hold, taken back into the engine: ``to_empty``, ``load_state_dict(assign=True)``, setattr.

torch lets a user replace a sharded model's parameters after ``fully_shard``:
``model.to_empty(device=...)`` swaps every parameter's storage (a meta-built
model gets its memory this way), ``load_state_dict(sd, assign=True)`` puts new
parameter objects in the modules (Accelerate loads pretrained weights so), and
plain ``module.weight = nn.Parameter(...)`` does too. The engine's gathers read
its own main-weight buffers, so a replaced parameter would otherwise be
trained by the optimizer and never read by forward. :func:`adopt_module_params`
finds every parameter that no longer views the main weights, copies its values
into them (sharding a full tensor, redistributing a DTensor of other
placements) and puts a parameter over the main weights back in every holder
(the user's new object itself where it is a DTensor parameter, so identity
follows what torch did). A dtype cast of the model (``model.to(dtype)``,
``.half()``, ...) swaps every parameter for one of the new dtype: the group is
rebuilt in that dtype (its flat buffers are one dtype each) and takes the values
and any ``.grad`` in. A change the engine cannot follow (another device than the
group's, a cast of only some parameters of a group) raises, naming them.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .param_group import ModuleParams, ParamGroup

__all__ = ["adopt_module_params"]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _views_main(group: ParamGroup, i: int, param: torch.Tensor) -> bool:
    local, main = param._local_tensor, group.main_local(i)
    if group.extensions is not None:  # a tensor subclass's own pieces (a wrapper has no data pointer to compare)
        return local is main
    return (local.data_ptr() == main.data_ptr() and local.dtype == main.dtype and local.shape == main.shape
            and local.device == main.device)


def _rows(group: ParamGroup, i: int, value: torch.Tensor, template: DTensor) -> torch.Tensor:
    """This rank's main rows of ``value`` (a DTensor, or the full tensor), laid out as ``template``."""
    if isinstance(value, DTensor):
        if value.device_mesh != template.device_mesh or tuple(value.placements) != tuple(template.placements):
            value = value.redistribute(template.device_mesh, template.placements)
        return value.to_local()
    if tuple(value.shape) != tuple(template.shape):
        raise ValueError(f"parameter {group.fqns[i]!r} was replaced by a tensor of shape {tuple(value.shape)}; "
                         f"the sharded parameter's full shape is {tuple(template.shape)}")
    return distribute_tensor(value.detach().to(template.device), template.device_mesh, template.placements).to_local()


def adopt_module_params(group: ParamGroup, deep: bool, strict_dtype: bool = False) -> bool:
    """Take the parameters the group's modules hold, where they are not the engine's own, into the main
    weights; ``deep`` also looks inside the parameters the engine handed out (``to_empty`` swaps their
    storage in place). ``strict_dtype`` (``nn.Module._apply``: ``model.to(dtype)``, ``.half()``, ...) takes
    another dtype as the model's new one: the group is rebuilt in it when every parameter of the group changed
    to it, and a cast of only some of them is refused; without it, values are cast into the group's dtype
    (a loaded checkpoint). Whether anything was taken in."""
    if group.module_params is not ModuleParams.SHARDED:  # inside a forward the modules hold the gathered weights
        return False
    held = [ref.holders[0][0]._parameters[ref.holders[0][1]] for ref in group.refs]
    stale = [i for i, current in enumerate(held) if current is not group.sharded_params[i]
             or current.dtype != group.main_dtype or (deep and not _views_main(group, i, current))]
    if not stale:
        return False
    group.reshard()  # weights still gathered from an earlier forward are the old ones
    # The engine's own parameter in another dtype: cast in place (``_apply`` swaps the tensor, keeps the object)
    # where no unit's ``_apply`` saw it (a cast of a submodule that is no unit), noticed at the next forward.
    cast_in_place = any(h is group.sharded_params[i] and h.dtype != group.main_dtype for i, h in enumerate(held))
    new_dtype = _cast_dtype(group, held) if strict_dtype or cast_in_place else None
    grads = []
    if new_dtype is not None:  # model.to(dtype): the whole group now lives in the new dtype (on meta: later)
        if group.device.type != "meta":
            for i, current in enumerate(held):
                _check_device(group, i, current)
        grads = [current.grad for current in held]  # cast by _apply with their parameters
        group.rebuild_in(new_dtype)
        stale = list(range(len(held)))
    moved = False
    if group.device.type == "meta":
        devices = {h.device for h in held if not h.is_meta}
        if not devices and new_dtype is None:
            return False  # still on the meta device: nothing to take in yet
        if devices:
            device = devices.pop()
            if devices or not _same_device(device, group.target_device):
                raise ValueError(
                    f"the parameters of {group.name} were given storage on {device}, but they are sharded for "
                    f"{group.target_device} (the mesh's device): call "
                    f"model.to_empty(device={str(group.target_device)!r})")
            group.materialize(group.target_device)
            stale, moved = list(range(len(held))), True
    for i in stale:
        current, template = held[i], group.sharded_params[i]
        if not moved:
            _check_device(group, i, current)
        if not current.is_meta:
            with torch.no_grad():
                group.main_local(i).copy_(_rows(group, i, current, template))
        fresh = group.rebuild_sharded_param(i)
        if isinstance(current, nn.Parameter) and isinstance(current, DTensor) and current.shape == fresh.shape:
            torch.utils.swap_tensors(current, fresh)  # the object the modules hold now views the main weights
            fresh = current
        group.sharded_params[i] = fresh
        for module, attr in group.refs[i].holders:
            module._parameters[attr] = fresh
    if new_dtype is not None:
        group.module_params = ModuleParams.SHARDED  # the modules hold the rebuilt group's parameters
        if any(g is not None for g in grads):
            _hand_back_grads(group, grads)
    group.mark_weights_stale()
    return True


def _cast_dtype(group: ParamGroup, held: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype every parameter of the group was cast to (``model.to(dtype)``), or None when none was cast;
    a cast of some of them only is refused (a group is one dtype: its flat buffers are)."""
    dtypes = {h.dtype for h in held}
    if dtypes == {group.main_dtype}:
        return None
    if len(dtypes) > 1:
        kept = [group.fqns[i] for i, h in enumerate(held) if h.dtype == group.main_dtype]
        cast = [group.fqns[i] for i, h in enumerate(held) if h.dtype != group.main_dtype]
        raise ValueError(
            f"parameters {cast} were cast to {sorted(str(d) for d in dtypes - {group.main_dtype})} after fully_shard "
            f"but {kept} of the same unit stayed {group.main_dtype}: shardwise casts a unit's parameters of one "
            "dtype together (one flat buffer); cast the whole unit (the module fully_shard was called on), or "
            "cast before fully_shard")
    if group.quantized is not None:
        raise ValueError(f"the parameters of {group.name} ({', '.join(group.fqns)}) gather as FP8 and cannot be "
                         "cast after fully_shard: cast the model before fully_shard and convert_to_fp8")
    if group.extensions is not None:
        raise ValueError(f"the parameters of {group.name} ({', '.join(group.fqns)}) gather through FSDP2's all-gather "
                         "extensions and are not cast after fully_shard by shardwise: cast the model before it")
    return dtypes.pop()


def _hand_back_grads(group: ParamGroup, grads: list) -> None:
    """The ``.grad`` a cast converted with their parameters, handed back over the rebuilt group: views of one
    main-grad buffer that the next backward accumulates onto, as the engine's own (cast copies or an offloaded
    group's host grads: the tensors themselves, which install adds to)."""
    window = group.window
    if window.hands_out_copies or group.offloaded or window.grad_attr != "grad":
        for param, grad in zip(group.sharded_params, grads):
            param.grad = grad
        return
    buffer = group.levels.zeros(group.opt_level, group.main_grad_dtype)
    views = buffer.dtensors()
    for i, (param, grad) in enumerate(zip(group.sharded_params, grads)):
        if grad is not None:
            with torch.no_grad():
                buffer.local(i).copy_(_rows(group, i, grad, views[i]))
            param.grad = views[i]
    window.main_grad_ref = weakref.ref(buffer.flat)


def _check_device(group: ParamGroup, i: int, value: torch.Tensor) -> None:
    name, home = group.fqns[i], group.main_local(i).device
    if not _same_device(value.device, home):
        raise ValueError(
            f"parameter {name!r} was moved to {value.device}, but it is sharded on {home}: a sharded model "
            "stays on the device of its mesh (build it on the meta device and call model.to_empty(device=...) "
            "after fully_shard, or move it before fully_shard)")
