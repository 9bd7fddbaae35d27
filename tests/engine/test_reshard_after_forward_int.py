"""``reshard_after_forward=k`` (an int) as torch FSDP2's: after forward each unit keeps its weights sharded over
groups of ``k`` consecutive ranks, and backward gathers over those ``k`` ranks only.

Each case runs FSDP2 and shardwise with the same code in the same test: losses and final parameters agree to
rtol 1e-5 over a few steps, every all-gather has the same group size as FSDP2's (forward: the whole shard
group; backward: ``k`` ranks), between forward and backward the modules hold FSDP2's post-forward parameters
(DTensors on the ``(-1, k)`` mesh, ``(Replicate(), Shard(0))``, the same local rows) and the weights kept are
``1/k`` of the unit's. ``1`` and the shard size are FSDP2's ``False`` and ``True``; other ints are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.helpers.counting import GatherGroupSizes
from tests.helpers.distributed import device, run_distributed

RTOL = 1e-5
STEPS = 3
DIM = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)  # 16 rows: 4 per rank over 4, 8 per rank over k=2
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.gain = nn.Parameter(torch.ones(6))  # 6 rows: uneven over 4 ranks (slots padded)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.gain[:1]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(impl: str, k, hsdp: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    import shardwise

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    world = dist.get_world_size()
    shape, names = ((2, world // 2), ("dp_replicate", "dp_shard")) if hsdp else ((world,), ("dp_shard",))
    mesh = init_device_mesh(device().type, shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = Net().to(device())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=k)
    fully_shard(model, mesh=mesh)  # the root: FSDP2's default (kept after forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sizes = GatherGroupSizes(impl)
    losses, forward_sizes, backward_sizes, faces = [], [], [], []
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            x = torch.randn(4, DIM, generator=g).to(device())
            loss = model(x).pow(2).mean()
            forward_sizes.append(sizes.take())
            face = {}
            for name, p in model.blocks[0].named_parameters():
                if isinstance(p, DTensor):
                    face[name] = (p.device_mesh.mesh.tolist(), [str(q) for q in p.placements], p.to_local().detach().clone())
                else:
                    face[name] = (type(p).__name__,)
            faces.append(face)
            loss.backward()
            backward_sizes.append(sizes.take())
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    finally:
        sizes.close()
    full = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "params": full, "forward": forward_sizes, "backward": backward_sizes,
            "faces": faces}


def _assert_same(theirs: list, ours: list, uneven: tuple = ("gain",), faces: bool = True) -> None:
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=RTOL, atol=0)
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=RTOL, atol=1e-7, msg=name)
        assert b["forward"] == a["forward"] and b["backward"] == a["backward"], (a["forward"], a["backward"],
                                                                               b["forward"], b["backward"])
        for fa, fb in zip(a["faces"] if faces else (), b["faces"]):
            for name in fa:
                if name in uneven:  # FSDP2's post-forward view of uneven rows shows padding: not compared
                    continue
                assert fb[name][:2] == fa[name][:2], (name, fa[name][:2], fb[name][:2])
                if len(fa[name]) > 2:
                    torch.testing.assert_close(fb[name][2], fa[name][2], rtol=RTOL, atol=0, msg=name)


@pytest.mark.parametrize("world,hsdp", [(4, False), (4, True)])
def test_int_reshards_to_smaller_group_as_fsdp2(world, hsdp):
    """World 4, k = 2: FSDP over 4 (backward gathers over pairs); HSDP 2 x 2 with k = 2 is the shard size
    itself, FSDP2's True (backward gathers over the 2 shard ranks)."""
    theirs = run_distributed(_train, world, "fsdp2", 2, hsdp)
    ours = run_distributed(_train, world, "shardwise", 2, hsdp)
    _assert_same(theirs, ours)
    if not hsdp:  # the two blocks' groups regather over 2 ranks in backward; forward gathers over all 4
        assert set(ours[0]["backward"][0]) == {2} and len(ours[0]["backward"][0]) == 2
        assert set(ours[0]["forward"][0]) == {4}
        face = ours[0]["faces"][0]["up.weight"]
        assert face[1] == ["R", "S(0)"] and face[0] == [[0, 1], [2, 3]]


def _kept_fraction(k: int) -> tuple:
    """Bytes the blocks keep between forward and backward against their gathered weights' bytes."""
    from shardwise.engine.model_ops import sharded_state

    model = Net().to(device())
    import shardwise

    for block in model.blocks:
        shardwise.fully_shard(block, reshard_after_forward=k)
    shardwise.fully_shard(model)
    loss = model(torch.randn(4, DIM, device=device())).pow(2).mean()
    units = [u for u in sharded_state(model).units if u.post_forward is not None]
    kept = sum(u.post_forward.kept_bytes() for u in units)
    gathered_at_rest = sum(g.storage_bytes_unsharded for u in units for g in u.groups)
    full = sum(g.unsharded.numel() * g.unsharded.element_size() for u in units for g in u.groups)
    loss.backward()
    return kept, gathered_at_rest, full


@pytest.mark.parametrize("world", [4])
def test_int_keeps_one_kth_between_forward_and_backward(world):
    kept, gathered, full = run_distributed(_kept_fraction, world, 2)[0]
    assert gathered == 0  # the gathered weights are freed
    # each parameter's gathered region is 1/k-split; the slots' alignment padding is all that is not kept
    assert full / 2 - 64 * 4 <= kept <= full / 2, (kept, full)


@pytest.mark.parametrize("world", [1, 2])
def test_trivial_ints_are_fsdp2_bools(world):
    """``1`` is FSDP2's ``False`` (no gather in backward) and the shard size its ``True``. (What the modules
    hold after a forward that keeps the weights differs, as for ``False`` itself: FSDP2 the gathered
    parameters, shardwise the sharded ones; not compared here.)"""
    for k in (1, world):
        theirs = run_distributed(_train, world, "fsdp2", k)
        ours = run_distributed(_train, world, "shardwise", k)
        _assert_same(theirs, ours, faces=False)


def _refused(impl: str, k) -> str:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardwise

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    try:
        fully_shard(Net().to(device()), reshard_after_forward=k)
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_non_divisors_are_refused_as_fsdp2():
    for k in (3, 0, 8):
        theirs = run_distributed(_refused, 2, "fsdp2", k)[0]
        ours = run_distributed(_refused, 2, "shardwise", k)[0]
        assert theirs.startswith("ValueError") and ours.startswith("ValueError"), (theirs, ours)
        assert f"reshard_after_forward={k}" in ours and "divisor of the shard mesh dim's size 2" in ours
