"""FSDP composed with tensor parallel and expert parallel (4 gloo processes).

Every rank trains the single-process TP=1/EP=1 reference on the whole global
batch itself and compares losses and the gathered global state
(``tests.helpers.parity``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.models import GPT, GPTConfig, MoE, MoETransformerLayer, TransformerLayer

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import assert_close_states, compare, train_both

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 16


def _config(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)
    base.update(overrides)
    return GPTConfig(**base)


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _gpt(config: GPTConfig):
    """Builds the GPT of ``config`` seeded (a TP/EP-built model and its TP=1/EP=1 reference agree)."""

    def build():
        torch.manual_seed(0)
        return GPT(config)

    return build


def _train_and_compare(config, wrap, reference_config, **options):
    """``wrap(GPT(config))`` against ``GPT(reference_config)`` on one process: losses and full state."""
    sharded, reference = train_both(_gpt(config), wrap, _adamw, _batch, STEPS, reference=_gpt(reference_config),
                                    **options)
    compare(sharded, reference)
    return sharded, reference


def _tp_dp(strategy, outer):
    mesh = shardwise.build_dp_mesh(outer=2 if outer else None, tp=2)
    config = _config(tp_group=mesh.get_group("tp"))
    state_shapes = {}

    def wrap(gpt):
        model = shardwise.fully_shard(
            gpt, mesh, strategy=strategy, outer_dp_sharding_strategy=outer, unit_modules=[TransformerLayer]
        )
        # the DTensors describe the global tensors: TP placements on the tp axis
        weight = model.layers[0].attention.wq.weight
        assert isinstance(weight, DTensor) and weight.placements[weight.device_mesh.mesh_dim_names.index("tp")] == Shard(0)
        assert weight.shape == (config.n_heads * config.head_dim, config.dim)
        state_shapes.update({k: tuple(v.shape) for k, v in model.state_dict().items()})
        return model

    dp_rank = mesh.get_local_rank("dp_shard") + (mesh.get_local_rank("dp_outer") if outer else 0) * mesh.size(
        mesh.mesh_dim_names.index("dp_shard")
    )
    dp_size = dist.get_world_size() // 2
    _, reference = _train_and_compare(config, wrap, _config(), data_rank=dp_rank, data_ranks=dp_size)
    assert state_shapes == {k: tuple(v.shape) for k, v in reference.state.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy,outer", [("optim_grads_params", None), ("optim", None), ("optim_grads_params", "no_shard")])
def test_tp2_dp2_matches_tp1_single_process(strategy, outer):
    run_distributed(_tp_dp, 4, strategy, outer)


def _ep_dp(strategy):
    mesh = shardwise.build_dp_mesh()
    expert_mesh = shardwise.build_expert_mesh(ep=2)
    # aux loss off: it is not linear in the batch, so per-rank aux != global-batch aux
    moe = dict(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0)

    def wrap(gpt):
        return shardwise.fully_shard(gpt, mesh, strategy=strategy, unit_modules=[TransformerLayer, MoETransformerLayer],
                                     expert_mesh=expert_mesh)

    _train_and_compare(_config(**moe, ep_group=expert_mesh.get_group("ep")), wrap, _config(**moe))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_ep2_dp2_matches_ep1_single_process(strategy):
    run_distributed(_ep_dp, 4, strategy)


def _sgd(model):
    # not Adam: it divides each gradient by its own scale, so experts' gradients counted twice would hardly
    # show in the weights (they do in .grad: tests/helpers/torch_tools_cases.py, "tp2-ep2")
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _tp_ep_dp(strategy):
    """TP 2 for attention, dense MLPs, embedding and head, EP 2 with whole experts (expert TP 1), on the
    same 4 ranks as Megatron lays them out: dense (dp_shard 2, tp 2), experts (dp_shard 2, ep 2), each EP
    group a TP group. Clipped: the norm counts TP-replicated parameters and expert shards once."""
    mesh = shardwise.build_dp_mesh(tp=2)
    expert_mesh = shardwise.build_expert_mesh(ep=2)
    assert mesh.mesh.tolist() == expert_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    moe = dict(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0)
    config = _config(**moe, tp_group=mesh.get_group("tp"), ep_group=expert_mesh.get_group("ep"))

    def wrap(gpt):
        model = shardwise.fully_shard(gpt, mesh, strategy=strategy, unit_modules=[TransformerLayer, MoETransformerLayer],
                                      expert_mesh=expert_mesh)
        wq, w1, router = model.layers[0].attention.wq.weight, model.layers[1].mlp.experts.w1, model.layers[1].mlp.router
        assert wq.placements[wq.device_mesh.mesh_dim_names.index("tp")] == Shard(0) and wq.shape == (32, 32)
        assert w1.placements[w1.device_mesh.mesh_dim_names.index("ep")] == Shard(0) and w1.shape[0] == 4
        assert "ep" not in router.device_mesh.mesh_dim_names and "tp" in router.device_mesh.mesh_dim_names
        return model

    steps, clip = 3, 0.1
    sharded, reference = train_both(_gpt(config), wrap, _sgd, _batch, steps, reference=_gpt(_config(**moe)),
                                    data_rank=mesh.get_local_rank("dp_shard"), data_ranks=2, clip=clip)
    compare(sharded, reference)
    # torch's own reading of the DTensors: the unsplit model's state
    full = get_model_state_dict(sharded.model, options=StateDictOptions(full_state_dict=True))
    assert_close_states({k: v.cpu() for k, v in full.items()}, reference.state)
    # the global norm itself, on one more backward: the clipping above was active, and counts every tensor once
    tokens, targets = (t.to(device()) for t in _batch(steps))
    part = slice(4 * mesh.get_local_rank("dp_shard"), 4 * mesh.get_local_rank("dp_shard") + 4)
    sharded.model(tokens[part], targets[part]).backward()
    reference.model(tokens, targets).backward()
    norm = shardwise.clip_grad_norm_(sharded.model.parameters(), float("inf"))
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.model.parameters(), float("inf"))
    assert ref_norm > clip, ref_norm
    torch.testing.assert_close(norm.cpu(), ref_norm.cpu(), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_tp2_ep2_dp2_matches_one_process(strategy):
    run_distributed(_tp_ep_dp, 4, strategy)


def _tp_marked_experts():
    """Megatron's expert layers mark their weights tensor_model_parallel=True even at expert TP 1 (split over a
    group of one rank): that is the whole expert and wraps; a split over more ranks is refused by name."""
    mesh, expert_mesh = shardwise.build_dp_mesh(tp=2), shardwise.build_expert_mesh(ep=2)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    moe = dict(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0)
    units = [TransformerLayer, MoETransformerLayer]

    def build(expert_tp_group):
        torch.manual_seed(0)
        model = GPT(_config(**moe, tp_group=mesh.get_group("tp"), ep_group=expert_mesh.get_group("ep")))
        experts = model.layers[1].mlp.experts
        experts.tp_group = expert_tp_group
        for p in experts.parameters():
            p.tensor_model_parallel, p.partition_dim = True, 1
        return model

    model = shardwise.fully_shard(build(alone), mesh, unit_modules=units, expert_mesh=expert_mesh)
    assert model.layers[1].mlp.experts.w1.shape == (4, 64, 32)
    torch.manual_seed(0)
    expected = GPT(_config(**moe)).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in shardwise.full_state_dict(model).items())
    try:
        shardwise.fully_shard(build(mesh.get_group("tp")), mesh, unit_modules=units, expert_mesh=expert_mesh)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_experts_marked_tensor_parallel_over_one_rank_wrap_and_over_two_are_refused():
    message = run_distributed(_tp_marked_experts, 4)[0]
    assert message is not None and "'layers.1.mlp.experts.w1'" in message and "over 2 ranks" in message, message
    assert "expert tensor parallelism" in message and "not built yet" in message


def _experts_renamed(model: GPT) -> GPT:
    """Move every MoE layer's experts from ``.experts`` to ``.bank`` (the forward still finds them)
    and drop their ``allreduce=False`` mark: neither a name nor a mark says they are experts."""
    for layer in model.layers:
        moe = layer.mlp
        if isinstance(moe, MoE):
            bank = moe._modules.pop("experts")
            moe._modules["bank"] = bank
            moe.__dict__["experts"] = bank  # MoE.forward reads self.experts
            for p in bank.parameters():
                del p.allreduce
    return model


def _ep_dp_plan_fn():
    expert_mesh = shardwise.build_expert_mesh(ep=2)
    moe = dict(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0)
    units = [TransformerLayer, MoETransformerLayer]

    def build():
        torch.manual_seed(0)
        model = _experts_renamed(GPT(_config(**moe, ep_group=expert_mesh.get_group("ep"))))
        assert not any(".experts." in n or getattr(p, "allreduce", True) is False for n, p in model.named_parameters())
        return model

    def plan_fn(fqn, param):
        return "expert" if ".bank." in fqn else "dense"

    def refusal(**kwargs):
        try:
            shardwise.fully_shard(build(), unit_modules=units, expert_mesh=expert_mesh, **kwargs)
        except ValueError as exc:
            return str(exc)
        return None

    # the default plan_fn reads the allreduce mark, not the name: the unmarked bank is no expert, and an
    # expert mesh nothing goes on is refused
    assert "plan_fn puts no parameter on it" in (refusal() or ""), refusal()
    assert "plan_fn returned 'experts'" in (refusal(plan_fn=lambda fqn, p: "experts") or "")

    def wrap(model):
        model = shardwise.fully_shard(model, strategy="optim_grads_params", unit_modules=units, expert_mesh=expert_mesh,
                                      plan_fn=plan_fn)
        w1 = model.layers[1].mlp.bank.w1
        assert "ep" in w1.device_mesh.mesh_dim_names and w1.shape[0] == 4  # all 4 experts, split over EP
        # the dense parameters' mesh: FSDP2's default one (unnamed) with mesh=None, never the expert mesh
        assert "ep" not in (model.layers[1].mlp.router.device_mesh.mesh_dim_names or ())
        return model

    def full_state(model):  # under the reference's names
        return {k.replace(".bank.", ".experts."): v for k, v in shardwise.full_state_dict(model).items()}

    sharded, reference = train_both(build, wrap, _adamw, _batch, STEPS, reference=_gpt(_config(**moe)),
                                    full_state=full_state)
    compare(sharded, reference)


@pytest.mark.slow
def test_plan_fn_puts_parameters_not_named_experts_on_the_expert_mesh():
    run_distributed(_ep_dp_plan_fn, 4)


def _mismatched_groups():
    from shardwise.engine.mesh import check_mesh_ranks_and_group_ranks_are_consistent

    errors = []
    try:
        check_mesh_ranks_and_group_ranks_are_consistent([0, 1], [0, 2])
    except ValueError as exc:
        errors.append(str(exc))
    mesh = shardwise.build_dp_mesh(tp=2)
    try:  # an axis that is neither data- nor model-parallel
        shardwise.fully_shard(GPT(_config(tp_group=mesh.get_group("tp"))), mesh, unit_modules=[TransformerLayer], tp_axis="mp")
    except ValueError as exc:
        errors.append(str(exc))
    return errors


@pytest.mark.slow
def test_inconsistent_meshes_are_rejected():
    errors = run_distributed(_mismatched_groups, 4)[0]
    assert "[0, 1]" in errors[0] and "[0, 2]" in errors[0]
    assert "['tp']" in errors[1] and "tp_axis" in errors[1]
