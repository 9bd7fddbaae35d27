"""Worker-side bodies of ``test_torch_tools``: shardwise's DTensors judged by torch's own tools.

Every public function here runs on each rank of a gloo group (see
``distributed.py``) and reaches shardwise only through its public API
(``fully_shard``, ``build_dp_mesh``, ``build_expert_mesh``, ``full_state_dict``);
everything else is torch: DTensor methods, ``distribute_tensor``, the
``torch.distributed.checkpoint`` state-dict helpers, plain DCP and FSDP2.

A ``Report`` collects problems instead of stopping at the first one, so a
failure names every wrong tensor; a rank raises only at the end of a task,
after it has made every collective the other ranks make.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils._pytree import tree_map_only

import shardwise
from shardwise.engine.model_ops import sharded_state
from shardwise.models import GPT, GPTConfig, MoETransformerLayer, TransformerLayer

from tests.helpers.distributed import device
from tests.helpers.parity import compare, relative_error, train_both
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM

RTOL = 1e-5  # fp32: tensor-wise relative error, as tests/helpers/parity.py measures it
GLOBAL_BATCH = 8
LR, WEIGHT_DECAY = 1e-2, 0.1
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets the values
FULL_LOAD = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)


# ------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class Config:
    """One way to shard: a named strategy, hybrid sharding, or TP/EP composed with DP."""

    name: str
    strategy: str = "optim_grads_params"
    outer: str | None = None  # "no_shard" = HSDP, "optim" = HFSDP, on build_dp_mesh(outer=2)
    tp: int = 1
    ep: int = 1
    offload: float = 0.0  # share of parameters whose main weights and optimizer state live on the host
    worlds: tuple[int, ...] = (1, 2, 4)


CONFIGS = [
    Config("zero0", strategy="no_shard"),
    Config("zero1", strategy="optim"),
    Config("zero2", strategy="optim_grads"),
    Config("zero3", strategy="optim_grads_params"),
    Config("hsdp", outer="no_shard", worlds=(2, 4)),
    Config("hfsdp", outer="optim", worlds=(2, 4)),
    Config("tp2", tp=2, worlds=(2, 4)),
    Config("ep2", ep=2, worlds=(2, 4)),
    Config("tp2-ep2", tp=2, ep=2, worlds=(4,)),  # whole experts on each EP rank (expert TP 1), EP groups = TP groups
    Config("zero3-offload", offload=1.0),
    Config("zero1-offload-half", strategy="optim", offload=0.5, worlds=(2, 4)),
]
BY_NAME = {c.name: c for c in CONFIGS}


# ------------------------------------------------------------------ models
# Row counts 4 does not divide (most not 2 either): 61 (vocab, tied head), 30 (dim, LayerNorms),
# 46 (hidden), 90 (qkv), 7 (the (7, 15) weight), 5 (side: Linear(6, 5)), 1 (segment).
ODD = TinyConfig(vocab=61, dim=30, heads=3, hidden=46, layers=2, seq=8)


class OddLM(TinyLM):
    """``TinyLM`` with uneven widths and a root-owned ``Linear(6, 5)``: on 4 ranks
    ``torch.chunk`` gives its 5 rows as 2, 2, 1 and leaves the last rank nothing."""

    def __init__(self, c: TinyConfig = ODD):
        super().__init__(c)
        self.side = nn.Linear(6, 5)

    def forward(self, tokens, targets):
        x = self.embed(tokens) * self.scale + self.segment
        x = x + F.pad(self.side(x[..., :6]), (0, self.c.dim - 5))
        for block in self.blocks:
            x = block(x)
        x = self.blocks[-1](x)  # a block called twice in one forward
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_config(**groups) -> GPTConfig:
    """Per TP rank 33 vocabulary rows and 19 hidden rows; 6 experts = 3 per EP rank: odd everywhere."""
    return GPTConfig(vocab_size=66, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=38,
                     max_seq_len=ODD.seq, **groups)


def moe_config(**groups) -> GPTConfig:
    # aux loss off: it is not linear in the batch, so per-rank aux != global-batch aux
    return gpt_config(layer_pattern="AE", moe_num_experts=6, moe_top_k=2, moe_aux_loss_coef=0.0, **groups)


def global_batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, ODD.seq + 1), generator=g)
    return tokens[:, :-1].to(device()), tokens[:, 1:].to(device())


def adamw(params) -> torch.optim.Optimizer:
    # eps=1e-5, not 1e-8: Adam divides by sqrt(exp_avg_sq), which turns summation-order noise in
    # near-zero gradient entries into O(lr) weight differences (TP=2 alone, without shardwise, drifts
    # 3e-5 from one process in two steps with eps=1e-8, 1.5e-6 with 1e-5). A real bug (a wrong row, a
    # missing average) still moves weights far more, and gradients and moments are compared directly.
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-5)


@dataclass
class Setup:
    """A sharded model and the unsharded reference every rank trains on the whole global batch."""

    model: nn.Module
    opt: torch.optim.Optimizer
    reference: nn.Module
    ref_opt: torch.optim.Optimizer
    vocab: int
    data_rank: int
    data_ranks: int


def build(config: Config, seed: int = 0, model_seed: int | None = None) -> Setup:
    """Shard a model for ``config``; the reference is the same model built unsharded with ``seed``
    (the sharded one with ``model_seed``, by default the same)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model_seed = seed if model_seed is None else model_seed
    if config.tp > 1 and config.ep > 1:
        mesh = shardwise.build_dp_mesh(tp=config.tp)
        expert_mesh = shardwise.build_expert_mesh(ep=config.ep)
        torch.manual_seed(model_seed)
        model = GPT(moe_config(tp_group=mesh.get_group("tp"), ep_group=expert_mesh.get_group("ep")))
        model = shardwise.fully_shard(model, mesh, strategy=config.strategy, expert_mesh=expert_mesh,
                                      unit_modules=[TransformerLayer, MoETransformerLayer])
        torch.manual_seed(seed)
        reference = GPT(moe_config())
        vocab, data_rank, data_ranks = 66, rank // config.tp, world // config.tp
    elif config.tp > 1:
        mesh = shardwise.build_dp_mesh(tp=config.tp)
        torch.manual_seed(model_seed)
        model = GPT(gpt_config(tp_group=mesh.get_group("tp")))
        model = shardwise.fully_shard(model, mesh, strategy=config.strategy, unit_modules=[TransformerLayer])
        torch.manual_seed(seed)
        reference = GPT(gpt_config())
        vocab, data_rank, data_ranks = 66, rank // config.tp, world // config.tp  # TP groups: consecutive ranks
    elif config.ep > 1:
        expert_mesh = shardwise.build_expert_mesh(ep=config.ep)
        torch.manual_seed(model_seed)
        model = GPT(moe_config(ep_group=expert_mesh.get_group("ep")))
        model = shardwise.fully_shard(model, strategy=config.strategy, expert_mesh=expert_mesh,
                                      unit_modules=[TransformerLayer, MoETransformerLayer])
        torch.manual_seed(seed)
        reference = GPT(moe_config())
        vocab, data_rank, data_ranks = 66, rank, world
    else:
        torch.manual_seed(model_seed)
        model = OddLM().to(device())
        mesh = shardwise.build_dp_mesh(outer=2) if config.outer else None
        offload = shardwise.OffloadPolicy(fraction=config.offload) if config.offload else None
        model = shardwise.fully_shard(model, mesh, strategy=config.strategy, outer_dp_sharding_strategy=config.outer,
                                      unit_modules=[Block], offload_policy=offload)
        offloaded = [g.offloaded for g in sharded_state(model).groups]
        assert any(offloaded) == bool(config.offload) and (all(offloaded) or config.offload < 1), offloaded
        torch.manual_seed(seed)
        reference = OddLM()
        vocab, data_rank, data_ranks = ODD.vocab, rank, world
    reference = reference.to(device())
    return Setup(model, adamw(model.parameters()), reference, adamw(reference.parameters()),
                 vocab, data_rank, data_ranks)


def train_step(model, opt, step: int, vocab: int, data_rank: int, data_ranks: int, inspect=None) -> float:
    """One AdamW step on this data rank's slice of the global batch; the loss averaged over all ranks.
    ``inspect()`` runs between backward and the optimizer step, while ``.grad`` is there."""
    tokens, targets = global_batch(step, vocab)
    per = GLOBAL_BATCH // data_ranks
    mine = slice(data_rank * per, (data_rank + 1) * per)
    loss = model(tokens[mine], targets[mine])
    loss.backward()
    if inspect is not None:
        inspect()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # TP peers add the same loss, data ranks their shares
    return total.item() / dist.get_world_size()


def step_both(s: Setup, step: int, inspect=None) -> tuple[float, float]:
    """The same step on the sharded model and on the reference; ``inspect`` sees both gradients."""
    tokens, targets = global_batch(step, s.vocab)
    ref_loss = s.reference(tokens, targets)
    ref_loss.backward()
    loss = train_step(s.model, s.opt, step, s.vocab, s.data_rank, s.data_ranks, inspect)
    s.ref_opt.step()
    s.ref_opt.zero_grad()
    return loss, ref_loss.item()


# ------------------------------------------------------------------ judging
class Report:
    """Problems found on this rank, raised together at the end of a task."""

    def __init__(self, where: str):
        self.where = where
        self.problems: list[str] = []

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def close_to(self, what: str, got: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
        """Tensor-wise relative error ``|got - expected| / |expected|`` at most ``rtol``."""
        if got.shape != expected.shape:
            self.add(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
            return
        err = relative_error(got, expected)
        if not err <= rtol:  # NaN fails too
            self.add(f"{what}: relative error {err:.3g} > {rtol}")

    def equal(self, what: str, got, expected) -> None:
        """Bit for bit (tensors), or ``==`` (anything else), recursing into dicts and lists."""
        if isinstance(expected, dict) and isinstance(got, dict):
            if set(got) != set(expected):
                self.add(f"{what}: keys missing {sorted(map(str, set(expected) - set(got)))}, "
                         f"unexpected {sorted(map(str, set(got) - set(expected)))}")
            for k in set(got) & set(expected):
                self.equal(f"{what}[{k!r}]", got[k], expected[k])
        elif isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(expected):
            for i, (a, b) in enumerate(zip(got, expected)):
                self.equal(f"{what}[{i}]", a, b)
        elif isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
            if isinstance(got, DTensor) or isinstance(expected, DTensor):
                self.add(f"{what}: a DTensor where a plain tensor was expected")
            elif got.shape != expected.shape or got.dtype != expected.dtype:
                self.add(f"{what}: {got.dtype}{tuple(got.shape)}, expected {expected.dtype}{tuple(expected.shape)}")
            elif not torch.equal(got.cpu(), expected.cpu()):
                diff = (got.cpu().double() - expected.cpu().double()).abs().max().item()
                self.add(f"{what}: not bit-exact (max diff {diff:.3g})")
        elif got != expected:
            self.add(f"{what}: {got!r}, expected {expected!r}")

    def same_keys(self, what: str, got, expected) -> None:
        got, expected = set(got), set(expected)
        if got != expected:
            self.add(f"{what}: keys missing {sorted(expected - got)}, unexpected {sorted(got - expected)}")

    def raise_if_any(self) -> None:
        if self.problems:
            shown = "\n  ".join(self.problems[:60])
            more = f"\n  ... and {len(self.problems) - 60} more" if len(self.problems) > 60 else ""
            rank = f" on rank {dist.get_rank()}" if dist.is_initialized() else ""
            raise AssertionError(f"{self.where}: {len(self.problems)} problem(s){rank}:\n  {shown}{more}")

    def __enter__(self) -> "Report":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """Raise what was found; when the body raised, say what had been found before it."""
        if exc is not None:
            if not isinstance(exc, Exception):
                return  # KeyboardInterrupt and the like pass through
            self.add(f"then raised {kind.__name__}: {exc}")
            try:
                self.raise_if_any()
            except AssertionError as summary:
                raise summary from exc
        self.raise_if_any()


@torch.no_grad()
def check_dtensor(report: Report, what: str, t, expected: torch.Tensor) -> None:
    """``t`` is a DTensor that means ``expected`` in torch's terms (collective: every rank calls it).

    ``full_tensor()`` and ``redistribute(Replicate)`` give ``expected`` (to RTOL), and
    ``distribute_tensor`` of the full value puts on this rank exactly the local
    shard ``t`` holds. Partial placements are first reduced (there is no local
    slice to compare before the reduction).
    """
    if not isinstance(t, DTensor):
        report.add(f"{what}: {type(t).__name__}, not a DTensor")
        return
    mesh, placements = t.device_mesh, tuple(t.placements)
    settled = tuple(Replicate() if p.is_partial() else p for p in placements)
    try:  # torch raises where the local shard cannot be what the placements say; name the tensor
        full = t.full_tensor()
        replicated = t.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        local = t.to_local() if settled == placements else t.redistribute(mesh, settled).to_local()
    except Exception as exc:
        raise AssertionError(
            f"{what}: {placements} on {mesh.mesh_dim_names} {tuple(mesh.shape)}, global {tuple(t.shape)}, "
            f"local {tuple(t.to_local().shape)}: torch cannot gather it: {exc}"
        ) from exc
    report.close_to(f"{what} full_tensor()", full, expected)
    report.close_to(f"{what} redistribute(Replicate).to_local()", replicated, expected)
    # on the mesh's device; an offloaded tensor keeps its local shard on the host (as FSDP2's CPUOffloadPolicy)
    torch_local = distribute_tensor(full, mesh, settled, src_data_rank=None).to_local().to(local.device)
    if torch_local.shape != local.shape or not torch.equal(torch_local, local):
        report.add(
            f"{what}: {placements} on {mesh.mesh_dim_names} {tuple(mesh.shape)}, global {tuple(t.shape)}: this rank "
            f"holds local {tuple(local.shape)}, distribute_tensor(full_tensor()) gives {tuple(torch_local.shape)}"
            + ("" if torch_local.shape != local.shape else " with other values")
        )


def check_parameters(report: Report, s: Setup) -> None:
    ref = dict(s.reference.named_parameters())
    for name, p in s.model.named_parameters():
        check_dtensor(report, f"parameter {name}", p, ref[name])


def check_grads(report: Report, s: Setup) -> None:
    """``.grad`` after a backward (call before the optimizer step)."""
    ref = dict(s.reference.named_parameters())
    for name, p in s.model.named_parameters():
        if (p.grad is None) != (ref[name].grad is None):
            report.add(f"{name}.grad is {p.grad is None and 'None' or 'set'}, the reference's is not")
        elif p.grad is not None:
            check_dtensor(report, f"{name}.grad", p.grad, ref[name].grad)


def check_optimizer_state(report: Report, s: Setup) -> None:
    ref = dict(s.reference.named_parameters())
    for name, p in s.model.named_parameters():
        state, ref_state = s.opt.state.get(p, {}), s.ref_opt.state.get(ref[name], {})
        report.same_keys(f"optimizer state of {name}", state, ref_state)
        for key in sorted(set(state) & set(ref_state)):
            if key == "step":
                report.equal(f"optimizer {name}.step", state[key], ref_state[key])
            else:
                check_dtensor(report, f"optimizer {name}.{key}", state[key], ref_state[key])


def check_state_dicts(report: Report, s: Setup) -> None:
    """``model.state_dict()`` values and ``full_state_dict`` against ``nn.Module.state_dict()`` of the
    reference: the same keys (tied aliases included), parameters as honest DTensors."""
    expected = s.reference.state_dict()
    parameters = dict(s.reference.named_parameters(remove_duplicate=False))
    state = s.model.state_dict()
    report.same_keys("model.state_dict()", state, expected)
    for key in sorted(set(state) & set(expected)):
        if key in parameters:
            check_dtensor(report, f"state_dict()[{key!r}]", state[key], expected[key])
        else:  # a buffer
            report.close_to(f"state_dict()[{key!r}] (buffer)", state[key], expected[key])
    full = shardwise.full_state_dict(s.model)
    report.same_keys("shardwise.full_state_dict()", full, expected)
    for key in sorted(set(full) & set(expected)):
        report.close_to(f"full_state_dict()[{key!r}]", full[key], expected[key])


def check_against_reference(report: Report, what: str, s: Setup, loss: float, ref_loss: float) -> None:
    """After a step: the loss, and every full weight against the reference."""
    if not abs(loss - ref_loss) <= RTOL * abs(ref_loss):
        report.add(f"{what}: loss {loss!r}, reference {ref_loss!r}")
    full = shardwise.full_state_dict(s.model)
    for key, value in s.reference.state_dict().items():
        if key in full:
            report.close_to(f"{what}: {key}", full[key], value)
        else:
            report.add(f"{what}: {key} missing from full_state_dict")


def clone_tree(tree):
    """A deep copy of a (sharded) state dict: DTensors stay DTensors, and stop aliasing live state."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def shards(tree):
    """A state dict with each DTensor replaced by (its placements, its local shard): compared bit for bit
    on every rank, the same as comparing full values, without a collective."""
    return tree_map_only(DTensor, lambda t: (tuple(t.placements), t.to_local()), tree)


def full_states(model, opt) -> tuple[dict, dict]:
    """Model and optimizer state dicts through torch's API, full and on CPU (rank 0 gets them);
    copies (on one process the full values can be the live tensors themselves)."""
    return clone_tree((get_model_state_dict(model, options=FULL), get_optimizer_state_dict(model, opt, options=FULL)))


# ------------------------------------------------------------------ 1, 2, 5: one configuration
def check_configuration(name: str, train_steps: int = 2) -> None:
    """Everything for one configuration on this world size: honest DTensors (parameters, ``.grad``,
    optimizer state, state dicts), state-dict keys, and torch's state-dict API round trips."""
    with Report(f"{name} on {dist.get_world_size()} process(es)") as report:
        s = build(BY_NAME[name])
        for step in range(train_steps):
            inspect = (lambda: check_grads(report, s)) if step == train_steps - 1 else None
            loss, ref_loss = step_both(s, step, inspect)
        check_against_reference(report, f"after {train_steps} steps", s, loss, ref_loss)
        check_parameters(report, s)
        check_optimizer_state(report, s)
        check_state_dicts(report, s)
        check_state_dict_api(report, s, next_step=train_steps)


def check_state_dict_api(report: Report, s: Setup, next_step: int) -> None:
    """get_*_state_dict full and sharded, then set_* each after a step moved the model away:
    the state comes back bit for bit and the next step matches the reference's."""
    rank0 = dist.get_rank() == 0
    full_model, full_optim = full_states(s.model, s.opt)
    ref_params = dict(s.reference.named_parameters())
    if rank0:
        expected = s.reference.state_dict()
        report.same_keys("get_model_state_dict(full)", full_model, expected)
        for key in sorted(set(full_model) & set(expected)):
            report.close_to(f"get_model_state_dict(full)[{key!r}]", full_model[key], expected[key])
        ref_optim = {name: s.ref_opt.state[p] for name, p in ref_params.items() if p in s.ref_opt.state}
        report.same_keys("get_optimizer_state_dict(full)['state']", full_optim["state"], ref_optim)
        for fqn in sorted(set(full_optim["state"]) & set(ref_optim)):
            for key, value in full_optim["state"][fqn].items():
                report.close_to(f"get_optimizer_state_dict(full)[{fqn!r}][{key!r}]", value, ref_optim[fqn][key])
    sharded_model = clone_tree(get_model_state_dict(s.model))
    sharded_optim = clone_tree(get_optimizer_state_dict(s.model, s.opt))
    expected = s.reference.state_dict()
    report.same_keys("get_model_state_dict()", sharded_model, expected)
    for key in sorted(set(sharded_model) & set(expected)):
        value = sharded_model[key]
        if isinstance(value, DTensor):
            check_dtensor(report, f"get_model_state_dict()[{key!r}]", value, expected[key])
    ref_snapshot = copy.deepcopy((s.reference.state_dict(), s.ref_opt.state_dict()))

    # torch's set_* rewrite the dict they are given: hand them copies
    def load_full():
        set_model_state_dict(s.model, clone_tree(full_model) if rank0 else {}, options=FULL_LOAD)
        set_optimizer_state_dict(s.model, s.opt, clone_tree(full_optim) if rank0 else {}, options=FULL_LOAD)

    def load_sharded():
        set_model_state_dict(s.model, clone_tree(sharded_model))
        set_optimizer_state_dict(s.model, s.opt, clone_tree(sharded_optim))

    for kind, load in (("full", load_full), ("sharded", load_sharded)):
        step_both(s, next_step + 1)  # move both away from the saved point
        load()
        ref_model_state, ref_optim_state = copy.deepcopy(ref_snapshot)
        s.reference.load_state_dict(ref_model_state)
        s.ref_opt.load_state_dict(ref_optim_state)
        # bit for bit on every rank's shards (so in full): what was saved is back
        report.equal(f"after set_model_state_dict({kind})", shards(get_model_state_dict(s.model)),
                     shards(sharded_model))
        report.equal(f"after set_optimizer_state_dict({kind})", shards(get_optimizer_state_dict(s.model, s.opt)),
                     shards(sharded_optim))
        loss, ref_loss = step_both(s, next_step)
        check_against_reference(report, f"a step after set_*_state_dict({kind})", s, loss, ref_loss)


# ------------------------------------------------------------------ 3: plain DCP across world sizes
def dcp_save_load(strategy: str, load_from: str | None, expected: tuple | None, save_to: str,
                  steps: tuple[int, int]) -> tuple | None:
    """Load ``load_from`` (when given) with plain DCP into a fresh model of this world size and
    ``strategy``, and check it is bit for bit ``expected``; train steps ``steps[0]..steps[1]-1``
    against the reference; save to ``save_to``. Rank 0 returns (the saved full (model, optimizer)
    state, the reference's weights)."""
    with Report(f"plain DCP, {strategy} on {dist.get_world_size()} process(es)") as report:
        first, last = steps
        s = build(Config(strategy, strategy=strategy), model_seed=0 if load_from is None else 123)
        for step in range(first):  # the reference catches up with the checkpoint
            train_step(s.reference, s.ref_opt, step, s.vocab, 0, 1)
        if load_from is not None:
            state = {"model": s.model.state_dict(), "optim": get_optimizer_state_dict(s.model, s.opt)}
            dcp.load(state, checkpoint_id=load_from)
            s.model.load_state_dict(state["model"])
            set_optimizer_state_dict(s.model, s.opt, state["optim"])
            loaded = full_states(s.model, s.opt)
            if dist.get_rank() == 0:
                report.equal(f"loaded from {load_from}", loaded, expected)
        for step in range(first, last):
            loss, ref_loss = step_both(s, step)
            check_against_reference(report, f"step {step}", s, loss, ref_loss)
        state = {"model": s.model.state_dict(), "optim": get_optimizer_state_dict(s.model, s.opt)}
        dcp.save(state, checkpoint_id=save_to)
        saved = full_states(s.model, s.opt)
        reference = {k: v.detach().cpu() for k, v in s.reference.state_dict().items()}
        return (saved, reference) if dist.get_rank() == 0 else None


# ------------------------------------------------------------------ 4: FSDP2 <-> shardwise
def _fsdp2(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = OddLM().to(device())
    fully_shard(model, mesh=init_device_mesh(device().type, (dist.get_world_size(),)))
    return model, adamw(model.parameters())


def _shardwise(seed: int):
    torch.manual_seed(seed)
    model = shardwise.fully_shard(OddLM().to(device()), strategy="optim_grads_params", unit_modules=[Block])
    return model, adamw(model.parameters())


ENGINES = {"fsdp2": _fsdp2, "shardwise": _shardwise}


def migrate(source: str, target: str, path: str, steps: int = 2) -> None:
    """``source`` trains ``steps`` steps and saves with DCP; ``target`` loads with the standard pattern
    (get_*_state_dict, dcp.load, set_*_state_dict) and continues exactly as ``source`` does."""
    with Report(f"{source} checkpoint into {target}") as report:
        rank, world = dist.get_rank(), dist.get_world_size()
        model, opt = ENGINES[source](seed=0)
        for step in range(steps):
            train_step(model, opt, step, ODD.vocab, rank, world)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=path)
        saved = full_states(model, opt)
        source_losses = [train_step(model, opt, step, ODD.vocab, rank, world) for step in range(steps, 2 * steps)]
        source_final = full_states(model, opt)[0]

        model, opt = ENGINES[target](seed=1)  # other weights: the load must matter
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        loaded = full_states(model, opt)
        losses = [train_step(model, opt, step, ODD.vocab, rank, world) for step in range(steps, 2 * steps)]
        final = full_states(model, opt)[0]
        if rank == 0:
            report.equal(f"{target} state after loading", loaded, saved)
            for i, (a, b) in enumerate(zip(losses, source_losses, strict=True)):
                if not abs(a - b) <= RTOL * abs(b):
                    report.add(f"continued step {steps + i}: {target} loss {a!r}, {source} loss {b!r}")
            report.same_keys("final weights", final, source_final)
            for key in sorted(set(final) & set(source_final)):
                report.close_to(f"final {key} ({target} vs {source})", final[key], source_final[key])


# ------------------------------------------------------------------ 6: Hugging Face Llama
def hf_llama(steps: int = 6) -> None:
    """A tiny tied-embedding LlamaForCausalLM, ZeRO-3 with LlamaDecoderLayer units, against one process
    (trained by ``tests.helpers.parity``: losses and the full state to RTOL)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with Report("transformers LlamaForCausalLM, ZeRO-3") as report:
        config = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=True)

        def build():
            torch.manual_seed(0)
            return LlamaForCausalLM(config).to(device())

        def loss(model, tokens):
            return model(input_ids=tokens, labels=tokens, use_cache=False).loss  # HF shifts the labels

        sharded, reference = train_both(
            build, lambda model: shardwise.fully_shard(model, strategy="optim_grads_params",
                                                       unit_modules=[LlamaDecoderLayer]),
            lambda model: adamw(model.parameters()), lambda step: global_batch(step, config.vocab_size)[:1], steps,
            loss=loss,
        )
        compare(sharded, reference, loss_rtol=RTOL, rtol=RTOL)
        model = sharded.model
        ref = dict(reference.model.named_parameters())
        for name, p in model.named_parameters():
            check_dtensor(report, f"parameter {name}", p, ref[name])
        state = model.state_dict()
        if "lm_head.weight" not in state:
            report.add("model.state_dict() has no lm_head.weight")
        report.same_keys("model.state_dict()", state, reference.model.state_dict())
