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
follows what torch did). A change the engine cannot follow (another dtype or
device than the group's) raises, naming the parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .param_group import ModuleParams, ParamGroup

__all__ = ["adopt_module_params"]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _views_main(group: ParamGroup, i: int, param: torch.Tensor) -> bool:
    local, main = param._local_tensor, group.main_local(i)
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
    storage in place). ``strict_dtype`` refuses values of another dtype (``model.half()``) instead of casting
    them (a loaded checkpoint). Whether anything was taken in."""
    if group.module_params is not ModuleParams.SHARDED:  # inside a forward the modules hold the gathered weights
        return False
    held = [ref.holders[0][0]._parameters[ref.holders[0][1]] for ref in group.refs]
    stale = [i for i, current in enumerate(held)
             if current is not group.sharded_params[i] or (deep and not _views_main(group, i, current))]
    if not stale:
        return False
    group.reshard()  # weights still gathered from an earlier forward are the old ones
    if group.device.type == "meta":
        devices = {h.device for h in held if not h.is_meta}
        if not devices:
            return False  # still on the meta device: nothing to take in yet
        device = devices.pop()
        if devices or not _same_device(device, group.target_device):
            raise ValueError(
                f"the parameters of {group.name} were given storage on {device}, but they are sharded for "
                f"{group.target_device} (the mesh's device): call model.to_empty(device={str(group.target_device)!r})")
        group.materialize(group.target_device)
        stale, moved = list(range(len(held))), True
    else:
        moved = False
    for i in stale:
        current, template = held[i], group.sharded_params[i]
        _check_change(group, i, current, strict_dtype, check_device=not moved)
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
    group.mark_weights_stale()
    return True


def _check_change(group: ParamGroup, i: int, value: torch.Tensor, strict_dtype: bool, check_device: bool) -> None:
    name, home = group.fqns[i], group.main_local(i).device
    if check_device and not _same_device(value.device, home):
        raise ValueError(
            f"parameter {name!r} was moved to {value.device}, but it is sharded on {home}: a sharded model "
            "stays on the device of its mesh (build it on the meta device and call model.to_empty(device=...) "
            "after fully_shard, or move it before fully_shard)")
    if strict_dtype and value.dtype != group.main_dtype:
        raise ValueError(
            f"parameter {name!r} was converted to {value.dtype} after fully_shard (model.to(dtype), .half(), "
            f"...): its sharded weights are {group.main_dtype}. Convert the model before fully_shard, or compute "
            "in another dtype with mp_policy=MixedPrecisionPolicy(param_dtype=...)")
