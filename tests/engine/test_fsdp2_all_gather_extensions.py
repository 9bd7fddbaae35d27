"""FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) called as FSDP2 calls them.

Two tensor subclasses of our own define the hooks: ``Bf16Travel`` (an fp32 weight that travels in bf16,
padding its piece itself where the rows split unevenly, FSDP2's rule) and ``RowScaledInt8`` (two inputs of
two dtypes, int8 rows and their fp32 scales, with metadata: FSDP2 gathers them as bytes). The same model is
trained by torch's FSDP2 and by shardwise in the same test on 1, 2 and 4 gloo processes: the losses, the
gradients, the parameters (the subclass's own data), the state dict's full tensors, how many times each
hook ran (first calls against ``out=`` refills) and the inner tensors freed at reshard must agree, bit for bit on the CPU: shardwise runs the
hooks, the collectives and the reductions FSDP2 runs, in the same dtypes and order.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from tests.helpers.distributed import device, run_distributed

CALLS: dict[str, int] = {}
INNER: list[torch.Tensor] = []  # every inner tensor a post-hook handed back to be freed at reshard


class _Wrapper(torch.Tensor):
    """A wrapper subclass over one plain tensor ``_data``: every op runs on the data and rewraps its outputs."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data  # noqa: E731
        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, size, stride):
        return cls(inner["_data"])


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def _refill(out: torch.Tensor, value: torch.Tensor) -> None:
    """``out=``: the parameter built at the first gather (its real rows: the gathered value may be padded)."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
        out.copy_(value[: out.shape[0]])


class Bf16Travel(_Wrapper):
    """Gathered in bf16 (one input, padded to the padded piece's rows), upcast to ``param_dtype`` after."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _count("bf16.pre")
        _count(f"mesh of {mesh.ndim} dim, {mesh.size()} ranks")
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        assert metadata is None
        (gathered,) = outputs
        if out is not None:
            _count("bf16.post_out")
            _refill(out, gathered)
            return None
        _count("bf16.post")
        unsharded = gathered.to(param_dtype)
        inner = (gathered,) if unsharded is gathered else (gathered, unsharded)
        INNER.extend(inner)
        return unsharded, inner


class RowScaledInt8(_Wrapper):
    """Gathered as int8 rows and their fp32 scales (two inputs of two dtypes), dequantized after."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _count("int8.pre")
        data = self._data
        scale = data.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 127
        return ((data / scale).round().to(torch.int8), scale), ("rows", tuple(outer_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        q, scale = outputs
        assert q.dtype == torch.int8 and scale.dtype == torch.float32 and metadata[0] == "rows"
        assert q.shape == torch.Size(metadata[1]) and scale.shape == (metadata[1][0], 1)
        value = (q.to(torch.float32) * scale).to(param_dtype)
        if out is not None:
            _count("int8.post_out")
            _refill(out, value)
            return None
        _count("int8.post")
        INNER.append(value)
        return value, (value,)


class _Net(nn.Module):
    def __init__(self, int8: bool):
        super().__init__()
        self.up = nn.Linear(8, 5)  # 5 rows: uneven over 2 ranks (padded by the pre-hook)
        self.mid = nn.Linear(5, 6, bias=False)
        self.out = nn.Linear(6, 3)
        self.up.weight = nn.Parameter(Bf16Travel(self.up.weight.detach().clone()))
        if int8:
            self.mid.weight = nn.Parameter(RowScaledInt8(self.mid.weight.detach().clone()))

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.up(x)))))


def _local(t: torch.Tensor) -> torch.Tensor:
    local = t._local_tensor
    return (local._data if isinstance(local, _Wrapper) else local).detach().float().cpu().clone()


def _full_values(int8: bool) -> dict[str, torch.Tensor]:
    """The model's initial values as plain full tensors (the subclasses' data)."""
    torch.manual_seed(0)
    return {n: (p._data if isinstance(p, _Wrapper) else p).detach().clone() for n, p in _Net(int8).named_parameters()}


def _load(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Each sharded parameter's rows of ``values`` (a DTensor copy: the subclass's own ops take them in)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(values[name].to(device()), param.device_mesh, param.placements))


def _train(impl: str, int8: bool = True, reshard_after_forward: bool = True, mp: bool = False,
           hsdp: tuple[int, int] | None = None, steps: int = 3, meta: bool = False) -> dict:
    CALLS.clear()
    INNER.clear()
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    world = dist.get_world_size()
    mesh = (init_device_mesh(device().type, hsdp, mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh(device().type, (world,)))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = _Net(int8)
    model = model if meta else model.to(device())
    fully_shard(model.up, **kwargs)
    fully_shard(model.mid, **kwargs)
    fully_shard(model, **kwargs)
    if meta:  # FSDP2's meta-device flow: storage, then values written into the shards
        model.to_empty(device=device())
        _load(model, _full_values(int8))
    kinds = {n: type(p._local_tensor).__name__ for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = model(torch.randn(4, 8, generator=gen).to(device())).float().square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: _local(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    freed = all(t.untyped_storage().size() == 0 for t in INNER)  # every unit resharded after its backward
    params = {n: _local(p) for n, p in model.named_parameters()}
    state = {}  # the state dict's full tensors (torch's DTensor gather of the subclass pieces)
    for name, value in model.state_dict().items():
        full = value.full_tensor()
        state[name] = (type(full).__name__, (full._data if isinstance(full, _Wrapper) else full).detach().cpu())
    return {"losses": losses, "grads": grads, "params": params, "calls": dict(CALLS), "kinds": kinds,
            "freed": freed, "inner": len(INNER), "state": state}


def _assert_same(ref: dict, got: dict) -> None:
    rtol = atol = 0  # bit for bit
    assert got["kinds"] == ref["kinds"]
    assert got["calls"] == ref["calls"]
    assert got["inner"] == ref["inner"] and ref["freed"] and got["freed"]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=rtol, atol=atol)
    for step, (r, g) in enumerate(zip(ref["grads"], got["grads"])):
        for name in r:
            torch.testing.assert_close(g[name], r[name], rtol=rtol, atol=atol, msg=f"step {step} grad {name}")
    for name in ref["params"]:
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=rtol, atol=atol, msg=name)
    assert got["state"].keys() == ref["state"].keys()
    for name, (kind, value) in ref["state"].items():
        assert got["state"][name][0] == kind, name
        torch.testing.assert_close(got["state"][name][1], value, rtol=rtol, atol=atol, msg=f"state dict {name}")


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_one_process_hooks_as_fsdp2(reshard_after_forward):
    """One rank (FSDP2 gathers a single input there): the bf16-travel weight, a plain bias and head."""
    ref = run_distributed(_train, 1, "fsdp2", int8=False, reshard_after_forward=reshard_after_forward)[0]
    got = run_distributed(_train, 1, "shardwise", int8=False, reshard_after_forward=reshard_after_forward)[0]
    assert ref["kinds"]["up.weight"] == "Bf16Travel" and ref["calls"]["bf16.post_out"] > 0
    _assert_same(ref, got)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_two_processes_hooks_as_fsdp2(reshard_after_forward):
    """Two ranks: an unevenly split weight padded by its pre-hook, and two inputs of two dtypes (bytes)."""
    ref = run_distributed(_train, 2, "fsdp2", reshard_after_forward=reshard_after_forward)
    got = run_distributed(_train, 2, "shardwise", reshard_after_forward=reshard_after_forward)
    assert ref[0]["kinds"]["mid.weight"] == "RowScaledInt8"
    for r, g in zip(ref, got):
        _assert_same(r, g)


def test_param_dtype_reaches_the_post_hook():
    """``MixedPrecisionPolicy(param_dtype=bf16)``: the post-hooks build bf16 parameters (``param_dtype``) and
    gradients reduce in bf16 on both; compared to a bf16 ulp of the values."""
    ref = run_distributed(_train, 2, "fsdp2", mp=True)
    got = run_distributed(_train, 2, "shardwise", mp=True)
    for r, g in zip(ref, got):
        _assert_same(r, g)


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_hsdp_hooks_get_the_shard_mesh(shape):
    """A 2-D mesh (replicas over dim 0, all-reduced): the hooks get the 1-D shard mesh, as FSDP2's. (A shard
    dim of one rank: FSDP2 gathers one input there, so only the one-input subclass.)"""
    ref = run_distributed(_train, 2, "fsdp2", hsdp=shape, int8=shape[1] > 1, steps=2)
    got = run_distributed(_train, 2, "shardwise", hsdp=shape, int8=shape[1] > 1, steps=2)
    assert ref[0]["calls"][f"mesh of 1 dim, {shape[1]} ranks"] > 0
    for r, g in zip(ref, got):
        _assert_same(r, g)


def test_reshard_after_forward_int_reshards_them_fully():
    """``reshard_after_forward=2`` over 4 ranks (FSDP2 raises for such parameters): the plain parameters keep
    their parts over 2 ranks, the hooked ones reshard fully and gather through their hooks again in backward,
    so training and hook calls are FSDP2's with ``reshard_after_forward=True``."""
    ref = run_distributed(_train, 4, "fsdp2", int8=False, steps=2)  # (6 rows do not split evenly over 4: no int8)
    got = run_distributed(_train, 4, "shardwise", int8=False, reshard_after_forward=2, steps=2)
    for r, g in zip(ref, got):
        _assert_same(r, g)


def test_meta_device_build_trains_as_a_direct_one():
    """Built on the meta device, ``to_empty`` and the values copied in: the subclass pieces get storage and
    values on both, and training matches FSDP2's and the direct build's."""
    direct = run_distributed(_train, 2, "shardwise", steps=2)
    ref = run_distributed(_train, 2, "fsdp2", meta=True, steps=2)
    got = run_distributed(_train, 2, "shardwise", meta=True, steps=2)
    for r, g, d in zip(ref, got, direct):
        _assert_same(r, g)
        _assert_same(d, g)


def _patched(impl: str, patch_bias: bool = True) -> dict:
    """torch's own trick: hooks patched onto the sharded parameters' local tensors (plain) after fully_shard,
    before the first forward (FSDP2 reads them then)."""
    CALLS.clear()
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4)).to(device())
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        _count("patched.pre")
        return (self.to(torch.bfloat16),), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            _count("patched.post_out")
            return _refill(out, gathered)
        _count("patched.post")
        unsharded = gathered.to(param_dtype)
        return unsharded, (gathered, unsharded)

    for name, param in model.named_parameters():
        if patch_bias or "weight" in name:
            local = param._local_tensor
            local.fsdp_pre_all_gather, local.fsdp_post_all_gather = pre.__get__(local), post.__get__(local)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        try:
            loss = model(torch.randn(4, 8, generator=gen).to(device())).square().mean()
        except NotImplementedError as error:
            return {"refused": str(error)}
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "calls": dict(CALLS), "params": {n: _local(p) for n, p in model.named_parameters()}}


def test_hooks_patched_onto_local_tensors_as_fsdp2():
    """Hooks set as instance methods on the sharded locals (torch's tests do it) are read at the first forward,
    as FSDP2 reads them; every parameter of a unit's group or none (shardwise gathers the group together)."""
    ref = run_distributed(_patched, 2, "fsdp2")
    got = run_distributed(_patched, 2, "shardwise")
    assert ref[0]["calls"]["patched.post_out"] > 0
    for r, g in zip(ref, got):
        assert g["calls"] == r["calls"]
        torch.testing.assert_close(g["losses"], r["losses"], rtol=0, atol=0)
        torch.testing.assert_close(g["params"], r["params"], rtol=0, atol=0)
    refused = run_distributed(_patched, 1, "shardwise", patch_bias=False)[0]["refused"]
    assert "['weight'] but not of ['bias']" in refused, refused


def _refused(**kwargs) -> str:
    model = _Net(int8=False)
    try:
        shardwise.fully_shard(model, **kwargs)
    except NotImplementedError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("kwargs", [{"strategy": "optim_grads"}, {"sync_module_states": True},
                                    {"offload_policy": shardwise.OffloadPolicy(fraction=1.0)}])
def test_placements_not_built_are_refused_by_name(kwargs):
    message = run_distributed(_refused, 1, **kwargs)[0]
    assert "'up.weight'" in message and "fsdp_pre_all_gather" in message, message


def _torchao_float8(impl: str, mp: bool) -> dict:
    """torchao's float8 training with FSDP2's float8 all-gather (``WeightWithDynamicFloat8CastTensor``'s hooks)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 16, bias=False)).to(device())
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mp else {}
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    kinds = {n: type(p._local_tensor).__name__ for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=gen).to(device(), torch.bfloat16 if mp else torch.float32)
        loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    weights = {n: p._local_tensor._tensor.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"kinds": kinds, "losses": losses, "weights": weights}


@pytest.mark.parametrize("mp", [False, True])
def test_torchao_float8_all_gather_as_fsdp2(mp):
    """The real user of the hooks: torchao's float8 weights gathered as float8 through them, one rank (gloo cannot
    gather float8 bytes; scripts/fsdp2_extensions_check.py runs two GPUs): bit for bit FSDP2's."""
    ref = run_distributed(_torchao_float8, 1, "fsdp2", mp)[0]
    got = run_distributed(_torchao_float8, 1, "shardwise", mp)[0]
    assert set(ref["kinds"].values()) == {"WeightWithDynamicFloat8CastTensor"} and got["kinds"] == ref["kinds"]
    assert got["losses"] == ref["losses"]
    for name, value in ref["weights"].items():
        assert torch.equal(got["weights"][name], value), name
