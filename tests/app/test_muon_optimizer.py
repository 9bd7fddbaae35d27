"""``--optimizer muon``: ``MuonAdamW`` is torch's Muon and AdamW stepped over their own parameters, bit for bit,
and checkpoints as one torch optimizer (a state dict loaded into a fresh one continues identically); the GPT's
Muon matrices are the layers' 2-D weights, not the embedding or head; flags it is not built with are refused by
name before a process starts."""

from __future__ import annotations

import copy

import pytest
import torch

from shardwise.app.config import resolve_config
from shardwise.app.errors import ConfigError
from shardwise.app.muon import MuonAdamW, muon_names
from shardwise.models import GPT, GPTConfig


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))


def _step(model, opt, step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad()


def test_muon_matrices_are_the_layers_two_dim_weights():
    model = _model()
    names = muon_names(model)
    assert names and all(n.startswith("layers.") and dict(model.named_parameters())[n].dim() == 2 for n in names)
    assert not any(n.startswith(("embed", "output")) for n in names)


def test_one_optimizer_is_torch_muon_and_adamw_and_checkpoints_as_one():
    ours, theirs = _model(), _model()
    names = muon_names(ours)
    opt = MuonAdamW(ours, names, lr=1e-2, weight_decay=0.1)
    muon = torch.optim.Muon([p for n, p in theirs.named_parameters() if n in names], lr=1e-2, weight_decay=0.1,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for n, p in theirs.named_parameters() if n not in names], lr=1e-2, weight_decay=0.1)

    class Both:
        def step(self):
            muon.step()
            adamw.step()

        def zero_grad(self):
            muon.zero_grad()
            adamw.zero_grad()

    for step in range(2):
        _step(ours, opt, step)
        _step(theirs, Both(), step)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    for group in opt.param_groups:  # a schedule sets lr on both optimizers through these
        group["lr"] = 5e-3
    assert {g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups} == {5e-3}
    resumed_model = copy.deepcopy(ours)
    resumed = MuonAdamW(resumed_model, names, lr=1.0, weight_decay=0.0)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step(ours, opt, 2)
    _step(resumed_model, resumed, 2)
    for (name, a), b in zip(ours.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("argv, named", [
    (["--strategy", "optim"], "needs --strategy optim_grads_params"),
    (["--pp", "2"], "--pp 2"),
    (["--offload"], "--offload"),
    (["--optimizer", "sgd"], "use one of adamw, muon"),
])
def test_what_muon_is_not_built_with_is_refused_by_name(argv, named):
    with pytest.raises(ConfigError) as e:
        resolve_config((["--optimizer", "muon"] if "--optimizer" not in argv else []) + argv)
    assert "optimizer" in str(e.value) and named in str(e.value), str(e.value)


def test_the_planner_adds_the_busiest_owners_newton_schulz():
    """``plan.step_time``'s Newton-Schulz term: the busiest rank's FLOPs (the engine's own owner balance) at the
    matmul rate, added beside the rest of the step."""
    from shardwise.app.plan.candidates import Candidate
    from shardwise.app.plan.hardware import EFFICIENCY, GPUS, Cluster
    from shardwise.app.plan.model_source import preset_source
    from shardwise.app.plan.step_time import newton_schulz_flops, step_time, unit_costs
    from shardwise.engine.owner_layout import ns_flops

    shapes = [torch.Size(s) for s in [(2048, 2048)] * 4 + [(5632, 2048)] * 2 + [(2048, 5632)]] * 16
    busiest = newton_schulz_flops(shapes, 2)
    total = sum(ns_flops(s) for s in shapes)
    assert total / 2 <= busiest <= 1.10 * total / 2  # balanced within 10%
    assert newton_schulz_flops(shapes, 1) == total
    units = unit_costs(preset_source("1b", seq=2048), 2048, False)
    h100 = GPUS["H100"]
    adamw = step_time(units, Candidate(), Cluster(2, 8, h100), 2048, 4)
    muon = step_time(units, Candidate(), Cluster(2, 8, h100), 2048, 4, newton_schulz=busiest)
    term = busiest / (h100.bf16_flops * EFFICIENCY.matmul)
    assert muon.terms["newton-schulz"] == pytest.approx(term) and "newton-schulz" not in adamw.terms
    assert muon.seconds == pytest.approx(adamw.seconds + term)
