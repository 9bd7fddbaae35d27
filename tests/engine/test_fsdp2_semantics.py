"""``shardwise.fully_shard`` as torch FSDP2's ``fully_shard``: the same calls, the same numbers, the same methods.

Each case runs torch's FSDP2 and shardwise with the very same wrapping code in the same test and compares
losses, gradient norms and final parameters (fp32: rtol 1e-5). The clients' own code (torchtitan,
Accelerate, torch's pipelining) is driven in ``tests/clients/``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.engine.sharded_module import ShardedModule
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import TinyConfig, TinyLM, batch

RTOL = 1e-5


def _wrap_fsdp2_style(fully_shard, model: TinyLM, mesh, **kwargs) -> None:
    """FSDP2's idiom: each block, then the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def _train(which: str, steps: int = 3, mesh_shape=None, divide_factor=None, accumulate: int = 1, mesh_names=None,
           **kwargs) -> dict:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = TinyLM(TinyConfig()).to(device())
    world = dist.get_world_size()
    mesh = init_device_mesh(device().type, mesh_shape or (world,), mesh_dim_names=mesh_names)
    _wrap_fsdp2_style(fully_shard, model, mesh, **kwargs)
    if divide_factor is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(divide_factor)
                m.set_force_sum_reduction_for_comms(True)  # FSDP2's PREMUL_SUM is NCCL-only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            tokens, targets = (t.to(device()) for t in batch(100 * step + 10 * micro + dist.get_rank(), 4,
                                                             TinyConfig()))
            loss = model(tokens, targets)
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e9)
                     .full_tensor().item())
        opt.step()
        opt.zero_grad()
    full = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": full,
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules())}


def _assert_same(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), rtol=RTOL, atol=0)
    assert a["params"].keys() == b["params"].keys()
    # Parameters at RTOL of each tensor's scale: FSDP2's and shardwise's gathered weights sit in differently
    # aligned buffers, and a CPU's BLAS may block a matmul differently for each (on one AMD EPYC the weight
    # gradients differ in the last bits, on other CPUs they are equal), while AdamW scales every element's step
    # to about lr whatever its size, so an element near zero carries the same absolute rounding as its tensor's
    # largest ones and has no meaningful relative error of its own.
    for name in a["params"]:
        scale = float(a["params"][name].abs().max())
        torch.testing.assert_close(a["params"][name], b["params"][name], rtol=RTOL, atol=RTOL * scale, msg=name)
    assert a["fsdp_units"] == b["fsdp_units"]


@pytest.mark.parametrize("world", [1, 2])
def test_per_block_then_root_trains_as_fsdp2(world):
    theirs = run_distributed(_train, world, "fsdp2")[0]
    ours = run_distributed(_train, world, "shardwise")[0]
    _assert_same(theirs, ours)


def test_gradient_divide_factor_and_accumulation_as_fsdp2():
    """torchtitan's switch (``set_gradient_divide_factor(1.0)``: a plain sum) and ``set_requires_gradient_sync``
    accumulation: grad norms are FSDP2's, not 1/world of them."""
    theirs = run_distributed(_train, 2, "fsdp2", divide_factor=1.0, accumulate=2)[0]
    ours = run_distributed(_train, 2, "shardwise", divide_factor=1.0, accumulate=2)[0]
    _assert_same(theirs, ours)
    mean = run_distributed(_train, 2, "shardwise", accumulate=2)[0]
    assert abs(ours["norms"][0] / mean["norms"][0] - 2.0) < 1e-4  # the sum over 2 ranks is twice the mean


def test_a_2d_mesh_is_hsdp_whatever_its_axis_names():
    theirs = run_distributed(_train, 2, "fsdp2", mesh_shape=(2, 1), mesh_names=("replicas", "fsdp"))[0]
    ours = run_distributed(_train, 2, "shardwise", mesh_shape=(2, 1), mesh_names=("replicas", "fsdp"))[0]
    _assert_same(theirs, ours)


def test_torch_mixed_precision_policy_means_what_it_means_in_torch():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce_dtype None: reduce in bf16
    theirs = run_distributed(_train, 2, "fsdp2", mp_policy=policy)[0]
    ours = run_distributed(_train, 2, "shardwise", mp_policy=policy)[0]
    # same rounding points (bf16 compute, bf16 reduction, fp32 sharded weights): bf16's resolution bounds the
    # difference of losses computed through other kernel orders
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(torch.tensor(theirs["losses"]), torch.tensor(ours["losses"]), rtol=4 * eps, atol=0)


# ------------------------------------------------------------------ the FSDPModule surface
def test_every_public_fsdpmodule_method_is_the_engines():
    """No method of torch's ``FSDPModule`` reaches FSDP2's own state from a shardwise unit: each is defined by
    ``ShardedModule`` (with FSDP2's meaning, or refusing by name)."""
    public = [n for n, v in vars(FSDPModule).items() if callable(v) and not n.startswith("__")]
    inherited = [n for n in public if n not in vars(ShardedModule)]
    assert not inherited, inherited
    for name in public:
        ours, theirs = inspect.signature(getattr(ShardedModule, name)), inspect.signature(getattr(FSDPModule, name))
        assert list(ours.parameters) == list(theirs.parameters) or name.startswith("_"), (name, ours, theirs)


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _unit_methods() -> dict:
    torch.manual_seed(0)
    model = _Two().to(device())
    shardwise.fully_shard([model.a, model.b])
    shardwise.fully_shard(model)
    out = {"units": [isinstance(m, FSDPModule) for m in (model, model.a, model.b, model.c)]}
    handle = model.a.unshard(async_op=True)
    handle.wait()
    out["gathered"] = [type(p).__name__ for p in model.a.parameters()] + [type(p).__name__ for p in model.b.parameters()]
    model.a.reshard()
    out["resharded"] = [type(p).__name__ for p in model.b.parameters()]
    model.set_requires_gradient_sync(False, recurse=False)
    out["recurse"] = [u.settings.requires_gradient_sync for u in model.sharded_state.all_units]
    x = torch.randn(3, 4, device=device())
    model(x).sum().backward()  # no sync on the root, sync on the list unit
    out["grads"] = [p.grad is not None for p in model.parameters()]
    for name, args in (("set_symm_mem_for_comm", ()), ("set_custom_all_gather", (None,)),
                       ("set_reduce_scatter_max_input_buffers", (2,))):
        try:
            getattr(model, name)(*args)
            out[name] = "accepted"
        except NotImplementedError as e:
            out[name] = str(e)
    return out


def test_unit_methods_act_on_their_unit():
    out = run_distributed(_unit_methods, 2)[0]
    assert out["units"] == [True, True, True, False]  # a list call: each of its modules is a unit's module
    assert out["gathered"] == ["Parameter"] * 4 and out["resharded"] == ["DTensor"] * 2
    assert out["recurse"] == [True, False]  # the list unit, then the root
    assert out["grads"] == [True, True, True, True, False, False]  # the root's (c) were kept unsharded
    for name in ("set_symm_mem_for_comm", "set_custom_all_gather", "set_reduce_scatter_max_input_buffers"):
        assert out[name].startswith(f"FSDPModule.{name} is not built in shardwise"), out[name]


# ------------------------------------------------------------------ dtypes, ranks, meta, replaced parameters
class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.low = nn.Linear(4, 4).to(torch.bfloat16)
        self.wide = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.full = nn.Linear(4, 4)

    def forward(self, x):
        return self.full(self.low(x.bfloat16()).float() * self.wide.float())


def _dtypes() -> dict:
    torch.manual_seed(0)
    model = _Mixed().to(device())
    shardwise.fully_shard(model.low)
    shardwise.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, device=device())).sum().backward()
    opt.step()
    return {"params": {n: p.dtype for n, p in model.named_parameters()},
            "state": {n: v.dtype for n, v in model.state_dict().items()},
            "optim": {p.dtype: opt.state[p]["exp_avg"].dtype for p in model.parameters()}}


def test_parameters_keep_their_dtype_as_in_fsdp2():
    out = run_distributed(_dtypes, 2)[0]
    want = {"low.weight": torch.bfloat16, "low.bias": torch.bfloat16, "wide": torch.float64,
            "full.weight": torch.float32, "full.bias": torch.float32}
    assert out["params"] == want and out["state"] == want
    assert out["optim"] == {d: d for d in (torch.bfloat16, torch.float64, torch.float32)}


def _weights_from_rank0_only(sync: bool):
    torch.manual_seed(dist.get_rank())  # as if only rank 0 had loaded the checkpoint
    model = _Two().to(device())
    try:
        shardwise.fully_shard(model, sync_module_states=sync)
    except ValueError as e:
        return str(e)
    return {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}


def test_weights_that_differ_across_ranks_are_accepted_or_broadcast():
    """Accepted as FSDP2 accepts them (named at the first forward if nothing writes them first:
    tests/engine/test_fsdp2_unsynced_weights.py); ``sync_module_states=True`` takes the first rank's."""
    accepted = run_distributed(_weights_from_rank0_only, 2, False)
    builds = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        builds.append(_Two().a.weight.detach())
    for rank_result in accepted:  # each rank's own rows, as FSDP2 shards what each rank holds
        assert torch.equal(rank_result["a.weight"], torch.cat([builds[0][:2], builds[1][2:]]))
    synced = run_distributed(_weights_from_rank0_only, 2, True)
    torch.manual_seed(0)
    expected = dict(_Two().named_parameters())
    for rank_result in synced:
        for name, value in rank_result.items():
            assert torch.equal(value, expected[name].detach()), name


def _meta_then_init(which: str) -> dict:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    with torch.device("meta"):
        model = _Two()
    fully_shard(model.a)
    fully_shard(model)
    model.to_empty(device=device())
    torch.manual_seed(0)
    with torch.no_grad():
        for m in (model.a, model.b, model.c):
            m.reset_parameters()  # the model's own init, on the sharded DTensors
    x = torch.arange(12.0, device=device()).view(3, 4) / 12
    loss = model(x).square().sum()
    loss.backward()
    return {"loss": loss.item(), "params": {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()},
            "grads": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}}


def test_meta_build_to_empty_and_init_weights_as_in_fsdp2():
    """The model is sharded on the meta device; ``to_empty`` gives the shards storage and the model's own
    ``reset_parameters`` fills them through DTensor ops: the same values and training as FSDP2's."""
    theirs = run_distributed(_meta_then_init, 2, "fsdp2")[0]
    ours = run_distributed(_meta_then_init, 2, "shardwise")[0]
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=RTOL)
    for key in ("params", "grads"):
        for name in theirs[key]:
            torch.testing.assert_close(ours[key][name], theirs[key][name], rtol=RTOL, atol=1e-7)


def _replaced_after_wrapping() -> dict:
    torch.manual_seed(0)
    model = _Two().to(device())
    shardwise.fully_shard(model)
    x = torch.ones(2, 4, device=device())
    before = model(x).detach()
    zeros = {k: torch.zeros_like(v.full_tensor()) for k, v in model.state_dict().items()}
    model.load_state_dict(zeros, assign=True)  # Accelerate's way of loading into a wrapped model
    after_assign = model(x).detach()
    model.to_empty(device=device())  # torchtitan's trainer order: storage swapped after fully_shard
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    after_to_empty = model(x).detach()
    errors = {}
    for name, change in (("device", lambda m: m.to("meta")),):  # dtype casts: test_fsdp2_nesting_and_casts.py
        other = shardwise.fully_shard(_Two().to(device()))
        try:
            change(other)
        except ValueError as e:
            errors[name] = str(e)
    return {"before": before, "assign": after_assign, "to_empty": after_to_empty, "errors": errors}


def test_parameters_replaced_after_wrapping_are_what_forward_reads():
    out = run_distributed(_replaced_after_wrapping, 2)[0]
    assert out["before"].abs().sum() > 0
    assert torch.equal(out["assign"], torch.zeros_like(out["assign"]))
    expected = _Two()
    with torch.no_grad():
        for p in expected.parameters():
            p.fill_(0.5)
    torch.testing.assert_close(out["to_empty"], expected(torch.ones(2, 4)), rtol=RTOL, atol=0)
    assert "a sharded model stays on the device of its mesh" in out["errors"]["device"]


# ------------------------------------------------------------------ what FSDP2 refuses, refused at wrap time
def _misuse() -> dict:
    out = {}

    def capture(key, fn):
        try:
            fn()
            out[key] = "accepted"
        except (ValueError, TypeError, NotImplementedError) as e:
            out[key] = str(e)

    m = _Two()
    capture("duplicate", lambda: shardwise.fully_shard([m.a, m.a]))
    shardwise.fully_shard(m.a)
    capture("twice", lambda: shardwise.fully_shard(m.a))
    capture("list_units", lambda: shardwise.fully_shard([m.b, m.c], unit_modules=[nn.Linear]))
    capture("int_reshard", lambda: shardwise.fully_shard(_Two(), reshard_after_forward=2))
    capture("dp_mesh_dims", lambda: shardwise.fully_shard(_Two(), dp_mesh_dims=object()))
    capture("shard_dim1", lambda: shardwise.fully_shard(_Two(), shard_placement_fn=lambda p: Shard(1)))
    capture("policy", lambda: shardwise.fully_shard(_Two(), mp_policy="bf16"))
    return out


def test_misuse_is_refused_at_wrap_time_naming_it():
    out = run_distributed(_misuse, 1)[0]
    assert "got the same module twice" in out["duplicate"]
    assert "is already sharded by shardwise.fully_shard" in out["twice"]
    assert "unit_modules= takes one module, not a list" in out["list_units"]
    assert "reshard_after_forward=2 (an int" in out["int_reshard"] and "divisor of the shard mesh dim's size 1" in \
        out["int_reshard"]
    assert "dp_mesh_dims=<object" in out["dp_mesh_dims"] and "DataParallelMeshDims" in out["dp_mesh_dims"]
    # Shard(1) is built (tests/engine/test_shard_dim.py); a bias has no dim 1, which FSDP2 refuses too
    assert "shard_placement_fn returned Shard(dim=1) for parameter 'a.bias' of shape (4,): it has no dim 1" in \
        out["shard_dim1"], out["shard_dim1"]
    assert "mp_policy='bf16' must be a MixedPrecisionPolicy" in out["policy"]


# ------------------------------------------------------------------ ignored_params, register_fsdp_forward_method
class _WithMethod(_Two):
    def score(self, x):
        return self.c(self.b(self.a(x))).sum(-1)


def _ignored_and_methods() -> dict:
    from torch.distributed.fsdp import register_fsdp_forward_method

    torch.manual_seed(0)
    model = _WithMethod().to(device())
    kept = model.c.weight
    shardwise.fully_shard(model.b)
    shardwise.fully_shard(model, ignored_params={kept})
    register_fsdp_forward_method(model.b, "forward")  # torch's own function, on a shardwise unit
    register_fsdp_forward_method(model, "score")
    x = torch.ones(2, 4, device=device()) * (dist.get_rank() + 1)  # each rank its own input
    score = model.score(x)  # not forward: the method gathers as forward would
    score.sum().backward()
    return {"kept_is_plain": model.c.weight is kept and not isinstance(model.c.weight, DTensor),
            "kept_grad": kept.grad.clone().cpu(),
            "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
            "score": score.detach().cpu()}


def test_ignored_params_stay_untouched_and_torchs_forward_methods_gather():
    results = run_distributed(_ignored_and_methods, 2)
    for rank, result in enumerate(results):
        assert result["kept_is_plain"]
        assert result["sharded"] == ["a.bias", "a.weight", "b.bias", "b.weight", "c.bias"]
        torch.manual_seed(0)
        reference = _WithMethod()
        x = torch.ones(2, 4) * (rank + 1)
        reference.score(x).sum().backward()
        torch.testing.assert_close(result["score"], reference.score(x).detach(), rtol=RTOL, atol=0)
        # an ignored parameter's gradient is this rank's own, never reduced (the ranks' inputs differ)
        torch.testing.assert_close(result["kept_grad"], reference.c.weight.grad, rtol=RTOL, atol=0)
    assert not torch.allclose(results[0]["kept_grad"], results[1]["kept_grad"])


# ------------------------------------------------------------------ a unit called on its own
def _non_root_step(impl: str) -> dict:
    """A step through the root, then a forward and backward through one unit alone (its input needs no grad),
    as torch's ``test_non_root_forward_backward``: that unit's backward is the whole backward of its step."""
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(42)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3)])
    model = model.to(device())
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    x = torch.randn(4, 8, device=device())
    losses = [model(x).sum()]
    losses[0].backward()
    opt.step()
    opt.zero_grad()
    losses.append(model[0](x).sum())
    losses[1].backward()
    kinds = sorted({type(p).__name__ for p in model.parameters()} | {type(p.grad).__name__ for p in model.parameters()})
    opt.step()
    losses.append(model(x).sum())
    return {"losses": [loss.item() for loss in losses], "kinds": kinds,
            "params": {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world", [1, 2])
def test_a_unit_called_on_its_own_ends_its_own_step_as_fsdp2(world):
    theirs = run_distributed(_non_root_step, world, "fsdp2")[0]
    ours = run_distributed(_non_root_step, world, "shardwise")[0]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=RTOL, atol=0)
    assert ours["kinds"] == theirs["kinds"] == ["DTensor", "NoneType"]  # resharded, grads reduced (or None)
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=RTOL, atol=1e-7, msg=name)
