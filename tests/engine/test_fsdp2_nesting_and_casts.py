"""FSDP2's nesting at any depth, dtype casts after wrapping, and what the modules hold between the hooks.

Each case runs torch's FSDP2 and shardwise with the very same code in the same test and compares: losses,
gradient norms and final parameters (fp32 / fp64: rtol 1e-5; bf16 / fp16: from the dtype's eps), the number
of units, and at two ranks the all-gathers and reduce-scatters each step launches (``CollectiveLaunches``: the
same count means each unit is gathered, and so freed and gathered again for backward, as often as FSDP2 does).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from tests.helpers.counting import CollectiveLaunches
from tests.helpers.distributed import device, run_distributed

STEPS, DIM, HIDDEN, VOCAB, SEQ = 3, 16, 24, 32, 8


# ------------------------------------------------------------------ a torchtitan-like model (three levels)
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Titan(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _titan(fully_shard, model: Titan, mesh) -> None:
    """torchtitan's three levels: each layer's attention and feed-forward, the layer, the model."""
    for layer in model.layers:
        fully_shard(layer.attention, mesh=mesh)
        fully_shard(layer.feed_forward, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _any_order(fully_shard, model: Titan, mesh) -> None:
    """Bottom-up in no module order, four levels deep in one place, lists of modules at a level."""
    last, first = model.layers[1], model.layers[0]
    fully_shard(last.feed_forward.w1, mesh=mesh)  # four levels: w1, feed_forward, layer, model
    fully_shard(last.feed_forward, mesh=mesh)
    fully_shard(last.attention, mesh=mesh)
    fully_shard(last, mesh=mesh)
    fully_shard([first.attention_norm, first.ffn_norm], mesh=mesh)  # a list unit inside a unit
    fully_shard(first.attention, mesh=mesh)
    fully_shard(first, mesh=mesh)
    fully_shard([model.norm, model.output], mesh=mesh)
    fully_shard(model, mesh=mesh)


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.LayerNorm(DIM)),
                         nn.Linear(DIM, DIM))


def _wrap_sequential(fully_shard, model: nn.Sequential, mesh) -> None:
    """The inner Sequential's sublayers, the inner Sequential, the outer one."""
    fully_shard(model[0][0], mesh=mesh)
    fully_shard(model[0][1], mesh=mesh)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)


_RECIPES = {"titan": (Titan, _titan), "any_order": (Titan, _any_order), "sequential": (_sequential, _wrap_sequential)}


def _inputs(step: int, model: nn.Module):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    if isinstance(model, Titan):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        return tokens[:, :-1].to(device()), tokens[:, 1:].to(device())
    return torch.randn(4, DIM, generator=g).to(device()), None


def _loss(model: nn.Module, x, targets):
    out = model(x)
    if targets is None:
        return out.square().mean()
    return F.cross_entropy(out.float().reshape(-1, VOCAB), targets.reshape(-1))


def _nested_train(impl: str, recipe: str) -> dict:
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    build, wrap = _RECIPES[recipe]
    torch.manual_seed(0)
    model = build().to(device())
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    wrap(fully_shard, model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, counts = [], [], []
    for step in range(STEPS):
        counter = CollectiveLaunches(impl)
        loss = _loss(model, *_inputs(step, model))
        loss.backward()
        counts.append(counter.close())
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor().item())
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "norms": norms, "counts": counts,
           "params": {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()},
           "units": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))}
    if impl == "shardwise":
        out["order"] = [u.name for u in model.sharded_state.forward_order]
    return out


def _assert_same(ref: dict, got: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=rtol, atol=0)
    assert got["params"].keys() == ref["params"].keys()
    for name in ref["params"]:
        assert got["params"][name].dtype == ref["params"][name].dtype, name
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=rtol, atol=atol, msg=name)
    assert ref["losses"][0] != ref["losses"][-1]  # it trains


_ORDERS = {
    "titan": ["layers.0", "layers.0.attention", "layers.0.feed_forward",
              "layers.1", "layers.1.attention", "layers.1.feed_forward"],
    "any_order": ["layers.0", "layers.0.attention_norm", "layers.0.attention", "layers.1", "layers.1.attention",
                  "layers.1.feed_forward", "layers.1.feed_forward.w1", "norm"],
    "sequential": ["0", "0.0", "0.1"],
}


@pytest.mark.parametrize("recipe", sorted(_RECIPES))
@pytest.mark.parametrize("world", [1, 2])
def test_nesting_at_any_depth_trains_as_fsdp2(recipe, world):
    ref = run_distributed(_nested_train, world, "fsdp2", recipe)[0]
    got = run_distributed(_nested_train, world, "shardwise", recipe)[0]
    _assert_same(ref, got)
    assert got["units"] == ref["units"]
    assert got["order"] == _ORDERS[recipe]  # each unit once, in the order its forward starts
    if world > 1:  # one process gathers nothing under shardwise (the shard is the whole weight)
        assert got["counts"] == ref["counts"]


def _not_bottom_up() -> str:
    model = Titan()
    shardwise.fully_shard(model.layers[0].attention)
    shardwise.fully_shard(model)
    try:
        shardwise.fully_shard(model.layers[0])
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_unit_inside_an_ancestors_model_is_still_refused():
    message = run_distributed(_not_bottom_up, 1)[0]
    assert message.startswith("submodule 'attention' (ShardedAttention) was already taken in by the fully_shard "
                              "call on ShardedTitan, outside Layer"), message


# ------------------------------------------------------------------ dtype casts after wrapping
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


def _cast(model: nn.Module, how: str) -> None:
    if how.startswith("to_"):
        model.to(getattr(torch, how[3:]))
    else:
        getattr(model, how)()


_CAST_DTYPES = {"to_float64": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
                "double": torch.float64, "float": torch.float32}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()  # no alias of a live buffer


def _cast_train(impl: str, how: str, param_dtype: torch.dtype | None, grads_before: bool = False,
                meta: bool = False) -> dict:
    """Wrap (``impl="plain"``: leave unwrapped), optionally run one backward first, cast with ``how``, build the
    optimizer, train. ``meta``: built and cast on the meta device, then ``to_empty`` and initialized."""
    fully_shard = {"fsdp2": torch_fully_shard, "shardwise": shardwise.fully_shard}.get(impl, lambda m, **_: m)
    torch.manual_seed(0)
    with torch.device("meta" if meta else device()):
        model = MLP()
    if how == "float":
        model.double()  # cast back to fp32 after wrapping
    policy = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype is not None else MixedPrecisionPolicy()
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module, mp_policy=policy)
    dtype = _CAST_DTYPES[how]
    out = {}
    if grads_before:
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7)).to(device())
        model(x.to(next(model.parameters()).dtype)).square().mean().backward()
        out["grads before"] = {n: _full(p.grad) for n, p in model.named_parameters()}
    _cast(model, how)
    if meta:
        model.to_empty(device=device())
        torch.manual_seed(1)
        with torch.no_grad():
            model.in_proj.reset_parameters()
            model.out_proj.reset_parameters()
    out["dtypes"] = sorted({(type(p).__name__, str(p.dtype)) for p in model.parameters()})
    if grads_before:
        out["grads"] = {n: (str(p.grad.dtype), _full(p.grad)) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)  # an eps fp16 holds (1e-8 rounds to 0)
    losses, norms = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = model(torch.randn(4, DIM, generator=g).to(device(), dtype)).float().square().mean()
        loss.backward()  # the first accumulates onto the gradients held at the cast
        losses.append(loss.item())
        norms.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)).float().item())
        opt.step()
        opt.zero_grad()
    out.update(losses=losses, norms=norms, params={n: _full(p) for n, p in model.named_parameters()})
    return out


def _cast_tolerance(how: str, param_dtype) -> tuple[float, float]:
    """rtol and atol: 1e-5 where every step is fp32 or fp64; a few units of the low dtype's eps otherwise
    (the same rounding points, different kernels' orders)."""
    low = [d for d in (_CAST_DTYPES[how], param_dtype) if d in (torch.float16, torch.bfloat16)]
    if not low:
        return 1e-5, 1e-7
    eps = max(torch.finfo(d).eps for d in low)
    return 4 * eps, 4 * eps


@pytest.mark.parametrize("how", sorted(_CAST_DTYPES))
@pytest.mark.parametrize("world", [1, 2])
def test_a_dtype_cast_after_wrapping_trains_as_fsdp2(how, world):
    ref = run_distributed(_cast_train, world, "fsdp2", how, None, False)[0]
    got = run_distributed(_cast_train, world, "shardwise", how, None, False)[0]
    assert got["dtypes"] == ref["dtypes"] == [("DTensor", str(_CAST_DTYPES[how]))]
    _assert_same(ref, got, *_cast_tolerance(how, None))


@pytest.mark.parametrize("world", [1, 2])
def test_a_cast_under_a_mixed_precision_policy_keeps_its_compute_dtype(world):
    """FSDP2's meaning: the cast sets the sharded (main) weights' dtype; forward still computes in
    ``param_dtype`` and reduces in it (torch's ``reduce_dtype=None``)."""
    ref = run_distributed(_cast_train, world, "fsdp2", "double", torch.bfloat16, False)[0]
    got = run_distributed(_cast_train, world, "shardwise", "double", torch.bfloat16, False)[0]
    assert got["dtypes"] == ref["dtypes"] == [("DTensor", "torch.float64")]
    _assert_same(ref, got, *_cast_tolerance("double", torch.bfloat16))


@pytest.mark.parametrize("world", [1, 2])
def test_a_meta_built_model_cast_before_to_empty_trains_as_fsdp2(world):
    ref = run_distributed(_cast_train, world, "fsdp2", "to_float64", None, False, True)[0]
    got = run_distributed(_cast_train, world, "shardwise", "to_float64", None, False, True)[0]
    assert got["dtypes"] == ref["dtypes"] == [("DTensor", "torch.float64")]
    _assert_same(ref, got)


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_held_at_a_cast_are_cast_with_their_parameters(world):
    """A cast after a backward, with ``.grad`` still held: FSDP2 fails at the next forward there (its gathers
    keep the dtype of its first forward), so the reference is the unwrapped model at one process; at two,
    the held gradients are the ones from before the cast, cast."""
    got = run_distributed(_cast_train, world, "shardwise", "double", None, True)[0]
    for name, (dtype, grad) in got["grads"].items():
        assert dtype == "torch.float64"
        assert torch.equal(grad, got["grads before"][name].double()), name
    if world == 1:
        ref = run_distributed(_cast_train, 1, "plain", "double", None, True)[0]
        _assert_same(ref, got)
    else:
        assert got["losses"][0] != got["losses"][-1]


def _partial_cast() -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shardwise.fully_shard(model)
    model[0].double()  # no unit: noticed at the next forward (FSDP2 refuses it at its first forward)
    try:
        model(torch.ones(1, 4))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_casting_part_of_a_unit_is_refused_naming_the_parameters():
    message = run_distributed(_partial_cast, 1)[0]
    assert message.startswith("parameters ['0.weight', '0.bias'] were cast to ['torch.float64'] after fully_shard "
                              "but ['1.weight', '1.bias'] of the same unit stayed torch.float32"), message


# ------------------------------------------------------------------ what the modules hold
def _registered(impl: str, reshard_after_forward) -> dict:
    fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = Titan(layers=1).to(device())
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer.attention, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)

    def kinds() -> dict:
        held = {n: "DTensor" if isinstance(p, DTensor) else "Tensor" for n, p in model.named_parameters()}
        attribute = model.layers[0].attention.wq.weight
        held["layers.0.attention.wq.weight (attribute)"] = "DTensor" if isinstance(attribute, DTensor) else "Tensor"
        return held

    seen = {"init": kinds()}
    tokens = _inputs(0, model)[0]
    out = model(tokens)
    seen["after forward"] = kinds()
    # what code between forward and backward reads: the unsharded weight is the full tensor forward used
    weight = model.output.weight
    seen["full weight read"] = not isinstance(weight, DTensor) and tuple(weight.shape) == (VOCAB, DIM)
    out.float().square().mean().backward()
    seen["after backward"] = kinds()
    model.layers[0].unshard()
    seen["after unshard"] = kinds()
    model.layers[0].reshard()
    seen["after reshard"] = kinds()
    return seen


@pytest.mark.parametrize("reshard_after_forward", [True, False, None])
@pytest.mark.parametrize("world", [1, 2])
def test_modules_hold_what_fsdp2_registers(reshard_after_forward, world):
    ref = run_distributed(_registered, world, "fsdp2", reshard_after_forward)[0]
    got = run_distributed(_registered, world, "shardwise", reshard_after_forward)[0]
    assert got == ref
    kept = set(ref["after forward"].values())
    assert kept == ({"DTensor"} if reshard_after_forward else {"Tensor"} if reshard_after_forward is False
                    else {"DTensor", "Tensor"})  # None: the root keeps its gathered weights
