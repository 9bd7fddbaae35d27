"""The step controller (``engine/step_controller.py``): the step's phase as one value through a step, the
errors its transitions raise, and the ``record_function`` labels of its gathers, reductions and window ends
(one gloo rank; the gradients themselves are held to FSDP2's by the parity tests)."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.engine.model_ops import finish_grad_accumulation, sharded_state
from shardwise.engine.step_controller import Phase, StepController, WindowEnd, _label, _UNLABELLED

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _model():
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block])
    return model, sharded_state(model)


def _phases_through_steps():
    model, state = _model()
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(("forward", state.phase)))

    def watch_backward(module, args, output) -> None:  # fires in backward, after later units' backward hooks
        if output.requires_grad:
            output.register_hook(lambda grad: seen.append(("backward", state.phase)))

    model.blocks[0].register_forward_hook(watch_backward)
    tokens, targets = batch(0, 2, TinyConfig())
    tokens, targets = tokens.to(device()), targets.to(device())
    out = {"start": state.phase}
    loss = model(tokens, targets)
    out["after_forward"] = state.phase
    loss.backward()
    out["after_backward"] = state.phase
    with torch.no_grad():  # evaluation is no step phase
        model(tokens, targets)
    out["after_no_grad_forward"] = state.phase
    with model.no_sync():
        model(tokens, targets).backward()
    out["after_no_sync_backward"] = state.phase
    finish_grad_accumulation(model)
    out["after_finish_accumulation"] = state.phase
    out["seen"] = seen[:2]
    return out


def test_the_phase_is_one_value_through_a_step():
    out = run_distributed(_phases_through_steps, 1)[0]
    assert out["start"] is Phase.IDLE
    assert out["seen"] == [("forward", Phase.FORWARD), ("backward", Phase.BACKWARD)]
    assert out["after_forward"] is Phase.AWAITING_BACKWARD
    assert out["after_backward"] is Phase.REDUCED
    assert out["after_no_grad_forward"] is Phase.REDUCED
    assert out["after_no_sync_backward"] is Phase.IDLE  # the window stays open, no forward owes a backward
    assert out["after_finish_accumulation"] is Phase.REDUCED


def _errors():
    model, state = _model()
    tokens, targets = (t.to(device()) for t in batch(0, 2, TinyConfig()))
    out = {}
    with pytest.raises(RuntimeError, match=r"shardwise internal error: the gradient window ended \(backward\) in "
                                           "phase IDLE, expected BACKWARD"):
        state.end_window(WindowEnd.BACKWARD)  # only autograd's final callback ends a backward's window
    out["after_refused_end"] = state.phase

    def fail(grad):
        raise ValueError("a backward that raises")

    def hook_fail(module, args, output) -> None:
        output.register_hook(fail)

    handle = model.blocks[1].register_forward_hook(hook_fail)
    loss = model(tokens, targets)
    handle.remove()
    with pytest.raises(ValueError, match="a backward that raises"):
        loss.backward()
    out["after_raise"] = state.phase
    with pytest.raises(RuntimeError, match=r"its last backward had not ended .* call model.reset_iter_state\(\)"):
        model(tokens, targets)
    model.reset_iter_state()
    out["after_reset"] = state.phase
    model(tokens, targets).backward()
    out["after_step"] = state.phase
    return out


def test_a_transition_from_an_unexpected_phase_is_named():
    out = run_distributed(_errors, 1)[0]
    assert out["after_refused_end"] is Phase.IDLE  # refused before it did anything
    assert out["after_raise"] is Phase.BACKWARD  # autograd runs no final callback after a raise
    assert out["after_reset"] is Phase.IDLE
    assert out["after_step"] is Phase.REDUCED


def _labels():
    model, _ = _model()
    tokens, targets = (t.to(device()) for t in batch(0, 2, TinyConfig()))
    model(tokens, targets).backward()  # unprofiled: labels cost nothing
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(tokens, targets).backward()
        with model.no_sync():
            model(tokens, targets).backward()
        finish_grad_accumulation(model)
    return sorted({e.name for e in prof.events() if e.name.startswith("shardwise.")})


def test_gathers_reductions_and_window_ends_are_labelled_under_a_profiler():
    names = run_distributed(_labels, 1)[0]
    assert names == ["shardwise.end_window.accumulation", "shardwise.end_window.backward", "shardwise.gather",
                     "shardwise.reduce"]
    assert _label("shardwise.gather") is _UNLABELLED  # no profiler: no record_function at all
    assert not hasattr(StepController, "finish_accumulation")  # every window end is end_window's
