"""``--swiglu`` checkpoints through Megatron-Core's own ``fsdp_dtensor`` code, on shardwise's chunks.

Megatron-LM's ``checkpointing.py`` (``preprocess_fsdp_dtensor_state_dict``) runs
``handle_swiglu_in_state_dict`` on the model and optimizer state before DCP: each
``linear_fc1`` is cut into ``_w`` / ``_v`` halves from the parameters'
``megatron_fsdp_slice`` / ``megatron_fsdp_dist_index`` and rebuilt by Megatron-FSDP's
``make_fsdp_dtensor``; on load DCP writes into those halves, which are views of the
state, and the raw state is then handed to ``optimizer.load_state_dict`` and the chunk's
``load_state_dict``. Here that exact sequence, with the installed Megatron-Core's functions
(nothing of them replaced), on gloo:

- ZeRO-0/1/2/3 (V1 and V2), HSDP, HFSDP and TP2: saved after two steps, loaded into a
  chunk built from another seed, every parameter and optimizer-state tensor bit-equal;
- the checkpoint's keys and shapes are Megatron-FSDP's: ``linear_fc1.weight_w`` /
  ``_v`` of the global ``[ffn, hidden]`` shape each, the ``w`` half holding every TP rank's
  first half of its rows (the true gate weight), no ``linear_fc1.weight`` left;
- a save at one data-parallel size loads at another.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_cpu import megatron_world

pytest.importorskip("megatron.core", reason="megatron-core is a test requirement of the Megatron face")

from tests.megatron.test_megatron_lm_checkpoint import (  # noqa: E402  (after the importorskip)
    _config, _ddp_config, _full, _megatron_lm_state, _model, _optimizer, _shardwise_chunk, _train,
)

FC1 = "linear_fc1.weight"


def _swiglu_config(tp: int):
    return _config(gated_linear_unit=True, tensor_model_parallel_size=tp)


def _split_state(chunk, optimizer, loading: bool) -> tuple[dict, dict]:
    """(the raw ``fsdp_dtensor`` state, the one ``preprocess_fsdp_dtensor_state_dict`` makes of it for DCP)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

    raw = _megatron_lm_state(chunk, optimizer, loading=loading)
    raw = {"model": dict(raw["model"]), "optimizer": dict(raw["optimizer"])}
    # checkpointing.py hands it model[0] of the unwrapped chunks: the Megatron-FSDP level
    model, optim = handle_swiglu_in_state_dict(chunk.module, raw["model"], raw["optimizer"])
    split = {"model": model, "optimizer": optim}
    preprocess_state_dict_for_uneven_dtensor(split)
    return raw, split


def _full_state(chunk, optimizer) -> dict:
    state = _megatron_lm_state(chunk, optimizer, loading=False)
    return {"model": {k: _full(v) for k, v in state["model"].items() if not k.endswith("_extra_state")},
            "optimizer": {k: {s: _full(v) for s, v in sub.items()} for k, sub in state["optimizer"]["state"].items()}}


def _assembled(value: DTensor) -> torch.Tensor:
    """The whole tensor from every rank's piece placed at the offsets DCP writes it at (its chunk metadata)."""
    (chunk,) = value._local_tensor.__create_chunk_list__()  # what make_fsdp_dtensor recorded for DCP
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tuple(chunk.offsets), value.to_local().detach().clone()))
    whole = torch.full(value.shape, float("nan"), dtype=value.dtype)
    for offsets, piece in pieces:
        whole[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    return whole


def _ddp(strategy: str, instances: int, version: int, outer: str):
    ddp = _ddp_config(strategy, instances, version)
    ddp.outer_dp_sharding_strategy = outer
    return ddp


def _save(folder: str, version: int, strategy: str, instances: int, tp: int, outer: str) -> dict:
    import torch.distributed.checkpoint as dcp

    with megatron_world(tp, instances):
        config = _swiglu_config(tp)
        chunk = _shardwise_chunk(config, _ddp(strategy, instances, version, outer), _model(config, seed=1))
        optimizer = _optimizer(chunk)
        _train(chunk, optimizer, steps=2)
        full = _full_state(chunk, optimizer)
        _, split = _split_state(chunk, optimizer, loading=False)
        shapes = {k: tuple(v.shape) for k, v in split["model"].items() if isinstance(v, DTensor)}
        halves = {k: _assembled(v) for k, v in split["model"].items() if k.endswith(("_w", "_v"))}
        dcp.save(split, checkpoint_id=folder)
    return {"full": full, "shapes": shapes, "halves": halves}


def _load(folder: str, version: int, strategy: str, instances: int, tp: int, outer: str) -> dict:
    import torch.distributed.checkpoint as dcp

    with megatron_world(tp, instances):
        config = _swiglu_config(tp)
        chunk = _shardwise_chunk(config, _ddp(strategy, instances, version, outer), _model(config, seed=7))
        optimizer = _optimizer(chunk)
        raw, split = _split_state(chunk, optimizer, loading=True)
        dcp.load(split, checkpoint_id=folder)  # in place: the halves are views of the raw state
        optimizer.load_state_dict(raw["optimizer"])  # then checkpointing.py's two loads
        chunk.load_state_dict(raw["model"], strict=True)
        return _full_state(chunk, optimizer)


def _assert_bit_equal(loaded: dict, saved: dict) -> None:
    assert loaded["model"].keys() == saved["model"].keys()
    assert loaded["optimizer"].keys() == saved["optimizer"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    for key, sub in saved["optimizer"].items():
        for name, value in sub.items():
            assert torch.equal(torch.as_tensor(loaded["optimizer"][key][name]), torch.as_tensor(value)), (key, name)


def _assert_megatron_fsdp_layout(saved: dict, tp: int) -> None:
    """Megatron-FSDP's keys and shapes: ``_w`` / ``_v`` halves of the global fc1, the gate rows of every TP rank."""
    full, shapes, halves = saved["full"]["model"], saved["shapes"], saved["halves"]
    fc1 = sorted(k for k in full if k.endswith(FC1))
    assert fc1 and not any(k.endswith(FC1) for k in shapes)
    for key in fc1:
        weight = full[key]  # [2 ffn, hidden]: TP rank r holds rows r*2ffn/tp .. as [w_r; v_r]
        rows = weight.shape[0] // tp
        pieces = weight.split(rows)
        w = torch.cat([p[: rows // 2] for p in pieces])
        v = torch.cat([p[rows // 2:] for p in pieces])
        assert shapes[f"{key}_w"] == shapes[f"{key}_v"] == (weight.shape[0] // 2, weight.shape[1]), key
        assert torch.equal(halves[f"{key}_w"], w) and torch.equal(halves[f"{key}_v"], v), key


CASES = [  # (version, strategy, instances, tp, save world, load world)
    (1, "optim_grads_params", 1, 1, 2, 2),
    (2, "optim_grads_params", 1, 1, 2, 1),
    (1, "optim_grads", 1, 1, 2, 2),
    (1, "optim", 1, 1, 2, 2),
    (2, "optim", 1, 1, 1, 2),
    (1, "no_shard", 1, 1, 2, 2),
    (1, "optim_grads_params", 2, 1, 4, 4),  # HSDP: two replicas of two
    (1, "optim_grads_params", 1, 2, 4, 4),  # TP2 x DP2
    (2, "optim_grads_params", 1, 2, 2, 2),  # TP2
]
HFSDP = (1, "optim_grads_params", 2, 1, 4, 4)  # the outer axis shards the optimizer state too


@pytest.mark.parametrize("outer", ["no_shard"])
@pytest.mark.parametrize("version,strategy,instances,tp,save_world,load_world", CASES)
def test_swiglu_fsdp_dtensor_checkpoint_round_trips_bit_equal(version, strategy, instances, tp, save_world,
                                                             load_world, outer, tmp_path):
    saved = run_distributed(_save, save_world, str(tmp_path), version, strategy, instances, tp, outer)[0]
    assert any(v.abs().sum() > 0 for sub in saved["full"]["optimizer"].values() for k, v in sub.items()
               if k == "exp_avg")
    _assert_megatron_fsdp_layout(saved, tp)
    for loaded in run_distributed(_load, load_world, str(tmp_path), version, strategy, instances, tp, outer):
        _assert_bit_equal(loaded, saved["full"])


def test_swiglu_fsdp_dtensor_checkpoint_round_trips_bit_equal_under_hfsdp(tmp_path):
    test_swiglu_fsdp_dtensor_checkpoint_round_trips_bit_equal(*HFSDP, "optim", tmp_path)
