"""FP8 under shardwise: torchao's Float8Linear as a unit's linears, and the FP8 weight all-gather.

- the gathered e4m3 bytes and scales are bit-identical to torchao casting each whole fp32 weight in one
  process (1, 2 and 4 ranks, HSDP; uneven and empty pieces, an all-zero weight), and follow the main
  weights after they change;
- a counting ``Collectives`` sees one amax all-reduce per FP8 group and step, and at most 0.55x the bytes
  of the bf16 gather;
- an FP8 GPT's loss and gradients under shardwise (bf16 or FP8 gather) are those of one process running the
  same torchao model on the same micro-batches (gradients by SQNR, torchao's measure);
- its checkpoints resume bit-exact, reshard into a bf16 model, and export plain weights;
- compiled units (``compile_units``) compile once, with no graph break, and train as eager.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import shardwise
from shardwise.engine.model_ops import load_full_state_dict, sharded_state
from shardwise.engine.collectives import Collectives
from tests.helpers.distributed import run_distributed

BF16 = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
# shapes with pieces of every kind on 4 ranks: uneven (5 rows), empty (1 row: ranks 1-3 hold none),
# 2-D and flat rows, and one of FP8-matmul size
SHAPES = {"a": (5, 3), "b": (1, 7), "c": (33, 2), "d": (16, 16)}


class Counting(Collectives):
    """The default collectives, counted: amax all-reduces, and gathered bytes by dtype."""

    def __init__(self):
        self.amax_calls = 0
        self.gather_bytes: dict[torch.dtype, int] = {}

    def gather(self, outs, ins, axis):
        for t in ins:
            self.gather_bytes[t.dtype] = self.gather_bytes.get(t.dtype, 0) + t.numel() * t.element_size()
        super().gather(outs, ins, axis)

    def all_reduce_max(self, t, axes):
        self.amax_calls += 1
        super().all_reduce_max(t, axes)


class Holder(nn.Module):
    """Parameters of awkward shapes (marked for the FP8 gather) and a bias that is not."""

    def __init__(self, mark: bool):
        super().__init__()
        from shardwise.engine.fp8 import require_torchao
        from shardwise.engine.quantized_gather import GATHER_ATTR, Fp8Tensorwise

        require_torchao()
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig

        def wrap(data, scale, dtype):
            return Float8TrainingTensor(data, scale, dtype, LinearMMConfig(), gemm_input_role=GemmInputRole.WEIGHT)

        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            p = nn.Parameter(torch.randn(shape, generator=g) * (10.0 if name == "c" else 0.3))
            if mark:
                setattr(p, GATHER_ATTR, Fp8Tensorwise(wrap))
            self.register_parameter(name, p)
        self.bias = nn.Parameter(torch.randn(6, generator=g))

    def forward(self, x):
        return x


def _torchao_cast(full: torch.Tensor):
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    ref = hp_tensor_to_float8_dynamic(full.float(), torch.float8_e4m3fn, LinearMMConfig(),
                                      gemm_input_role=GemmInputRole.WEIGHT)
    return ref._data.view(torch.uint8), ref._scale


def _check_gathered(model, fulls: dict) -> None:
    model.unshard()
    for name, full in fulls.items():
        held = model._parameters[name]
        data, scale = _torchao_cast(full)
        assert held._data.dtype == torch.float8_e4m3fn and tuple(held.shape) == tuple(full.shape), name
        assert torch.equal(held._data.view(torch.uint8), data), f"{name}: gathered e4m3 bytes differ"
        assert torch.equal(held._scale, scale), f"{name}: scale {held._scale} != {scale}"
    model.reshard()


def _bits_case(outer: int | None) -> dict:
    import torch.distributed as dist

    mesh = shardwise.build_dp_mesh(outer=outer) if outer else None
    extra = dict(outer_dp_sharding_strategy="no_shard") if outer else {}
    counts = {}
    for mark in (True, False):
        collectives = Counting()
        model = shardwise.fully_shard(Holder(mark), mesh, strategy="optim_grads_params", mixed_precision=BF16,
                                      collectives=collectives, **extra)
        fulls = {n: p.full_tensor() for n, p in model.named_parameters() if n in SHAPES}
        if mark:
            _check_gathered(model, fulls)
            # the main weights change (a load; an all-zero weight among them): new amaxes, new scales
            g = torch.Generator().manual_seed(1)
            new = {n: torch.randn(s, generator=g) * 3.0 for n, s in SHAPES.items()}
            new["b"] = torch.zeros(SHAPES["b"])
            load_full_state_dict(model, new, strict=False)
            _check_gathered(model, new)
            _check_gathered(model, new)  # no change: the scales are kept (no further all-reduce)
            counts["amax_calls"] = collectives.amax_calls
            counts["fp8_bytes"] = collectives.gather_bytes.get(torch.uint8, 0)
        else:
            model.unshard()
            model.reshard()
            counts["bf16_bytes"] = collectives.gather_bytes.get(torch.bfloat16, 0)
    counts["world"] = dist.get_world_size()
    return counts


@pytest.mark.parametrize("world, outer", [(1, None), (2, None), (4, None), (4, 2)])
def test_fp8_gather_is_bit_identical_to_one_cast_of_the_whole_weight(world, outer):
    counts = run_distributed(_bits_case, world, outer)[0]
    sharded = world // (outer or 1) > 1
    # one all-reduce of the amaxes per FP8 group each time the main weights changed (twice here), none on one rank
    assert counts["amax_calls"] == (2 if sharded else 0), counts
    if sharded:  # three gathers of the marked weights in FP8 against one in bf16: half the bytes each
        assert counts["fp8_bytes"] / 3 <= 0.55 * counts["bf16_bytes"], counts
    else:
        assert counts["fp8_bytes"] == counts["bf16_bytes"] == 0, counts


# ------------------------------------------------------------------ an FP8 GPT trained
def _gpt_config():
    from shardwise.models import GPTConfig

    return GPTConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=16)


def _fp8_gpt(all_gather: bool, seed: int = 0):
    from shardwise.models import GPT

    torch.manual_seed(seed)
    model = GPT(_gpt_config())
    conversion = shardwise.convert_to_fp8(model, "tensorwise", all_gather=all_gather)
    return model, conversion


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(100 + step))


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantization noise in dB: torchao's measure of an FP8 result against a reference."""
    ref, got = ref.double(), got.double()
    noise = (ref - got).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


# A reference gradient is the bf16 sum of the ranks' bf16 gradients where the sharded run sums them in fp32: one
# bf16 rounding, at most eps/2 relative per element, so an SQNR of at least 20*log10(2/eps) = 48.2 dB on any
# processor (the FP8 casts are the same on both sides). The bound allows twice that error.
GRAD_SQNR_DB = 20 * math.log10(2 / torch.finfo(torch.bfloat16).eps) - 20 * math.log10(2)


def _parity_case(all_gather: bool, outer: int | None) -> dict:
    import copy

    import torch.distributed as dist

    from shardwise.models import TransformerLayer

    model, conversion = _fp8_gpt(all_gather)
    # One process, the same torchao model: bf16 weights (the RoPE tables stay fp32), except that with the FP8
    # gather the FP8 linears keep fp32 weights, so torchao casts each to e4m3 from its fp32 values, as the gather does.
    reference = copy.deepcopy(model)
    fp8_weights = {id(m.weight) for m in reference.modules() if type(m).__name__ == "Float8Linear"}
    with torch.no_grad():
        for p in reference.parameters():
            if not (all_gather and id(p) in fp8_weights):
                p.data = p.data.to(torch.bfloat16)
    mesh = shardwise.build_dp_mesh(outer=outer) if outer else None
    extra = dict(outer_dp_sharding_strategy="no_shard") if outer else {}
    model = shardwise.fully_shard(model, mesh, unit_modules=[TransformerLayer], mixed_precision=BF16, **extra)
    groups = [g.name for g in sharded_state(model).groups if g.quantized is not None]
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = _tokens(0)
    rows = tokens.shape[0] // world
    mine = tokens[rank * rows:(rank + 1) * rows]
    loss = model(mine, mine)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref_loss = 0.0
    for r in range(world):  # each rank's rows as its own micro-batch: the same activation scales as the ranks'
        part = tokens[r * rows:(r + 1) * rows]
        piece = reference(part, part) / world
        piece.backward()
        ref_loss += piece.item()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    worst = min(sqnr(r.grad.float(), grads[n]) for n, r in reference.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad()
    losses = []
    for step in range(1, 3):  # training on: the scales follow the updated main weights
        t = _tokens(step)[rank * rows:(rank + 1) * rows]
        step_loss = model(t, t)
        step_loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(step_loss.item())
    return dict(loss=total.item() / world, ref_loss=ref_loss, grad_sqnr=worst, fp8_groups=groups,
                converted=len(conversion.converted), losses=losses)


@pytest.mark.parametrize("all_gather, world, outer", [(True, 2, None), (False, 2, None)])
def test_fp8_gpt_matches_one_process_torchao(all_gather, world, outer):
    out = run_distributed(_parity_case, world, all_gather, outer)[0]
    assert out["converted"] == 14  # 7 linears per layer; the output head stays bf16
    assert len(out["fp8_groups"]) == (2 if all_gather else 0), out["fp8_groups"]
    # the same FP8 casts as the one process: the loss to fp32 rounding, every gradient to one bf16 rounding
    # (GRAD_SQNR_DB; FP8 casts of different values, e.g. from bf16 weights, give ~22 dB)
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-5 * abs(out["ref_loss"]), out
    assert out["grad_sqnr"] >= GRAD_SQNR_DB, out
    assert out["losses"][-1] < out["loss"], out


# ------------------------------------------------------------------ checkpoints
def _checkpoint_case(folder: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from shardwise.checkpoint import CheckpointManager
    from shardwise.checkpoint.export import export_safetensors
    from shardwise.models import GPT, TransformerLayer

    def wrapped(seed, fp8=True, strategy="optim_grads_params"):
        if fp8:
            model, _ = _fp8_gpt(all_gather=True, seed=seed)
        else:
            torch.manual_seed(seed)
            model = GPT(_gpt_config())
        model = shardwise.fully_shard(model, unit_modules=[TransformerLayer], mixed_precision=BF16,
                                      strategy=strategy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    rank, world = dist.get_rank(), dist.get_world_size()

    def steps(model, opt, which):
        out = []
        for step in which:
            t = _tokens(step)[rank * 4:(rank + 1) * 4]
            loss = model(t, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    manager = CheckpointManager(folder)
    model, opt = wrapped(0)
    plain_keys = set(GPT(_gpt_config()).state_dict())
    assert set(get_model_state_dict(model)) == plain_keys  # the torchao model's keys are the plain model's
    steps(model, opt, [0, 1])
    manager.save(2, model, opt)
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder + "-dcp")  # plain DCP too
    at_two = shardwise.full_state_dict(model)
    straight = steps(model, opt, [2, 3])

    resumed_model, resumed_opt = wrapped(7)  # another init: every value comes from the checkpoint
    manager.load_latest(resumed_model, resumed_opt)
    resumed = steps(resumed_model, resumed_opt, [2, 3])

    by_torch, _ = wrapped(8)  # torch's own functions around plain DCP
    sd = get_model_state_dict(by_torch)
    dcp.load({"model": sd}, checkpoint_id=folder + "-dcp")
    set_model_state_dict(by_torch, sd)
    loaded = shardwise.full_state_dict(by_torch)
    same_dcp = all(torch.equal(loaded[k], at_two[k]) for k in at_two)

    plain, _ = wrapped(9, fp8=False, strategy="optim_grads")  # resharded into the unconverted model, ZeRO-2
    manager.load_latest(plain)
    into_plain = shardwise.full_state_dict(plain)
    same_plain = all(torch.equal(into_plain[k], at_two[k]) for k in at_two)

    exported_ok = None
    if rank == 0:
        files = export_safetensors(folder, folder + "-export")  # the latest complete checkpoint
        from safetensors.torch import load_file

        fresh = GPT(_gpt_config())  # plain weights load into the unconverted model
        fresh.load_state_dict(load_file(str(files[0])), strict=True)
        exported_ok = all(torch.equal(fresh.state_dict()[k], at_two[k]) for k in at_two)
    dist.barrier()
    return dict(straight=straight, resumed=resumed, same_plain=same_plain, same_dcp=same_dcp, exported_ok=exported_ok)


def test_fp8_checkpoints_resume_bit_exact_reshard_and_export_plain_weights(tmp_path):
    results = run_distributed(_checkpoint_case, 2, str(tmp_path / "ckpt"))
    for out in results:
        assert out["resumed"] == out["straight"], out
        assert out["same_plain"] and out["same_dcp"], out
    assert results[0]["exported_ok"], results[0]


# ------------------------------------------------------------------ refusals
def _refusal_case(kind: str) -> str:
    from shardwise.models import TransformerLayer

    model, _ = _fp8_gpt(all_gather=True)
    kwargs = dict(unit_modules=[TransformerLayer], mixed_precision=BF16)
    if kind == "fp32":
        kwargs["mixed_precision"] = shardwise.MixedPrecisionPolicy()
    elif kind == "zero2":
        kwargs["strategy"] = "optim_grads"
    elif kind == "offload":
        kwargs["offload_policy"] = shardwise.OffloadPolicy(fraction=1.0)
    try:
        shardwise.fully_shard(model, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind, words", [
    ("fp32", "compute dtype torch.float32"),
    ("zero2", "not sharded like the main weights"),
    ("offload", "offloaded"),
])
def test_fp8_gather_refuses_placements_it_is_not_built_for(kind, words):
    message = run_distributed(_refusal_case, 2, kind)[0]
    assert "FP8 weight all-gather of group layers.0" in message and words in message, message
    assert "all_gather=False" in message


def test_convert_to_fp8_checks_its_arguments():
    from shardwise.models import GPT, GPTConfig

    model = GPT(_gpt_config())
    with pytest.raises(ValueError, match="recipe='mxfp8'"):
        shardwise.convert_to_fp8(model, "mxfp8")
    with pytest.raises(ValueError, match="all_gather=True.*tensorwise scaling only"):
        shardwise.convert_to_fp8(model, "rowwise", all_gather=True)
    odd = GPT(GPTConfig(vocab_size=64, dim=40, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=16))
    with pytest.raises(ValueError, match="layers.0.attention.wq: in_features=40.*multiples of 16"):
        shardwise.convert_to_fp8(odd, filter_fn=lambda m, fqn: True)
    done = shardwise.convert_to_fp8(odd)  # the default filter leaves unaligned linears (and the head) in bf16
    assert done.converted == [] and "output" in done.skipped and len(done.skipped) == 8, done
    kept = shardwise.convert_to_fp8(model, "rowwise", filter_fn=shardwise.engine.fp8.skip_modules("output", "w2"))
    assert "layers.0.mlp.w2" in kept.skipped and kept.fp8_gathered == [] and len(kept.converted) == 12, kept


# ------------------------------------------------------------------ compiled units
def _compiled_case(compiled: bool, all_gather: bool) -> dict:
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from shardwise.models import TransformerLayer

    model, _ = _fp8_gpt(all_gather)
    model = shardwise.fully_shard(model, unit_modules=[TransformerLayer], mixed_precision=BF16)
    names = shardwise.compile_units(model, backend="aot_eager") if compiled else []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch._dynamo.reset()
    counters.clear()
    rank, losses, frames = dist.get_rank(), [], []
    try:
        for step in range(3):
            if step == 1:  # compiled in the first step; a recompile now raises
                torch.compiler.set_stance("fail_on_recompile")
            t = _tokens(step)[rank * 4:(rank + 1) * 4]
            loss = model(t, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            frames.append(counters["frames"]["ok"])
    finally:
        torch.compiler.set_stance("default")
    return dict(losses=losses, frames=frames, breaks=dict(counters["graph_break"]), units=names)


def test_fp8_units_compile_once_without_graph_breaks_and_train_like_eager():
    # with the FP8 gather: the parameters the compiled code reads are the same Float8TrainingTensors every step
    eager = run_distributed(_compiled_case, 2, False, True)[0]
    compiled = run_distributed(_compiled_case, 2, True, True)[0]
    assert compiled["units"] == ["layers.0", "layers.1"], compiled
    assert compiled["breaks"] == {}, compiled["breaks"]
    assert compiled["frames"][0] > 0 and compiled["frames"][-1] == compiled["frames"][0], compiled["frames"]
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)


# ------------------------------------------------------------------ tied weights
class Tied(nn.Module):
    """Two linears sharing one weight (both FP8), and an embedding tied to a third linear's weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.first = nn.Linear(16, 16, bias=False)
        self.second = nn.Linear(16, 16, bias=False)
        self.second.weight = self.first.weight
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.second(self.first(self.embed(tokens)).relu()))


def _tied_case() -> dict:
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    model = Tied()
    conversion = shardwise.convert_to_fp8(model, "tensorwise", filter_fn=lambda m, fqn: True, all_gather=True)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # as in _parity_case: bf16 weights, fp32 for the FP8-gathered ones
        for name, p in reference.named_parameters():
            if name != "first.weight":
                p.data = p.data.to(torch.bfloat16)
    model = shardwise.fully_shard(model, unit_modules=[model.first], mixed_precision=BF16)
    groups = {g.name: g.fqns for g in sharded_state(model).groups}
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(3))
    mine = tokens[rank * 2:(rank + 1) * 2]
    loss = model(mine).float().square().mean()
    loss.backward()
    ref_loss = 0.0
    for r in range(world):
        piece = reference(tokens[r * 2:(r + 1) * 2]).float().square().mean() / world
        piece.backward()
        ref_loss += piece.item()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    worst = min(sqnr(r.grad.float(), grads[n]) for n, r in reference.named_parameters())
    return dict(gathered=conversion.fp8_gathered, groups=groups, loss=total.item() / world, ref_loss=ref_loss,
                grad_sqnr=worst)


def test_tied_weights_gather_in_fp8_only_when_every_holder_is_an_fp8_linear():
    out = run_distributed(_tied_case, 2)[0]
    # first/second share a weight (gathered in FP8 once, by the root); head's is the embedding's (bf16)
    assert out["gathered"] == ["first.weight"], out
    assert out["groups"]["<root>[float32,fp8]"] == ["first.weight"], out["groups"]
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-5 * abs(out["ref_loss"]), out
    assert out["grad_sqnr"] >= GRAD_SQNR_DB, out
