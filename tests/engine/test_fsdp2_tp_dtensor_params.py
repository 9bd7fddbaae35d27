"""FSDP2's 2-D / 3-D flow: ``parallelize_module(model, tp_mesh, plan)``, then ``fully_shard(m, mesh=dp_mesh)``.

torch's own recipe (``test_2d_mlp_with_nd_mesh``, ``test_3d_mlp_with_nd_mesh``, the 2-D state-dict tests) and
torchtitan's: parameters become DTensors on the TP submesh first, then ``fully_shard`` gets the data-parallel
submesh of the same world mesh. Each case runs torch's FSDP2 and shardwise with the very same code in the same
test: blocks with a column- and a row-wise TP linear (uneven TP and DP splits: 15 rows over 2 x 2) and a plain
scale beside them (FSDP2 shards it over the DP mesh alone), a plain head at the root, one block under
activation checkpointing; a few Adam steps. Losses, gradients and parameters (``full_tensor``) agree to
rtol 1e-5, and the parameters, gradients and optimizer state carry FSDP2's meshes and placements. A model
state dict saved with DCP by one implementation loads into the other.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.distributed import device, run_distributed

RTOL = 1e-5
STEPS = 3
BATCH = 4
UNEVEN = (5, 15)  # (dim, hidden): hidden over tp 2 is 8 and 7 rows; over dp 2 again 4, 4 and 4, 3

# name: (mesh shape, mesh dim names, the data-parallel dims fully_shard gets, flatten them into one, (dim, hidden),
# shard_placement_fn: None, 1 (Shard(1) for 2-D parameters) or "other" (a TP DTensor's other dim, as torch's
# test_init_2d_transformer_shard_diff_dim: it must see the DTensor parameter))
MESHES = {
    "dp_tp": ((2, 2), ("dp", "tp"), ("dp",), False, UNEVEN, None),
    "pp_dp_tp": ((1, 2, 2), ("pp", "dp", "tp"), ("dp",), False, UNEVEN, None),  # torch's 2-D test at world 4
    "hsdp_tp": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"), False, UNEVEN, None),
    "flat_dp_tp": ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"), True, UNEVEN, None),
    "dp_tp_shard_dim1": ((2, 2), ("dp", "tp"), ("dp",), False, (4, 8), 1),  # Shard(1) splits evenly only
    "dp_tp_shard_other_dim": ((2, 2), ("dp", "tp"), ("dp",), False, (4, 8), "other"),
}


def _placement_fn(kind):
    from torch.distributed.tensor import DTensor, Shard

    def other_dim(p):
        tp = [q.dim for q in p.placements if isinstance(q, Shard)] if isinstance(p, DTensor) else []
        return Shard(p.ndim - 1 - tp[0]) if tp else Shard(0)

    if kind is None:
        return None
    return other_dim if kind == "other" else (lambda p: Shard(kind) if p.ndim == 2 else None)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))  # plain: not in the TP plan
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.relu(self.up(x * self.scale)))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden), Block(dim, hidden)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _meshes(case: str):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names, dp, flatten, _, _ = MESHES[case]
    world = init_device_mesh(device().type, shape, mesh_dim_names=names)
    dp_mesh = world[dp] if len(dp) > 1 else world[dp[0]]
    if flatten:
        dp_mesh = dp_mesh._flatten()
    return dp_mesh, world["tp"]


def _build(impl: str, case: str, seed: int = 0) -> nn.Module:
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import shardwise

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    dp_mesh, tp_mesh = _meshes(case)
    (dim, hidden), shard_dim = MESHES[case][4:]
    torch.manual_seed(seed)
    model = Net(dim, hidden).to(device())
    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel(use_local_output=False)  # uneven: the DTensor knows its split
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    checkpoint(model.blocks[1])
    placement_fn = _placement_fn(shard_dim)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement_fn)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=placement_fn)
    return model


def _face(t) -> tuple:
    return t.device_mesh.mesh_dim_names, t.device_mesh.mesh.tolist(), [str(p) for p in t.placements]


def _train(impl: str, case: str, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _build(impl, case)
    dim = MESHES[case][4][0]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dp_rank = dist.get_rank() // 2  # TP ranks (consecutive pairs) read the same rows
    losses, grads = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        loss = model(torch.randn(BATCH, dim, generator=g).to(device())).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()},
        "faces": {n: _face(p) for n, p in model.named_parameters()},
        "grad_faces": {n: _face(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        "state_faces": {n: {k: _face(v) for k, v in opt.state[p].items() if k != "step"}
                        for n, p in model.named_parameters()},
        "state": {n: opt.state[p]["exp_avg_sq"].full_tensor().cpu() for n, p in model.named_parameters()},
    }


def _load(impl: str, case: str, folder: str) -> dict:
    """A fresh model (another seed) of ``impl`` loading the other implementation's DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _build(impl, case, seed=1)
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=folder)
    set_model_state_dict(model, sd)
    return {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}


def _close(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=RTOL, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", list(MESHES))
def test_tp_dtensor_params_train_and_checkpoint_as_fsdp2(case, tmp_path):
    theirs = run_distributed(_train, 4, "fsdp2", case, str(tmp_path / "fsdp2"))
    ours = run_distributed(_train, 4, "shardwise", case, str(tmp_path / "shardwise"))
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=RTOL, atol=0)
        for step in range(STEPS):
            _close(b["grads"][step], a["grads"][step])
        _close(b["params"], a["params"])
        _close(b["state"], a["state"])
        for key in ("faces", "grad_faces", "state_faces"):
            assert b[key] == a[key], key
    # each implementation's checkpoint, loaded by the other: the trained weights
    for impl, folder, want in (("shardwise", "fsdp2", theirs), ("fsdp2", "shardwise", ours)):
        for loaded, saved in zip(run_distributed(_load, 4, impl, case, str(tmp_path / folder)), want):
            _close(loaded, saved["params"])


def _meta_init(impl: str, case: str) -> dict:
    """torch's test_meta_device_2d_init flow: TP plan and fully_shard on the meta device, then ``to_empty`` and
    each module's ``reset_parameters`` (DTensor random ops on the sharded faces), then one step."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import shardwise

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    dp_mesh, tp_mesh = _meshes(case)
    dim, hidden = MESHES[case][4]
    with torch.device("meta"):
        model = Net(dim, hidden)
        parallelize_module(model, tp_mesh, {"blocks.0.up": ColwiseParallel(use_local_output=False),
                                            "blocks.0.down": RowwiseParallel()})
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=device())
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        if isinstance(module, Block):
            nn.init.uniform_(module.scale)
    init = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(dist.get_rank() // 2)
    loss = model(torch.randn(BATCH, dim, generator=g).to(device())).pow(2).sum()
    loss.backward()
    return {"init": init, "loss": loss.item(),
            "grads": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}}


def test_meta_device_tp_init_as_fsdp2():
    theirs = run_distributed(_meta_init, 4, "fsdp2", "dp_tp")
    ours = run_distributed(_meta_init, 4, "shardwise", "dp_tp")
    for a, b in zip(theirs, ours):
        for name in a["init"]:  # the same random numbers land in the same local rows
            assert torch.equal(b["init"][name], a["init"][name]), name
        torch.testing.assert_close(b["loss"], a["loss"], rtol=RTOL, atol=0)
        _close(b["grads"], a["grads"])


def _refusals(impl: str) -> dict:
    """What shardwise refuses or takes in this flow, tried on both where FSDP2 can run on this host."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import shardwise

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    world = init_device_mesh(device().type, (2, 1), mesh_dim_names=("dp", "tp"))

    def model():
        net = Net(*UNEVEN).to(device())
        parallelize_module(net, world["tp"], {"blocks.0.up": ColwiseParallel()})
        return net

    def int_reshard():  # the DP size: True (FSDP2 refuses a smaller group for DTensor parameters, at forward)
        net = model()
        fully_shard(net, mesh=world["dp"], reshard_after_forward=2)
        net(torch.randn(BATCH, UNEVEN[0], device=device()))

    cases = {"int_reshard": int_reshard}
    if impl == "shardwise":  # FSDP2 would need that device type to start
        other = "cuda" if device().type == "cpu" else "cpu"
        dp_other = DeviceMesh.from_group(world["dp"].get_group(), other, mesh_dim_names=("dp",))
        cases["mesh_type"] = lambda: fully_shard(model(), mesh=dp_other)
        cases["mesh_none"] = lambda: fully_shard(model())
        cases["strategy"] = lambda: fully_shard(model(), mesh=world["dp"], strategy="optim")
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = ("accepted", "")
        except (ValueError, TypeError, NotImplementedError) as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_tp_dtensor_params_refusals():
    theirs = run_distributed(_refusals, 2, "fsdp2")[0]
    ours = run_distributed(_refusals, 2, "shardwise")[0]
    assert theirs["int_reshard"] == ours["int_reshard"] == ("accepted", "")
    assert ours["mesh_type"][0] == "ValueError"
    assert "Requires DTensor to have mesh of the same type as the FSDP mesh" in ours["mesh_type"][1]
    assert ours["mesh_none"][0] == "ValueError" and "parameter 'blocks.0.up.weight'" in ours["mesh_none"][1]
    assert ours["strategy"][0] == "ValueError" and "strategy" in ours["strategy"][1]
