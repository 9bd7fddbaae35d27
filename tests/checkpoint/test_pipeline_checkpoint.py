"""A pipeline's checkpoint is the whole model's: saved at PP2 x DP2, loaded at PP1 x DP4, PP4 x DP1 and one process.

The run is interleaved (two stages per rank) on a (pp, dp_shard) = (2, 2) mesh,
saved by ``CheckpointManager`` from each rank's stage modules and their
optimizers. Every load gives back every saved value bit for bit (model and
optimizer state) and the next step equals the uninterrupted run's;
``shardwise ckpt export`` (safetensors and ``--format hf``) writes the whole
model's weights. On the way, torch's own tools judge each stage's DTensors.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

import shardwise
from shardwise.app.ckpt import main as ckpt_main
from shardwise.checkpoint import CheckpointManager, gather_full_optimizer_state, load_state, read_tensors, save_state
from shardwise.checkpoint.dcp_state import merge_param_groups
from shardwise.hf.mapping import gpt_hf_keys
from shardwise.models import TransformerLayer
from tests.helpers.distributed import device, run_distributed
from tests.helpers.gpt_stages import GLOBAL_BATCH, LR, WEIGHT_DECAY, Pipeline, Reference, gpt_batch, gpt_config, \
    lm_loss, seeded_gpt
from tests.helpers.parity import assert_close_states, relative_error

SAVED_AT = 2  # steps before the checkpoint; the uninterrupted run takes one more
MAX_NORM = 0.5
FULL = StateDictOptions(full_state_dict=True)


def _full_optimizer(pairs) -> dict[str, dict[str, torch.Tensor]]:
    """The whole model's optimizer state, full tensors, on every rank."""
    mine = {}
    for part, opt in pairs:
        mine.update(gather_full_optimizer_state(part, opt))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for s in gathered for k, v in s.items()}


def _torch_tools_on_stages(pipe: Pipeline, full: dict[str, torch.Tensor]) -> None:
    """Each stage's DTensors, judged by torch: full_tensor, redistribute, get/set_model_state_dict,
    get_optimizer_state_dict; ``full`` is the whole model's state as shardwise gathers it."""
    for part, opt in zip(pipe.parts, pipe.opts):
        for name, p in part.named_parameters():
            assert isinstance(p, DTensor) and "pp" not in p.device_mesh.mesh_dim_names, name
            assert torch.equal(p.full_tensor().cpu(), full[name]), name
            replicated = p.redistribute(placements=[Replicate()] * p.device_mesh.ndim).to_local()
            assert torch.equal(replicated.cpu(), full[name]), name
        state = get_model_state_dict(part, options=FULL)
        assert set(state) == set(part.state_dict()), sorted(set(state) ^ set(part.state_dict()))
        for name, value in state.items():
            assert torch.equal(value.cpu(), full[name]), name
        osd = get_optimizer_state_dict(part, opt)
        ours = gather_full_optimizer_state(part, opt)
        assert set(osd["state"]) == set(ours) == {n for n, p in part.named_parameters()}
        for fqn, values in osd["state"].items():
            for key, value in values.items():
                value = value.full_tensor() if isinstance(value, DTensor) else value
                assert torch.equal(value.cpu(), ours[fqn][key]), (fqn, key)
        # set_model_state_dict writes full tensors into the shards (and replaces the dict's values: copies)
        set_model_state_dict(part, {k: v * 2 for k, v in state.items()}, options=FULL)
        assert all(torch.equal(v, state[k].cpu() * 2) for k, v in shardwise.full_state_dict(part).items())
        set_model_state_dict(part, dict(state), options=FULL)
        assert all(torch.equal(v, full[k]) for k, v in shardwise.full_state_dict(part).items())


def _train_save_and_continue(root: str):
    pipe = Pipeline("interleaved", 2, "optim_grads_params")
    ref = Reference()
    for step in range(SAVED_AT):
        pipe.step(step, MAX_NORM)
        ref.step(step, MAX_NORM)
    saved = pipe.full_state()
    _torch_tools_on_stages(pipe, saved)
    pairs = list(zip(pipe.parts, pipe.opts))
    saved_optim = _full_optimizer(pairs)
    path = CheckpointManager(root).save(SAVED_AT, pipe.parts, pipe.opts)
    loss, norm = pipe.step(SAVED_AT, MAX_NORM)  # the uninterrupted run's next step
    ref_loss, ref_norm = ref.step(SAVED_AT, MAX_NORM)
    after = pipe.full_state()
    torch.testing.assert_close(torch.tensor([loss, norm]), torch.tensor([ref_loss, ref_norm]), rtol=1e-5, atol=0)
    assert_close_states(after, ref.state(), rtol=1e-5)
    return str(path), saved, saved_optim, (loss, norm), after


def _assert_loaded(what: str, state: dict, optim: dict, saved: dict, saved_optim: dict) -> None:
    assert set(state) == set(saved), (what, sorted(set(state) ^ set(saved)))
    for key, value in saved.items():
        assert torch.equal(state[key], value), (what, key)
    assert set(optim) == set(saved_optim), (what, sorted(set(optim) ^ set(saved_optim)))
    for fqn, values in saved_optim.items():
        assert set(optim[fqn]) == set(values), (what, fqn)
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(optim[fqn][key]), torch.as_tensor(value)), (what, fqn, key)


def _assert_continues(what: str, got: tuple, state: dict, expected: tuple, expected_state: dict) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0, msg=what)
    assert_close_states(state, expected_state, rtol=1e-5)


def _load_elsewhere(path, saved, saved_optim, expected, expected_state):
    """PP1 x DP4 and PP4 x DP1 from the PP2 x DP2 checkpoint, each built from another seed first."""
    dev, manager = device(), CheckpointManager(path.rsplit("/", 1)[0])
    # PP1 x DP4: the unsplit GPT
    model = shardwise.fully_shard(seeded_gpt(gpt_config(), seed=1).to(dev), shardwise.build_dp_mesh(),
                                  unit_modules=[TransformerLayer])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    restored = manager.load(path, model, opt)
    assert restored.step == SAVED_AT
    _assert_loaded("PP1 x DP4", shardwise.full_state_dict(model), _full_optimizer([(model, opt)]), saved, saved_optim)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    tokens, targets = (t[rows].to(dev) for t in gpt_batch(SAVED_AT, GLOBAL_BATCH))
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    norm = shardwise.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    _assert_continues("PP1 x DP4", (total.item() / world, norm), shardwise.full_state_dict(model), expected,
                      expected_state)
    # PP4 x DP1: one stage per rank
    pipe = Pipeline("1f1b", 4, "optim_grads_params", seed=1)
    manager.load(path, pipe.parts, pipe.opts)
    _assert_loaded("PP4 x DP1", pipe.full_state(), _full_optimizer(list(zip(pipe.parts, pipe.opts))), saved,
                   saved_optim)
    _assert_continues("PP4 x DP1", pipe.step(SAVED_AT, MAX_NORM), pipe.full_state(), expected, expected_state)


def _one_process(path: str, saved: dict, saved_optim: dict, expected: tuple, expected_state: dict) -> None:
    """No process group: read the checkpoint's tensors into a plain GPT and a plain AdamW, take the next step."""
    model = Reference(seed=1)
    state = dict(read_tensors(path))
    optim = {}
    for key, value in read_tensors(path, prefix="optim/"):
        fqn, _, name = key.rpartition("/")
        optim.setdefault(fqn, {})[name] = value
    _assert_loaded("one process", state, optim, saved, saved_optim)
    model.model.load_state_dict(state)
    names = [n for n, _ in model.model.named_parameters()]
    osd = model.opt.state_dict()
    osd["state"] = {i: optim[n] for i, n in enumerate(names)}
    model.opt.load_state_dict(osd)
    got = model.step(SAVED_AT, MAX_NORM)
    _assert_continues("one process", got, model.state(), expected, expected_state)


@pytest.mark.slow
def test_a_pp2_dp2_checkpoint_loads_at_pp1_dp4_pp4_dp1_and_one_process_and_exports(tmp_path):
    root = tmp_path / "checkpoints"
    path, saved, saved_optim, expected, expected_state = run_distributed(_train_save_and_continue, 4, str(root))[0]
    meta = json.loads((tmp_path / "checkpoints" / path.rsplit("/", 1)[1] / "shardwise.json").read_text())
    assert set(meta["tensors"]) == set(saved) and set(meta["optimizer"]["state"]) == set(saved)  # every stage's
    run_distributed(_load_elsewhere, 4, path, saved, saved_optim, expected, expected_state)
    _one_process(path, saved, saved_optim, expected, expected_state)

    assert ckpt_main(["export", str(root), str(tmp_path / "plain")]) == 0
    exported = load_file(tmp_path / "plain" / "model.safetensors")
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    config = gpt_config()
    fields = {k: getattr(config, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                                              "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")}
    (tmp_path / "gpt.json").write_text(json.dumps(fields))
    assert ckpt_main(["export", str(root), str(tmp_path / "hf"), "--format", "hf",
                      "--config", str(tmp_path / "gpt.json")]) == 0
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    keys = list(gpt_hf_keys(fields))
    assert set(hf) == {h for _, h, _ in keys} and {g for g, _, _ in keys} == set(saved)
    assert all(torch.equal(hf[h], saved[g]) for g, h, _ in keys)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == config.n_layers
    assert relative_error(saved["output.weight"], expected_state["output.weight"]) > 0  # the step changed it


def test_stage_lists_and_their_optimizers_are_checked_before_anything_is_written(tmp_path):
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    one = torch.optim.AdamW(stages[0].parameters())
    with pytest.raises(ValueError, match=r"optimizer: 1 optimizer\(s\) for 2 stage module\(s\); with several stages"):
        save_state(tmp_path / "a", stages, one)
    with pytest.raises(ValueError, match="model must be a module or a non-empty list .* got an empty list"):
        save_state(tmp_path / "b", [], None)
    with pytest.raises(ValueError, match=r"got \['str'\]"):
        load_state(tmp_path / "c", ["embed"])
    assert not any(tmp_path.iterdir())
    group = {"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a"]}
    merged = merge_param_groups([[group], [{**group, "params": ["b", "a"]}]])
    assert merged == [{**group, "params": ["a", "b"]}]
    with pytest.raises(ValueError, match=r"param group 0 has different \['lr'\] on different stages"):
        merge_param_groups([[group], [{**group, "lr": 1e-2}]])
    with pytest.raises(ValueError, match="the stages' optimizers have 1 and 2 param groups"):
        merge_param_groups([[group], [group, group]])
