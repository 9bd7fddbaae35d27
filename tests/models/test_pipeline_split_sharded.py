"""GPT stages built on meta, sharded and run by torch's 1F1B schedule on 2 gloo ranks: the whole model's
initial weights, and its accumulated gradients (MoE aux loss included)."""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardwise
from shardwise.models import GPT, GPTConfig, StageInitializer, pipeline_stage
from shardwise.engine.pipeline import ShardedPipelineStage, build_schedule, pipeline_groups
from tests.helpers.distributed import device, run_distributed

CONFIG = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16, layer_pattern="AE",
              moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.5)
MICRO = 2


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _stage_grads_and_weights():
    dev = device()
    mesh = init_device_mesh(dev.type, (2, 1), mesh_dim_names=("pp", "dp_shard"))
    group, rank, _ = pipeline_groups(mesh)
    torch.manual_seed(5)
    with torch.device("meta"):
        whole = GPT(GPTConfig(**CONFIG))
    part = pipeline_stage(whole, rank, 2)
    init = StageInitializer(whole, [part], dev)
    init.plan()
    units = list(dict.fromkeys(type(layer) for layer in part.layers.values()))
    part = shardwise.fully_shard(part, mesh["dp_shard"], unit_modules=units, init_fn=init)
    init.finish()
    weights = shardwise.full_state_dict(part)
    schedule = build_schedule("1f1b", [ShardedPipelineStage(part, rank, 2, group=group)], MICRO, _loss)
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen)
    schedule.step(*((tokens.to(dev),) if rank == 0 else ()), target=targets.to(dev) if rank == 1 else None)
    grads = {n: p.grad.full_tensor().cpu() for n, p in part.named_parameters()}
    return {k: v.cpu() for k, v in weights.items()}, grads


def test_meta_built_sharded_stages_start_as_the_whole_model_and_accumulate_its_gradients():
    results = run_distributed(_stage_grads_and_weights, 2)
    torch.manual_seed(5)
    model = GPT(GPTConfig(**CONFIG))
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen)
    for mb in range(MICRO):  # the schedule's micro-batches, each loss CE + coef * aux, gradients averaged
        rows = slice(mb * 2, (mb + 1) * 2)
        (model(tokens[rows], targets[rows]) / MICRO).backward()
    expected = dict(model.named_parameters())
    seen = set()
    for weights, grads in results:
        for name, value in weights.items():
            assert torch.equal(value, expected[name].detach()), name
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)
        seen |= set(grads)
    assert seen == set(expected)
    assert expected["layers.1.mlp.router"].grad.abs().sum() > 0  # the aux loss reaches the router
