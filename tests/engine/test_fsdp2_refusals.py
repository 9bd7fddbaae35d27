"""What FSDP2's ``fully_shard`` refuses at wrap time, refused by shardwise's where and as FSDP2 does (issue 54:
torch's ``test_2d_mesh_without_mesh_dim_names`` and ``test_raise_noncontiguous_parameter``), and what its lazy
init refuses at the first forward (torch's ``test_fully_shard_multi_module_root`` and
``test_fully_shard_double_lazy_init``); each case runs torch's ``fully_shard`` and shardwise's on the same input
in the same test. shardwise's own placement arguments (``placements=`` / ``strategy=``, the Megatron face and
the one-call form) keep taking them all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from tests.helpers.distributed import device, run_distributed


def _outcome(call) -> tuple:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the class and words are what is compared
        return type(e), str(e)
    return None, ""


def _channels_last_conv() -> nn.Module:
    return nn.Conv2d(8, 8, 3).to(device()).to(memory_format=torch.channels_last)


def _refusals() -> dict:
    world = dist.get_world_size()
    unnamed = init_device_mesh(device().type, (2, world // 2))
    out = {}
    for which, fully_shard in (("fsdp2", torch_fully_shard), ("shardwise", shardwise.fully_shard)):
        out[which, "mesh"] = _outcome(lambda: fully_shard(nn.Linear(4, 4).to(device()), mesh=unnamed))
        out[which, "noncontiguous"] = _outcome(lambda: fully_shard(_channels_last_conv()))
        conv = nn.Sequential(_channels_last_conv(), nn.Linear(4, 4).to(device()))
        out[which, "ignored"] = _outcome(lambda: fully_shard(conv, ignored_params=set(conv[0].parameters())))
    # shardwise's own placement arguments read the axes themselves: still taken, and computing the same output
    torch.manual_seed(0)
    reference = nn.Sequential(_channels_last_conv(), nn.Linear(6, 4).to(device()))
    reference[0].to(memory_format=torch.contiguous_format)  # the gathered weight's layout: the same kernel
    torch.manual_seed(0)
    model = nn.Sequential(_channels_last_conv(), nn.Linear(6, 4).to(device()))
    shardwise.fully_shard(model, mesh=unnamed, strategy="optim_grads_params")
    out["native_shapes"] = [tuple(p.full_tensor().shape) for p in model.parameters()]
    out["reference_shapes"] = [tuple(p.shape) for p in reference.parameters()]
    x = torch.randn(2, 8, 8, 8, device=device())
    out["native"], out["reference"] = model(x).detach().cpu(), reference(x).detach().cpu()
    return out


def test_unnamed_2d_mesh_and_noncontiguous_parameter_refused_as_fsdp2():
    out = run_distributed(_refusals, 4)[0]
    for case in ("mesh", "noncontiguous"):
        theirs, ours = out["fsdp2", case], out["shardwise", case]
        assert theirs[0] is not None, case
        assert ours[0] is theirs[0], (case, ours, theirs)  # AssertionError / NotImplementedError, FSDP2's classes
    assert "Please init the 2D mesh for HSDP with mesh_dim_names specified" in out["shardwise", "mesh"][1]
    assert "mesh_dim_names=(" in out["shardwise", "mesh"][1]  # what to do
    assert "FSDP does not support non-contiguous parameters" in out["shardwise", "noncontiguous"][1]
    assert "'weight'" in out["shardwise", "noncontiguous"][1] and ".contiguous()" in out["shardwise", "noncontiguous"][1]
    # FSDP2 does not look at a parameter it does not manage: neither does shardwise
    assert out["fsdp2", "ignored"] == out["shardwise", "ignored"] == (None, "")
    assert out["native_shapes"] == out["reference_shapes"]
    torch.testing.assert_close(out["native"], out["reference"], rtol=0, atol=0)


# ------------------------------------------------------------------ FSDP2's refusals at the first forward
# FSDP2 decides which state is a root at its first forward (its lazy init): the first state to run forward is
# one. torch's ``TestFullyShardLazyInit.test_fully_shard_multi_module_root`` / ``test_fully_shard_double_lazy_init``
# refuse two programs there; each is run below step by step on both libraries, with its accepted neighbours.
class _MLP(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _steps(fully_shard, program: str, **kw) -> list:
    """Wrap a fresh two-MLP model as ``program`` says, then run its forwards one by one: each step's outcome
    (``(None, "")`` or the exception's class and words), up to the first that raises; last, the gradients
    the steps left where every one ran (a root forward there would be a program of its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP()).to(device())
    x = torch.randn(2, 8, device=device())
    wrap = {
        "list_alone": lambda: fully_shard([model[0], model[1]], **kw),
        "list_then_root": lambda: (fully_shard([model[0], model[1]], **kw), fully_shard(model, **kw)),
        "leaves_then_root": lambda: (fully_shard(model[0].in_proj, **kw), fully_shard(model[0].out_proj, **kw),
                                     fully_shard(model, **kw)),
        "three_levels": lambda: (fully_shard(model[0].in_proj, **kw), fully_shard(model[0], **kw),
                                 fully_shard(model, **kw)),
    }[program.split(":")[0]]
    wrap()
    forwards = {
        "root": lambda: model(x).sum().backward(),
        "in_proj": lambda: model[0].in_proj(x).sum().backward(),
        "out_proj": lambda: model[0].out_proj(x).sum().backward(),
        "block": lambda: model[0](x).sum().backward(),
        "state_in_proj": lambda: fully_shard.state(model[0].in_proj)._lazy_init(),  # torch's tests' way
        "state_root": lambda: fully_shard.state(model)._lazy_init(),
    }
    out = []
    for step in program.split(":")[1].split(","):
        out.append(_outcome(forwards[step]))
        if out[-1][0] is not None:
            return out
    out.append([None if p.grad is None else p.grad.full_tensor().cpu() for p in model.parameters()])
    return out


_PROGRAMS = (
    # refused by FSDP2 (at the step that raises there)
    "list_alone:root",  # a list unit's forward makes it a root: "requires a single root module"
    "list_then_root:block,root",  # the list unit's forward before the root's: the same
    "leaves_then_root:in_proj,root",  # in_proj made a root by its own forward; the root's first forward refuses
    "leaves_then_root:state_in_proj,state_root",  # the same through FSDP2's state, as torch's test does
    "three_levels:in_proj,block",  # model[0]'s first forward finds in_proj's role fixed
    "three_levels:block,root",
    # taken by FSDP2
    "list_then_root:root,block,root",  # the list unit nested under a root, called alone after its first forward
    "leaves_then_root:in_proj,out_proj,in_proj",  # units as roots of their own, no root forward after them
    "leaves_then_root:root,in_proj,out_proj,root",  # the root's forward first: units by themselves after it
    "three_levels:root,in_proj,block,root",
)


def _lazy_init_programs() -> dict:
    out = {}
    for which, fully_shard in (("fsdp2", torch_fully_shard), ("shardwise", shardwise.fully_shard)):
        for program in _PROGRAMS:
            out[which, program] = _steps(fully_shard, program)
    # shardwise's own placement arguments fix the root by the calls: both programs run
    for program in ("list_alone:root", "leaves_then_root:in_proj,root"):
        out["strategy", program] = _steps(shardwise.fully_shard, program, strategy="optim_grads_params")
    return out


def test_first_forward_refusals_as_fsdp2():
    out = run_distributed(_lazy_init_programs, 1)[0]
    for program in _PROGRAMS:
        theirs, ours = out["fsdp2", program], out["shardwise", program]
        assert len(ours) == len(theirs), (program, ours[-1], theirs[-1])  # the same step raises, or none
        for step, (t, o) in enumerate(zip(theirs[:-1], ours[:-1])):
            assert t == o == (None, ""), (program, step, o, t)
        t, o = theirs[-1], ours[-1]
        if isinstance(t[0], type):  # refused: FSDP2's class, and the key phrase a test matches
            assert o[0] is t[0] is RuntimeError, (program, o, t)
            key = ("FSDP requires a single root module but got " if "single root" in t[1] else
                   t[1].split("\n")[0] + "\nFSDP requires running forward through the root module first")
            assert key in t[1] and key in o[1], (program, o, t)
        else:  # taken: the same gradients
            assert [g is None for g in o] == [g is None for g in t], program
            for go, gt in zip(o, t):
                torch.testing.assert_close(go, gt)
    assert "0.in_proj" in out["shardwise", "leaves_then_root:in_proj,root"][-1][1]
    assert "in_proj" in out["shardwise", "three_levels:in_proj,block"][-1][1]
    for program in ("list_alone:root", "leaves_then_root:in_proj,root"):
        steps = out["strategy", program]
        assert all(step == (None, "") for step in steps[:-1]) and isinstance(steps[-1], list), (program, steps)
