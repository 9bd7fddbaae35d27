"""Checkpoints saved under TP x DP, EP x DP or TP x EP x DP load without them.

The checkpoint describes every tensor globally (data-parallel rows plus the
tensor- or expert-parallel offset), so it loads into any other layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.checkpoint import CheckpointManager
from shardwise.checkpoint.full import gather_full_optimizer_state
from shardwise.models import GPT, GPTConfig, MoETransformerLayer, TransformerLayer

from tests.helpers.distributed import device, run_distributed

SEQ = 16


def _config(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)
    base.update(overrides)
    return GPTConfig(**base)


def _moe(**overrides) -> GPTConfig:
    return _config(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0, **overrides)


def _snapshot(model, opt):
    weights = {k: v for k, v in shardwise.full_state_dict(model).items() if "rope" not in k}
    states = gather_full_optimizer_state(model, opt)
    return weights, {f: {k: v for k, v in s.items() if k != "step"} for f, s in states.items()}


def _save(path: str, kind: str):
    dev = device()
    units = [TransformerLayer, MoETransformerLayer]
    if kind == "tp":
        mesh = shardwise.build_dp_mesh(tp=2)
        config, extra, data_rank = _config(tp_group=mesh.get_group("tp")), {}, mesh.get_local_rank("dp_shard")
        units = [TransformerLayer]
    elif kind == "tpep":  # dense layers TP 2, whole experts EP 2 (expert TP 1), on the same 4 ranks
        mesh = shardwise.build_dp_mesh(tp=2)
        expert_mesh = shardwise.build_expert_mesh(ep=2)
        config = _moe(tp_group=mesh.get_group("tp"), ep_group=expert_mesh.get_group("ep"))
        extra, data_rank = {"expert_mesh": expert_mesh}, mesh.get_local_rank("dp_shard")
    else:
        mesh = shardwise.build_dp_mesh()
        expert_mesh = shardwise.build_expert_mesh(ep=2)
        config, extra, data_rank = _moe(ep_group=expert_mesh.get_group("ep")), {"expert_mesh": expert_mesh}, dist.get_rank()
    torch.manual_seed(0)
    model = shardwise.fully_shard(GPT(config), mesh, unit_modules=units, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (8, SEQ + 1), generator=g).to(dev)
    for _ in range(2):
        part = tokens[2 * data_rank : 2 * data_rank + 2]
        model(part[:, :-1], part[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    CheckpointManager(path).save(2, model, opt)
    return _snapshot(model, opt)


def _load(path: str, kind: str, strategy: str):
    torch.manual_seed(1)  # different weights: everything must come from the checkpoint
    config = _config() if kind == "tp" else _moe()
    model = shardwise.fully_shard(GPT(config), strategy=strategy, unit_modules=[TransformerLayer, MoETransformerLayer][: 1 if kind == "tp" else 2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restored = CheckpointManager(path).load_latest(model, opt)
    assert restored is not None and restored.step == 2
    return _snapshot(model, opt)


def _assert_same(saved, loaded):
    (weights, states), (got_weights, got_states) = saved, loaded
    assert set(weights) == set(got_weights)
    for name, value in weights.items():
        torch.testing.assert_close(got_weights[name], value, rtol=0, atol=0, msg=name)
    assert set(states) == set(got_states)
    for name, state in states.items():
        for key, value in state.items():
            torch.testing.assert_close(got_states[name][key], value, rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.slow
def test_tp2_dp2_checkpoint_loads_at_tp1(tmp_path):
    saved = run_distributed(_save, 4, str(tmp_path), "tp")[0]
    _assert_same(saved, run_distributed(_load, 2, str(tmp_path), "tp", "optim_grads_params")[0])
    _assert_same(saved, run_distributed(_load, 1, str(tmp_path), "tp", "no_shard")[0])


@pytest.mark.slow
def test_ep2_dp2_checkpoint_loads_at_ep1(tmp_path):
    saved = run_distributed(_save, 4, str(tmp_path), "ep")[0]
    _assert_same(saved, run_distributed(_load, 2, str(tmp_path), "ep", "optim")[0])


@pytest.mark.slow
def test_tp2_ep2_dp2_checkpoint_loads_at_one_process(tmp_path):
    saved = run_distributed(_save, 4, str(tmp_path), "tpep")[0]
    _assert_same(saved, run_distributed(_load, 1, str(tmp_path), "tpep", "no_shard")[0])
