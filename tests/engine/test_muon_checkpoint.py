"""DCP checkpoints of a model with ``Owned()`` matrices trained by torch.optim.Muon: state dicts hold them as
``Shard(0)`` rows over the data-parallel mesh, so a checkpoint saved on 2 processes loads at 1 and 4, into
torch's FSDP2 and into a plain model, bit for bit; the Muon momentum and AdamW state come back too, and the
resumed run's next step equals the straight run's (fp32, rtol 1e-5; Muon's iteration in fp32, as the world
sizes sum gradients in different orders)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, \
    set_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.engine.model_ops import load_full_state_dict
from tests.helpers.distributed import run_distributed
from tests.helpers.muon import CONFIG, TwoOptimizers, build, is_muon, newton_schulz_in_fp32, wrap
from tests.helpers.parity import assert_close_states
from tests.helpers.tiny_model import Block, batch


def _step(model, opt, step: int) -> None:
    tokens, targets = batch(step, 8, CONFIG)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    model(tokens[rows], targets[rows]).backward()
    opt.step()
    opt.zero_grad()


def _optimizer_state(model, opt) -> dict:
    """This rank's whole values of the optimizer state: each owned matrix's momentum where it is whole here,
    AdamW's moments (full tensors)."""
    out = {}
    for name, p in model.named_parameters():
        if is_muon(name, p):
            if p.to_local().numel() == p.numel():
                out[f"{name}.momentum"] = opt.muon.state[p]["momentum_buffer"].to_local().cpu().clone()
        else:
            for key, value in opt.adamw.state.get(p, {}).items():  # (none for the frozen parameter)
                if key != "step":
                    out[f"{name}.{key}"] = value.full_tensor().cpu().clone()  # (one rank: the state itself)
    return out


def _save(path: str) -> dict:
    """Two steps on this world, a checkpoint, one more step."""
    with newton_schulz_in_fp32():
        model = wrap()(build())
        opt = TwoOptimizers(model)
        for step in range(2):
            _step(model, opt, step)
        sd = get_model_state_dict(model)
        rows = {n: (type(v).__name__, tuple(v.placements) if isinstance(v, DTensor) else None) for n, v in sd.items()}
        model_sd, optim_sd = get_state_dict(model, [opt.muon, opt.adamw])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        saved, state = shardwise.full_state_dict(model), _optimizer_state(model, opt)
        _step(model, opt, 2)
        return {"saved": saved, "state": state, "next": shardwise.full_state_dict(model), "rows": rows}


def _resume(path: str) -> dict:
    with newton_schulz_in_fp32():
        model = wrap()(build())
        opt = TwoOptimizers(model)
        model_sd, optim_sd = get_state_dict(model, [opt.muon, opt.adamw])
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, [opt.muon, opt.adamw], model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded, state = shardwise.full_state_dict(model), _optimizer_state(model, opt)
        _step(model, opt, 2)
        return {"loaded": loaded, "state": state, "next": shardwise.full_state_dict(model)}


def _into_fsdp2_and_plain(path: str) -> dict:
    fsdp2 = build()
    for block in fsdp2.blocks:
        torch_fully_shard(block)
    torch_fully_shard(fsdp2)
    sd = get_model_state_dict(fsdp2)
    dcp.load({"model": sd}, checkpoint_id=path)
    set_model_state_dict(fsdp2, sd)
    plain = build()
    plain_sd = plain.state_dict()
    dcp.load({"model": plain_sd}, checkpoint_id=path)
    plain.load_state_dict(plain_sd)
    # and back: a plain model's full state dict into a shardwise model with owned matrices
    ours = wrap()(build())
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    load_full_state_dict(ours, plain.state_dict())
    return {"fsdp2": {k: v.full_tensor().cpu() for k, v in get_model_state_dict(fsdp2).items()},
            "plain": {k: v.detach().cpu() for k, v in plain.state_dict().items()},
            "ours": shardwise.full_state_dict(ours)}


def _merged_state(results: list[dict]) -> dict:
    out = {}
    for r in results:
        for k, v in r["state"].items():
            assert k not in out or torch.equal(out[k], v), k
            out[k] = v
    return out


def test_checkpoint_moves_across_world_sizes_fsdp2_and_plain(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, path)
    owned = [n for n in saved[0]["rows"] if n.startswith("blocks.") and n.endswith("weight") and "norm" not in n]
    for name in owned:  # the documented conversion: rows over the data-parallel mesh
        assert saved[0]["rows"][name] == ("DTensor", (Shard(0),)), (name, saved[0]["rows"][name])
    saved_state = _merged_state(saved)
    assert sum(k.endswith(".momentum") for k in saved_state) == 15  # every Muon matrix's momentum, on its owner
    for world in (1, 4):
        resumed = run_distributed(_resume, world, path)
        assert_close_states(resumed[0]["loaded"], saved[0]["saved"], rtol=0, element_rtol=0)
        assert_close_states(_merged_state(resumed), saved_state, rtol=0, element_rtol=0)
        assert_close_states(resumed[0]["next"], saved[0]["next"], rtol=1e-5)
    other = run_distributed(_into_fsdp2_and_plain, 2, path)[0]
    for which in ("fsdp2", "plain", "ours"):
        assert_close_states(other[which], saved[0]["saved"], rtol=0, element_rtol=0)
