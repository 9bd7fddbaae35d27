"""``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)`` as torch FSDP2's: the full SPMD mesh, DTensor parameters.

Each case runs torch's FSDP2 and shardwise with the very same code in the same test: a small MLP whose
parameters are DTensors on the whole mesh (``distribute_module``: ``Replicate()`` on the data-parallel dims,
column- and row-wise TP slices on ``tp``, a TP-replicated scale whose gradient is ``Partial`` over ``tp``),
wrapped per block and then at the root, trained a few steps. Losses, gradient norms (torch's
``clip_grad_norm_`` on the DTensor gradients) and final parameters agree to rtol 1e-5, and every sharded
parameter has FSDP2's mesh and placements (``_StridedShard`` beside a TP split of dim 0; shard dims flattened).
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
DIM, HIDDEN, BATCH = 8, 16, 4

# name: (world, mesh shape, mesh dim names, shard, replicate)
MESHES = {
    "fsdp_1": (1, (1, 1), ("dp_shard", "tp"), "dp_shard", None),
    "fsdp_2": (2, (2, 1), ("dp_shard", "tp"), "dp_shard", None),
    "tp_2": (2, (1, 2), ("dp_shard", "tp"), "dp_shard", None),
    "hsdp_2": (2, (2, 1), ("dp_replicate", "dp_shard"), "dp_shard", "dp_replicate"),
    "ddp_2": (2, (2, 1), ("dp_replicate", "tp"), None, "dp_replicate"),
    "fsdp_tp_4": (4, (2, 2), ("dp_shard", "tp"), "dp_shard", None),
    "hsdp_tp_4": (4, (2, 1, 2), ("dp_replicate", "dp_shard", "tp"), "dp_shard", "dp_replicate"),
    "flat_4": (4, (2, 2, 1), ("dp_shard", "cp", "tp"), ("dp_shard", "cp"), None),
    "hsdp_flat_4": (4, (2, 2, 1), ("dp_replicate", "dp_shard", "cp"), ("dp_shard", "cp"), "dp_replicate"),
}


class Block(nn.Module):
    """``x + down(relu(up(x * scale)))`` over DTensors: ``up`` column-wise, ``down`` row-wise on ``tp``."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.scale = nn.Parameter(torch.ones(DIM))
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        replicated = [Replicate()] * self.mesh.ndim
        h = DTensor.from_local(x, self.mesh, replicated, run_check=False)
        y = self.down(F.relu(self.up(h * self.scale)))  # Partial over tp
        return x + y.redistribute(self.mesh, replicated).to_local()


class Net(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.blocks = nn.ModuleList([Block(mesh), Block(mesh)])
        self.head = nn.Linear(DIM, DIM)
        self.mesh = mesh

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate

        for block in self.blocks:
            x = block(x)
        replicated = [Replicate()] * self.mesh.ndim
        return self.head(DTensor.from_local(x, self.mesh, replicated, run_check=False)).to_local()


def _distribute(model: Net, mesh, tp: str | None) -> None:
    """Every parameter a DTensor on the whole mesh: Replicate() but the TP slices on ``tp``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    def placements(fqn: str):
        out = [Replicate()] * mesh.ndim
        if tp is not None:
            i = mesh.mesh_dim_names.index(tp)
            if fqn.startswith("up."):
                out[i] = Shard(0)
            elif fqn == "down.weight":
                out[i] = Shard(1)
        return out

    def partition(name, module, mesh_):
        for attr, p in list(module.named_parameters(recurse=False)):
            fqn = f"{name.split('.')[-1]}.{attr}" if name else attr
            module.register_parameter(attr, nn.Parameter(distribute_tensor(p.data, mesh_, placements(fqn))))

    for block in model.blocks:
        distribute_module(block, mesh, partition)
    distribute_module(model.head, mesh, partition)


def _train(impl: str, case: str, param_dtype: torch.dtype | None = None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardwise

    _, shape, names, shard, replicate = MESHES[case]
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    mesh = init_device_mesh(device().type, shape, mesh_dim_names=names)
    tp = "tp" if "tp" in names else None
    torch.manual_seed(0)
    model = Net(mesh).to(device())
    _distribute(model, mesh, tp)
    # torch caches DTensor specs by mesh equality: the parameters may sit on an equal mesh made earlier in this
    # process, and FSDP2 wants the very object
    mesh = next(model.parameters()).device_mesh
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims, mp_policy=policy)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data_rank = dist.get_rank() // (mesh.size(names.index("tp")) if tp else 1)  # TP ranks read the same rows
    losses, norms = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + data_rank)
        x = torch.randn(BATCH, DIM, generator=g).to(device())
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
        norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        opt.step()
        opt.zero_grad()
    faces = {n: (p.device_mesh.mesh_dim_names, p.device_mesh.mesh.tolist(), [str(x) for x in p.placements])
             for n, p in model.named_parameters()}
    full = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": full, "faces": faces}


@pytest.mark.parametrize("world,case", [(w, c) for c, (w, *_) in MESHES.items()])
def test_spmd_mesh_trains_as_fsdp2(world, case):
    theirs = run_distributed(_train, world, "fsdp2", case)
    ours = run_distributed(_train, world, "shardwise", case)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(b["norms"]), torch.tensor(a["norms"]), rtol=RTOL, atol=0)
        assert b["faces"] == a["faces"]
        assert b["params"].keys() == a["params"].keys()
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=RTOL, atol=1e-7, msg=name)


def _refusals(impl: str) -> dict:
    """What FSDP2 refuses with an SPMD mesh, tried on both: each case's error type and message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardwise

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    mesh = init_device_mesh(device().type, (1, 1), mesh_dim_names=("dp_shard", "tp"))

    def model(plain=False, placements=None):
        net = Net(mesh).to(device())
        _distribute(net, mesh, "tp")
        net_mesh = next(net.parameters()).device_mesh
        if plain:
            net.head.weight = nn.Parameter(torch.ones(DIM, DIM, device=device()))
        if placements is not None:
            net.head.weight = nn.Parameter(distribute_tensor(torch.ones(DIM, DIM, device=device()), net_mesh,
                                                             placements))
        return net, net_mesh

    cases = {
        "plain_tensor": lambda: (model(plain=True), DataParallelMeshDims(shard="dp_shard"), {}),
        "shard_on_dp_dim": lambda: (model(placements=[Shard(0), Shard(0)]), DataParallelMeshDims(shard="dp_shard"), {}),
        "unknown_dim": lambda: (model(), DataParallelMeshDims(shard="fsdp"), {}),
        "int_reshard": lambda: (model(), DataParallelMeshDims(shard="dp_shard"), {"reshard_after_forward": 2}),
    }
    out = {}
    for name, make in cases.items():
        (net, net_mesh), dims, kwargs = make()
        try:
            fully_shard(net, mesh=net_mesh, dp_mesh_dims=dims, **kwargs)
            out[name] = ("accepted", "")
        except (ValueError, TypeError, NotImplementedError) as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_spmd_mesh_refusals_match_fsdp2():
    theirs = run_distributed(_refusals, 1, "fsdp2")[0]
    ours = run_distributed(_refusals, 1, "shardwise")[0]
    for case in theirs:
        assert theirs[case][0] != "accepted", case
        assert ours[case][0] == theirs[case][0], (case, ours[case], theirs[case])
    assert "parameter 'head.weight' is a plain tensor" in ours["plain_tensor"][1]
    assert "parameter 'head.weight' has S(0) on the data-parallel dim 'dp_shard'" in ours["shard_on_dp_dim"][1]
    assert "mesh dim 'fsdp'" in ours["unknown_dim"][1]
    assert "reshard_after_forward=2" in ours["int_reshard"][1]


def _max_diff(a: dict, b: dict) -> dict:
    return {"losses": (torch.tensor(a["losses"]) - torch.tensor(b["losses"])).abs().max().item(),
            "params": max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])}


@pytest.mark.parametrize("world,case", [(2, "tp_2")])
def test_spmd_mesh_bf16_within_fsdp2_bf16_spread(world, case):
    """bf16 compute (fp32 reduction) with TP DTensors: shardwise's results differ from FSDP2's bf16 ones by no
    more than those differ from FSDP2's fp32 run (bf16 rounding, in another order, is all that may differ)."""
    theirs = run_distributed(_train, world, "fsdp2", case, torch.bfloat16)[0]
    ours = run_distributed(_train, world, "shardwise", case, torch.bfloat16)[0]
    exact = run_distributed(_train, world, "fsdp2", case)[0]
    spread, diff = _max_diff(theirs, exact), _max_diff(ours, theirs)
    assert all(v > 0 for v in spread.values()), spread  # bf16 did round
    for key in spread:
        assert diff[key] <= spread[key], (key, diff, spread)
    assert ours["faces"] == theirs["faces"]
