"""FSDP with context parallelism (4 gloo processes).

The GPT's attention is split over ``cp`` (zig-zag chunks, ``models/context_parallel.py``)
and ``fully_shard`` shards its parameters over ``dp_shard`` x ``cp`` folded into one
axis. Each rank trains its zig-zag slice of its data rank's rows; every rank trains
the unsplit, unsharded reference on the whole global batch (``tests.helpers.parity``),
and the two must agree in fp32 to 1e-5 (losses and every full tensor).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.engine.placements import STRATEGY_PLACEMENTS
from shardwise.checkpoint import CheckpointManager
from shardwise.models import GPT, GPTConfig, TransformerLayer
from shardwise.models.context_parallel import zigzag_split

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import assert_close_states, compare, train_both

STEPS, GLOBAL_BATCH, SEQ = 3, 4, 64


def _config(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)
    base.update(overrides)
    return GPTConfig(**base)


def _gpt(config: GPTConfig, seed: int = 0):
    def build():
        torch.manual_seed(seed)
        return GPT(config)

    return build


def _batch(step: int):
    """Rows following one rule, ``next = 5 prev + 3 (mod 64)``, from random starts: learnable in a few steps."""
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.empty(GLOBAL_BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, 64, (GLOBAL_BATCH,), generator=g)
    for i in range(1, SEQ + 1):
        tokens[:, i] = (5 * tokens[:, i - 1] + 3) % 64
    return tokens[:, :-1], tokens[:, 1:]


def _sgd(model):
    # SGD, not Adam: the weights then move by the gradients themselves, so the comparison bounds the
    # gradients' error; Adam divides each element by its own scale and turns fp32 summation-order noise
    # on a near-zero gradient element (CP sums K/V gradients and token losses in another order) into a
    # whole relative step (as tests/engine/test_tp_ep_fsdp.py notes for its experts)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _cp_loss(model, tokens, targets):
    """The model's loss on this CP rank's zig-zag slice of ``rows`` (the whole rows without a CP group)."""
    group = model.config.cp_group
    return model(zigzag_split(tokens, group), zigzag_split(targets, group))


def _wrap(mesh, outer=None):
    def wrap(gpt):
        model = shardwise.fully_shard(gpt, mesh, strategy="optim_grads_params", outer_dp_sharding_strategy=outer,
                                      unit_modules=[TransformerLayer])
        weight = model.layers[0].attention.wq.weight
        assert isinstance(weight, DTensor) and "dp_shard_cp" in weight.device_mesh.mesh_dim_names
        assert weight.placements[weight.device_mesh.mesh_dim_names.index("dp_shard_cp")] == Shard(0)
        return model

    return wrap


def _data_rank(mesh) -> tuple[int, int]:
    """This rank's data-parallel index and the data-parallel size (CP and TP ranks share their rows)."""
    names = mesh.mesh_dim_names
    outer = mesh.get_local_rank("dp_outer") if "dp_outer" in names else 0
    inner = mesh.size(names.index("dp_shard"))
    dp = inner * (mesh.size(names.index("dp_outer")) if "dp_outer" in names else 1)
    return outer * inner + mesh.get_local_rank("dp_shard"), dp


def _cp_dp(outer: bool, directory: str | None):
    """CP 2 x DP 2 (ZeRO-3, or HSDP over 2 replicas), recomputed layers; then a checkpoint of it loads at DP 4."""
    mesh = shardwise.build_dp_mesh(outer=2 if outer else None, cp=2)
    strategy_outer = "no_shard" if outer else None
    config = _config(cp_group=mesh.get_group("cp"), activation_checkpointing=True)
    data_rank, dp = _data_rank(mesh)
    sharded, reference = train_both(_gpt(config), _wrap(mesh, strategy_outer), _sgd, _batch, STEPS,
                                    loss=_cp_loss, reference=_gpt(_config()), data_rank=data_rank, data_ranks=dp)
    compare(sharded, reference, trained_by=0.3)
    full = get_model_state_dict(sharded.model, options=StateDictOptions(full_state_dict=True))
    assert_close_states({k: v.cpu() for k, v in full.items()}, reference.state)
    if directory is None:
        return True

    # saved under CP 2 x DP 2, loaded at DP 4 without CP: the same model and optimizer state
    manager = CheckpointManager(directory)
    path = manager.save(STEPS, sharded.model, sharded.optimizer)
    dp4 = shardwise.fully_shard(_gpt(_config(), seed=1)(), shardwise.build_dp_mesh(), strategy="optim_grads_params",
                                unit_modules=[TransformerLayer])
    dp4_optimizer = _sgd(dp4)
    manager.load(path, dp4, dp4_optimizer)
    assert_close_states(shardwise.full_state_dict(dp4), sharded.state, rtol=0, element_rtol=0)
    # one more step each: the optimizer state (SGD momentum) came along too
    tokens, targets = (t.to(device()) for t in _batch(STEPS))
    losses = []
    for model, optimizer, rows in ((sharded.model, sharded.optimizer, slice(2 * data_rank, 2 * data_rank + 2)),
                                   (dp4, dp4_optimizer, slice(dist.get_rank(), dist.get_rank() + 1))):
        loss = _cp_loss(model, tokens[rows], targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    assert_close_states(shardwise.full_state_dict(dp4), shardwise.full_state_dict(sharded.model))
    return True


@pytest.mark.slow
def test_cp2_dp2_matches_single_process_and_its_checkpoint_loads_at_dp4(tmp_path):
    assert run_distributed(_cp_dp, 4, False, str(tmp_path)) == [True] * 4


@pytest.mark.slow
def test_cp2_hsdp2_matches_single_process():
    assert run_distributed(_cp_dp, 4, True, None) == [True] * 4


def _cp_tp():
    """CP 2 x TP 2: the attention split over heads (TP) and over the sequence (CP) at once."""
    mesh = shardwise.build_dp_mesh(cp=2, tp=2)
    assert mesh.mesh_dim_names == ("dp_shard", "cp", "tp") and mesh.mesh.tolist() == [[[0, 1], [2, 3]]]
    config = _config(cp_group=mesh.get_group("cp"), tp_group=mesh.get_group("tp"))
    with pytest.raises(ValueError, match="cp=3 must be a positive divisor of world size / tp = 2"):
        shardwise.build_dp_mesh(cp=3, tp=2)
    with pytest.raises(ValueError, match="placements name the context-parallel axis 'cp'"):
        zero3 = STRATEGY_PLACEMENTS["optim_grads_params"]
        shardwise.fully_shard(GPT(config), mesh, placements={"dp_shard": zero3, "cp": zero3})
    sharded, reference = train_both(_gpt(config), _wrap(mesh), _sgd, _batch, STEPS, loss=_cp_loss,
                                    reference=_gpt(_config()), data_rank=0, data_ranks=1)
    compare(sharded, reference, trained_by=0.3)
    weight = sharded.model.layers[0].attention.wq.weight
    assert weight.placements[weight.device_mesh.mesh_dim_names.index("tp")] == Shard(0)
    return True


@pytest.mark.slow
def test_cp2_tp2_matches_single_process():
    assert run_distributed(_cp_tp, 4) == [True] * 4
