"""torch.compile over sharded units: compiled forwards, hooks outside, no graph breaks, no recompiles.

``shardwise.compile_units`` compiles each unit's ``forward``; the engine's
gather/free/reduce hooks run eagerly around it. Each case trains the same
tiny model eagerly and with compiled units (``aot_eager``: the same aten
kernels, so the losses agree to the bit, bf16 too) and checks that dynamo
saw no graph break anywhere and compiled nothing after the first step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _train(compiled: bool, strategy: str, checkpointing: str, bf16: bool, steps: int) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    config = TinyConfig(checkpointing=checkpointing)
    torch.manual_seed(0)
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    model = shardwise.fully_shard(TinyLM(config), strategy=strategy, unit_modules=[Block], mixed_precision=policy)
    compiled_units = shardwise.compile_units(model, backend="aot_eager") if compiled else []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch._dynamo.reset()
    counters.clear()
    losses, frames = [], []
    try:
        for step in range(steps):
            if step == 1:  # everything is compiled in the first step; a recompile now raises
                torch.compiler.set_stance("fail_on_recompile")
            tokens, targets = (t.to(dev) for t in batch(step, 2 * world, config))
            part = slice(2 * rank, 2 * rank + 2)
            loss = model(tokens[part], targets[part])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            frames.append(counters["frames"]["ok"])
    finally:
        torch.compiler.set_stance("default")
    return {
        "losses": losses,
        "graph_breaks": dict(counters["graph_break"]),
        "frames": frames,
        "compiled_units": compiled_units,
    }


def _compare(strategy: str, checkpointing: str, bf16: bool, steps: int = 3) -> None:
    eager = _train(False, strategy, checkpointing, bf16, steps)
    compiled = _train(True, strategy, checkpointing, bf16, steps)
    assert compiled["compiled_units"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert compiled["graph_breaks"] == {}, compiled["graph_breaks"]
    # One Block graph serves every block (twice for the block that runs twice) and the
    # recompute; reentrant checkpointing adds the no-grad forward's graph.
    graphs = 2 if checkpointing == "reentrant" else 1
    assert compiled["frames"] == [graphs] * steps, compiled["frames"]
    assert eager["frames"] == [0] * steps
    assert compiled["losses"] == eager["losses"]  # aot_eager runs the eager kernels: bit-identical


@pytest.mark.parametrize(
    "world,strategy,checkpointing,bf16",
    [
        (1, "optim", "reentrant", False),
        (2, "optim_grads_params", "non_reentrant", True),
    ],
)
def test_compiled_units_train_like_eager_without_graph_breaks_or_recompiles(world, strategy, checkpointing, bf16):
    run_distributed(_compare, world, strategy, checkpointing, bf16)


def _refusals() -> None:
    import torch.nn as nn

    with pytest.raises(ValueError, match="not sharded"):
        shardwise.compile_units(nn.Linear(2, 2))
    model = shardwise.fully_shard(TinyLM(TinyConfig()), unit_modules=[Block])
    with pytest.raises(ValueError, match="not a unit"):
        shardwise.compile_units(model, modules=[nn.LayerNorm])
    assert shardwise.compile_units(model, modules=[model.blocks[0]], backend="aot_eager") == ["blocks.0"]
    assert shardwise.compile_units(model, backend="aot_eager") == ["blocks.1", "blocks.2"]  # blocks.0 already


def test_compile_units_refuses_what_it_cannot_compile():
    run_distributed(_refusals, 1)
