"""Train the tiny model sharded and unsharded on the same global batch; compare.

Every rank also trains the single-process reference itself, on the whole
global batch, so a test needs no second job. The sharded model sees only this
rank's slice of each batch (split again into micro-batches when asked).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


@dataclass
class Run:
    strategy: object = "optim_grads_params"
    outer: str | None = None  # "no_shard" (HSDP) / "optim" (HFSDP) on a (2, N/2) mesh
    bf16: bool = False
    optimizer: str = "adamw"  # adamw | adamw_fused | adam_foreach | sgd | adamw_in_backward
    checkpointing: str = "none"
    micro_batches: int = 1
    steps: int = 5
    clip: float | None = None
    global_batch: int = 8
    model: TinyConfig = field(default_factory=TinyConfig)


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01, foreach=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    raise ValueError(kind)


def train_both(run: Run):
    """Return (sharded losses, reference losses, sharded full params, reference params)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    config = copy.deepcopy(run.model)
    config.checkpointing = run.checkpointing
    torch.manual_seed(0)
    model = TinyLM(config)
    reference = copy.deepcopy(model).to(dev)
    mesh = shardwise.build_dp_mesh(outer=2 if world > 1 else 1) if run.outer else None
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if run.bf16 else None)
    sharded = shardwise.fully_shard(
        model,
        mesh,
        strategy=run.strategy,
        outer_dp_sharding_strategy=run.outer,
        unit_modules=[Block],
        mixed_precision=policy,
    )
    if run.optimizer == "adamw_in_backward":  # stepped group by group inside backward
        opt = shardwise.BackwardOptimizer(sharded, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        ref_opt = _optimizer("adamw", reference.parameters())
    else:
        opt = _optimizer(run.optimizer, sharded.parameters())
        ref_opt = _optimizer(run.optimizer, reference.parameters())
    per_rank = run.global_batch // world
    per_micro = per_rank // run.micro_batches
    losses, ref_losses = [], []
    for step in range(run.steps):
        tokens, targets = (t.to(dev) for t in batch(step, run.global_batch, config))
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        total = torch.zeros((), device=dev)
        for i in range(run.micro_batches):
            part = slice(mine.start + i * per_micro, mine.start + (i + 1) * per_micro)
            last = i == run.micro_batches - 1
            ctx = sharded.no_sync() if not last else _nullcontext()
            with ctx:
                loss = sharded(tokens[part], targets[part]) / run.micro_batches
                loss.backward()
            total += loss.detach().float()
        if run.clip is not None:
            shardwise.clip_grad_norm_(sharded.parameters(), run.clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)

        ref_loss = _reference_backward(reference, tokens, targets, run.bf16)
        if run.clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), run.clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = shardwise.full_state_dict(sharded)
    ref_state = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    return losses, ref_losses, full, ref_state


def _reference_backward(reference, tokens, targets, bf16: bool) -> torch.Tensor:
    """Loss and grads of the single-process reference; with bf16, the textbook recipe:
    compute with a bf16 copy of the fp32 weights, hand its grads back in fp32."""
    if not bf16:
        loss = reference(tokens, targets)
        loss.backward()
        return loss
    shadow = copy.deepcopy(reference).to(torch.bfloat16)
    shadow.head.weight = shadow.embed.weight  # deepcopy keeps the tie; .to keeps it too, but be explicit
    loss = shadow(tokens, targets)
    loss.backward()
    for p, q in zip(reference.parameters(), shadow.parameters()):
        if q.grad is not None:
            p.grad = q.grad.float()
    return loss


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_parity(run: Run) -> None:
    losses, ref_losses, full, ref_state = train_both(run)
    if run.bf16:
        # bf16 compute against the bf16-compute reference: they differ only in how
        # bf16 grads are summed (per rank, then averaged in fp32, vs. one big batch).
        # bf16 keeps 8 bits: 2e-2 is about five bf16 epsilons after 5 steps.
        loss_rtol, param_rtol, element_rtol = 1e-2, 2e-2, 5e-2
    else:
        # fp32: tensor-wise relative error 1e-5; no element may be off by more than 1e-4 of
        # the tensor's scale (isolated near-zero elements inherit Adam's amplification of
        # summation-order noise, a localized bug such as a wrong row does not hide under it).
        loss_rtol, param_rtol, element_rtol = 1e-5, 1e-5, 1e-4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
    assert set(full) == set(ref_state), sorted(set(full) ^ set(ref_state))  # tied aliases included
    for name, value in full.items():
        expected = ref_state[name]
        scale = expected.abs().max().item()
        rel = ((value - expected).norm() / expected.norm()).item()
        worst = (value - expected).abs().max().item()
        assert rel <= param_rtol, f"{name}: relative error {rel:.3g} > {param_rtol}"
        assert worst <= element_rtol * scale, f"{name}: element off by {worst:.3g} (scale {scale:.3g})"
    # the loss really moved, so equality above is not two untrained models agreeing
    assert losses[-1] < losses[0] - 1.0
