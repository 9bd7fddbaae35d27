"""Which parameters get ``.grad``, and what accumulates unsynced gradients, as in torch's FSDP2.

Each case runs torch's FSDP2 and shardwise with the same code in the same test. Unused parameters: a
parameter no rank gave a gradient keeps ``.grad is None`` (FSDP2 skips it), so AdamW's weight decay and
momentum leave it alone; the ``None`` pattern is compared at every step and the parameters after the steps
(fp32, rtol 1e-5). Unsynced accumulation: with ``param_dtype=bf16, reduce_dtype=fp32`` FSDP2 accumulates
gradients held back by ``set_requires_gradient_sync(False)`` in fp32 (``reduce_dtype``); shardwise does the
same additions in the same order, so gradients and parameters are compared bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise.engine.model_ops import hand_out_unused_grads
from tests.helpers.distributed import device, run_distributed

DIM, CLASSES, ROWS = 16, 5, 6


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)  # a parameter of the unit that some forwards skip

    def forward(self, x, use_extra: bool):
        y = torch.tanh(self.main(x))
        return y + self.extra(y) if use_extra else y


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.side = nn.Linear(DIM, DIM)  # root-owned, used by some micro-batches only
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def hidden(self, x, plan: dict):
        h = self.embed(x)
        if plan.get("side"):
            h = h + self.side(h)
        for i, block in enumerate(self.blocks):
            if i not in plan.get("skip", ()):  # a partial forward: the whole unit skipped
                h = block(h, use_extra=i in plan.get("extra", ()))
        return self.norm(h)

    def forward(self, x, plan: dict, skip_head: bool = False):  # skip_head: torchtitan's _skip_lm_head
        h = self.hidden(x, plan)
        return h if skip_head else self.head(h)


def _wrap(impl: str, model: _Net, mp_policy, unused_params: bool | None, head_unit: bool, hsdp: bool,
          strategy: str | None) -> None:
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    world = dist.get_world_size()
    mesh = (init_device_mesh(device().type, (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh(device().type, (world,)))
    kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    if strategy is not None and impl == "shardwise":  # shardwise's ZeRO stages: the same numbers as FSDP2's
        kwargs["strategy"] = strategy
    for block in model.blocks:
        fully_shard(block, **kwargs)
    if head_unit:  # torchtitan's [norm, lm_head] unit
        fully_shard([model.norm, model.head], **kwargs)
    fully_shard(model, **kwargs)
    if unused_params == "face":  # the Megatron face's choice (shardwise only): FSDP2's True for units that ran
        hand_out_unused_grads(model) if impl == "shardwise" else model.set_reduce_scatter_unused_params(True)
    elif unused_params is not None:
        model.set_reduce_scatter_unused_params(unused_params)


def _data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    x = torch.randn(ROWS, DIM, generator=gen)
    return x.to(device()), torch.randint(0, CLASSES, (ROWS,), generator=gen).to(device())


def _chunked_backward(model: _Net, x, y, plan: dict, chunks: int, micro_batches: int) -> None:
    """torchtitan's ChunkedLossWrapper: the head (and its loss) on each chunk of the hidden states, a backward
    per chunk with the head unit's gradient sync off but for the last chunk, then the decoder's backward."""
    hidden = model(x, plan, skip_head=True)
    pieces = [c.detach().requires_grad_(True) for c in hidden.chunk(chunks)]
    unit = model.norm  # the [norm, head] unit
    unit.set_reshard_after_forward(False)
    unit.set_reshard_after_backward(False)
    unit.set_requires_gradient_sync(False, recurse=False)
    unit.unshard()
    grads = []
    for i, piece in enumerate(pieces):
        if i == chunks - 1:
            unit.set_requires_gradient_sync(True, recurse=False)
        loss = F.cross_entropy(model.head(piece).float(), y.chunk(chunks)[i], reduction="sum") / (ROWS * micro_batches)
        loss.backward()
        grads.append(piece.grad)
    unit.set_reshard_after_forward(True)
    unit.set_reshard_after_backward(True)
    unit.reshard()
    hidden.backward(torch.cat(grads))


def _train(impl: str, plans: list, mp_policy=None, unused_params=None, chunks: int = 0, accumulate: str = "fsdp2",
           weight_decay: float = 0.1, hsdp: bool = False, strategy: str | None = None) -> dict:
    """Steps of AdamW over micro-batches (``plans[step][micro]``: what each forward uses); the last micro-batch of
    a step syncs. Returns, per step, which ``.grad`` are ``None`` and the full gradients; the final parameters."""
    torch.manual_seed(0)
    model = _Net().to(device())
    _wrap(impl, model, mp_policy, unused_params, head_unit=chunks > 0, hsdp=hsdp, strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    names = [n for n, _ in model.named_parameters()]
    nones, grads = [], []
    for step, micro_plans in enumerate(plans):
        for micro, plan in enumerate(micro_plans):
            last = micro == len(micro_plans) - 1
            if accumulate == "fsdp2":
                model.set_requires_gradient_sync(last)
            x, y = _data(step, micro)
            with model.no_sync() if accumulate == "no_sync" and not last else contextlib.nullcontext():
                if chunks:
                    _chunked_backward(model, x, y, plan, chunks, len(micro_plans))
                else:
                    (F.cross_entropy(model(x, plan).float(), y) / len(micro_plans)).backward()
        nones.append([p.grad is None for p in model.parameters()])
        grads.append({n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    return {"names": names, "nones": nones, "grads": grads, "params": params}


# step 0: `side` used in the first micro-batch only, blocks.1.extra in the second only;
# step 1: blocks.0.extra and `side` used nowhere, block 1 skipped in the first micro-batch;
# step 2: block 1 skipped in every micro-batch (a partial forward: the unit never runs)
PLANS = [
    [{"side": True, "extra": (0,)}, {"extra": (0, 1)}],
    [{"extra": (1,), "skip": (1,)}, {"extra": (1,)}],
    [{"side": True, "extra": (0,), "skip": (1,)}, {"extra": (0,), "skip": (1,)}],
]


def _assert_same_grads(ref: dict, got: dict, exact: bool) -> None:
    assert got["names"] == ref["names"]
    assert got["nones"] == ref["nones"]
    for step, (r, g) in enumerate(zip(ref["grads"], got["grads"])):
        assert g.keys() == r.keys(), step
        for name in r:
            if exact:
                assert torch.equal(g[name], r[name]), (step, name, (g[name] - r[name]).abs().max().item())
            else:
                torch.testing.assert_close(g[name], r[name], rtol=1e-5, atol=1e-7, msg=f"step {step} {name}")
    for name in ref["params"]:
        if exact:
            assert torch.equal(got["params"][name], ref["params"][name]), name
        else:
            torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("world", [1, 2])
def test_unused_parameters_keep_no_grad_as_fsdp2(world):
    """A parameter unused in every micro-batch of a step (within a used unit, root-owned, or a whole skipped
    unit) has ``.grad is None`` as in FSDP2, one used in one micro-batch only has its gradient; AdamW with
    weight decay then moves exactly the parameters FSDP2 moves."""
    ref = run_distributed(_train, world, "fsdp2", PLANS)[0]
    got = run_distributed(_train, world, "shardwise", PLANS)[0]
    assert any(any(n) for n in ref["nones"]) and not all(all(n) for n in ref["nones"])  # some are None
    _assert_same_grads(ref, got, exact=False)


@pytest.mark.parametrize("strategy", [None, "optim"])
def test_unused_parameters_under_shardwise_no_sync(strategy):
    """``model.no_sync()`` (reduce each micro-batch, finalize at the last; at ZeRO-1 the gradients stay Partial
    until then) installs the same ``.grad`` set as FSDP2's ``set_requires_gradient_sync`` accumulation, with the
    same values."""
    ref = run_distributed(_train, 2, "fsdp2", PLANS)[0]
    got = run_distributed(_train, 2, "shardwise", PLANS, accumulate="no_sync", strategy=strategy)[0]
    _assert_same_grads(ref, got, exact=False)


def test_unused_parameters_under_hsdp():
    """A 2-D mesh (HSDP: replicas all-reduced): the ranks agree over the replica axis."""
    ref = run_distributed(_train, 2, "fsdp2", PLANS, hsdp=True)[0]
    got = run_distributed(_train, 2, "shardwise", PLANS, hsdp=True)[0]
    _assert_same_grads(ref, got, exact=False)


def test_reduce_scatter_unused_params_true_gives_every_parameter_a_grad():
    """FSDP2's ``set_reduce_scatter_unused_params(True)``: zeros for every unused parameter, even those of a
    unit that never ran (block 1 at step 2), on both."""
    ref = run_distributed(_train, 2, "fsdp2", PLANS, unused_params=True)[0]
    got = run_distributed(_train, 2, "shardwise", PLANS, unused_params=True)[0]
    assert not any(any(n) for n in got["nones"])
    _assert_same_grads(ref, got, exact=False)


def test_hand_out_unused_grads_gives_zeros_where_unused():
    """``model_ops.hand_out_unused_grads`` (the Megatron face: its optimizer reads every parameter's slot): every
    parameter of the units that ran gets ``.grad``, zeros where unused, as FSDP2's
    ``set_reduce_scatter_unused_params(True)`` gives them."""
    ref = run_distributed(_train, 1, "fsdp2", PLANS[:2], unused_params="face")[0]
    got = run_distributed(_train, 1, "shardwise", PLANS[:2], unused_params="face")[0]
    assert not any(any(n) for n in got["nones"])
    _assert_same_grads(ref, got, exact=False)


def _disagreeing_plans() -> list:
    """Rank 0 uses `side` and blocks.1.extra, rank 1 does not: the ranks disagree on what is unused."""
    mine = {"side": True, "extra": (0, 1)} if dist.get_rank() == 0 else {"extra": (0,)}
    return [[mine, {"extra": (0,)}], [{"extra": (0,)}]]


def _train_disagreeing(impl: str, unused_params) -> dict:
    return _train(impl, _disagreeing_plans(), unused_params=unused_params)


def test_ranks_that_disagree_all_install_what_some_rank_used():
    """FSDP2 reduce-scatters only the parameters this rank has gradients for, so ranks that used different
    parameters run reductions of different sizes (it needs ``set_reduce_scatter_unused_params(True)``).
    shardwise reduces every parameter and installs ``.grad`` on every rank for each parameter some rank used:
    the same set on every rank, and the values FSDP2 reduces with ``set_reduce_scatter_unused_params(True)``
    (the mean with the other ranks' zeros); what no rank used stays ``None``."""
    ref = run_distributed(_train_disagreeing, 2, "fsdp2", True)
    got = run_distributed(_train_disagreeing, 2, "shardwise", None)
    assert got[0]["nones"] == got[1]["nones"]  # every rank installs the same set
    names = got[0]["names"]
    step0 = dict(zip(names, got[0]["nones"][0]))
    assert not step0["side.weight"] and not step0["blocks.1.extra.weight"]  # rank 0 used them
    step1 = dict(zip(names, got[0]["nones"][1]))
    assert step1["side.weight"] and step1["blocks.1.extra.weight"]  # nobody did
    for step, (r, g) in enumerate(zip(ref[0]["grads"], got[0]["grads"])):
        for name, grad in r.items():
            if name in g:
                torch.testing.assert_close(g[name], grad, rtol=1e-5, atol=1e-7, msg=f"step {step} {name}")
            else:  # FSDP2's zeros where shardwise leaves None
                assert not grad.any(), (step, name)


BF16_PLANS = [[{"extra": (0, 1), "side": True}] * 4] * 3  # 4 micro-batches, 3 steps, everything used


@pytest.mark.parametrize("world,strategy", [(1, None), (2, None), (2, "optim")])
def test_bf16_unsynced_accumulation_is_fsdp2s_bit_for_bit(world, strategy):
    """``param_dtype=bf16, reduce_dtype=fp32``, 4 micro-batches with ``set_requires_gradient_sync(False)`` for
    the first 3: the gradients held back accumulate in fp32 as FSDP2's do; gradients at every step and the
    parameters after 3 AdamW steps are FSDP2's bit for bit (shardwise's ZeRO-1 too, whose gradient level is
    the unsharded one)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = run_distributed(_train, world, "fsdp2", BF16_PLANS, mp_policy=policy)[0]
    got = run_distributed(_train, world, "shardwise", BF16_PLANS, mp_policy=policy, strategy=strategy)[0]
    _assert_same_grads(ref, got, exact=True)


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_chunked_loss_accumulation_is_fsdp2s_bit_for_bit(world):
    """torchtitan's chunked loss in bf16: the head unit's backward runs once per chunk with its gradient sync
    off but for the last chunk, over 2 micro-batches of which the first does not sync (and some parameters go
    unused): gradients and parameters are FSDP2's bit for bit, the ``None`` pattern too."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plans = [[{"extra": (0, 1), "side": True}, {"extra": (0, 1)}], [{"extra": (1,)}, {"extra": (1,)}]]
    ref = run_distributed(_train, world, "fsdp2", plans, mp_policy=policy, chunks=3)[0]
    got = run_distributed(_train, world, "shardwise", plans, mp_policy=policy, chunks=3)[0]
    _assert_same_grads(ref, got, exact=True)
