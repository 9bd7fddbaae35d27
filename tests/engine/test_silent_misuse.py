"""Misuses that train wrongly without a word under torch's FSDP2: shardwise says so before the step they spoil.

Each case runs the same misuse under FSDP2 and shardwise in the same test: FSDP2's numbers show the damage
(nothing it says), shardwise's run stops (or warns) with a line naming the units and the fix. A stopped rank:
``tests/app/test_stuck_rank.py`` and the ``StallWatchdog`` case below.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise.engine.step_checks import UnreducedGradientWarning
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import TinyConfig, TinyLM, batch

CONFIG = TinyConfig(reuse_last_block=False)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()


def _misuse(which: str, case: str, steps: int = 2) -> dict:
    """Train ``steps`` steps with ``case``'s misuse; what happened: losses, how far each weight moved, the
    warnings, the error (its message) and the step it stopped at."""
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = TinyLM(CONFIG).to(device())
    for block in model.blocks:
        fully_shard(block)
    if case != "no_root":
        fully_shard(model)
    if case == "optimizer_while_unsharded":
        model.blocks[1].unshard()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = {n: _full(p) for n, p in model.named_parameters()}
    result = {"losses": [], "error": None, "stopped_at": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "sync_off":
            model.set_requires_gradient_sync(False)
        try:
            for step in range(steps):
                tokens, targets = (t.to(device()) for t in batch(10 * step + dist.get_rank(), 4, CONFIG))
                loss = model(tokens, targets)
                loss.backward()
                if case == "unshard_after_backward":
                    model.blocks[1].unshard()
                opt.step()
                opt.zero_grad()
                result["losses"].append(loss.item())
        except RuntimeError as e:
            result["error"], result["stopped_at"] = str(e), step
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UnreducedGradientWarning)]
    for module in model.modules():  # leave nothing gathered
        if hasattr(module, "reshard"):
            module.reshard()
    result["moved"] = {n: (_full(p) - before[n]).abs().max().item() for n, p in model.named_parameters()}
    result["head"] = _full(model.norm.weight)
    return result


@pytest.mark.parametrize("world", [1, 2])
def test_blocks_wrapped_root_not_warns_on_several_ranks(world):
    """FSDP2: the root's parameters (embedding, final norm) are stepped unreduced and the ranks drift apart,
    silently. shardwise: the same numbers (it changes nothing), and one warning at the first step that says
    why and what to call, on several ranks only (one rank has nothing to reduce)."""
    theirs = run_distributed(_misuse, world, "fsdp2", "no_root")
    ours = run_distributed(_misuse, world, "shardwise", "no_root")
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(t["losses"]), rtol=1e-5, atol=0)
        assert t["warnings"] == [] and t["error"] is None and o["error"] is None
    if world == 1:
        assert ours[0]["warnings"] == []
        return
    assert not torch.equal(theirs[0]["head"], theirs[1]["head"])  # the damage: the ranks' copies differ
    for o in ours:
        assert len(o["warnings"]) == 1, o["warnings"]
        assert ("steps 4 parameters that no fully_shard call owns (shapes [[1, 32], [61, 32], [32]] ...) beside "
                "parameters sharded over 2 ranks: nothing reduces their gradients") in o["warnings"][0]
        assert "Call fully_shard(model) on the root after its blocks" in o["warnings"][0]


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_with_gradient_sync_left_off_is_refused(world):
    """FSDP2: ``set_requires_gradient_sync(False)`` never set back: no sharded ``.grad`` exists at the step,
    nothing moves, and the losses look like training. shardwise: the first step is refused, naming the units."""
    theirs = run_distributed(_misuse, world, "fsdp2", "sync_off")[0]
    ours = run_distributed(_misuse, world, "shardwise", "sync_off")[0]
    assert theirs["error"] is None and max(theirs["moved"].values()) == 0.0
    assert ours["stopped_at"] == 0 and max(ours["moved"].values()) == 0.0
    assert ours["error"].startswith("optimizer=SGD.step() over units ['<root>', 'blocks.0', 'blocks.1', 'blocks.2'] "
                                    "whose gradient sync is off (set_requires_gradient_sync(False))")
    assert "call model.set_requires_gradient_sync(True) before the last micro-batch's backward" in ours["error"]


@pytest.mark.parametrize("world", [1, 2])
def test_an_optimizer_built_while_a_unit_is_unsharded_is_refused(world):
    """FSDP2: an optimizer built between ``unshard()`` and ``reshard()`` holds the gathered tensors, so that
    unit never trains (its weights move 0.0). shardwise refuses it at the first step, naming the unit."""
    theirs = run_distributed(_misuse, world, "fsdp2", "optimizer_while_unsharded")[0]
    reference = run_distributed(_misuse, world, "fsdp2", "none")[0]
    ours = run_distributed(_misuse, world, "shardwise", "optimizer_while_unsharded")[0]
    assert theirs["error"] is None and theirs["moved"]["blocks.1.fc1.weight"] == 0.0
    assert reference["moved"]["blocks.1.fc1.weight"] > 0.01
    assert ours["stopped_at"] == 0
    assert ours["error"].startswith("optimizer=SGD holds the gathered (unsharded) parameters of units ['blocks.1']")


@pytest.mark.parametrize("world", [1, 2])
def test_a_forward_on_gathered_weights_a_step_made_stale_is_refused(world):
    """FSDP2: ``unshard()`` after backward, then the step: the next forward computes with the old weights of
    that unit (its loss differs from the reference run's). shardwise refuses that forward, naming the unit."""
    theirs = run_distributed(_misuse, world, "fsdp2", "unshard_after_backward")[0]
    reference = run_distributed(_misuse, world, "fsdp2", "none")[0]
    plain = run_distributed(_misuse, world, "shardwise", "none")[0]
    ours = run_distributed(_misuse, world, "shardwise", "unshard_after_backward")[0]
    assert theirs["error"] is None and theirs["losses"][1] != pytest.approx(reference["losses"][1], rel=1e-3)
    torch.testing.assert_close(torch.tensor(plain["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert plain["error"] is None and plain["warnings"] == []
    if world == 1:  # one rank: shardwise's gathered weights are the weights the step updates, never stale
        assert ours["error"] is None
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
        return
    assert ours["stopped_at"] == 1 and ours["losses"] == theirs["losses"][:1]
    assert ours["error"].startswith("units ['blocks.1'] are still unsharded (unshard() without reshard()")


def _watch(stall_s: float, silent_rank: int) -> str | None:
    """Every rank but ``silent_rank`` runs a watchdog; ``silent_rank`` never beats (as a stopped process)."""
    seen: list[str] = []
    dog = shardwise.StallWatchdog(stall_s, interval_s=stall_s / 5, on_stall=seen.append)
    if dist.get_rank() != silent_rank:
        dog.start()
        deadline = time.monotonic() + 10 * stall_s
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        dog.close()
    dist.barrier()
    return seen[0] if seen else None


def test_the_watchdog_names_a_rank_that_never_beats():
    first, second = run_distributed(_watch, 2, 1.0, 1)
    assert first == ("rank 1 stopped making progress: no heartbeat for 1 s (it never sent one); it is stopped "
                     "(SIGSTOP, a debugger), frozen or dead")
    assert second is None
    with pytest.raises(AssertionError, match="stall_s=0 must be a positive number of seconds"):
        run_distributed(shardwise.StallWatchdog, 1, 0)


# ------------------------------------------------------------------ messages as clear as FSDP2's, or clearer
def _unclear_before(which: str) -> dict:
    """Three misuses whose shardwise message used to be an internal error, and a wrong-typed policy."""
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    out = {}

    def capture(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001 -- FSDP2 raises AssertionError for deepcopy
            out[key] = f"{type(e).__name__}: {e}"

    def torch_wrapped_block():
        model = TinyLM(CONFIG).to(device())
        torch_fully_shard(model.blocks[0])
        fully_shard(model)
        model(*(t.to(device()) for t in batch(0, 2, CONFIG))).backward()

    def meta_block():
        model = TinyLM(CONFIG).to(device())
        model.blocks[1].to("meta")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model(*(t.to(device()) for t in batch(0, 2, CONFIG)))

    def deepcopy_wrapped():
        import copy

        model = TinyLM(CONFIG).to(device())
        for block in model.blocks:
            fully_shard(block)
        copy.deepcopy(fully_shard(model))

    capture("torch_wrapped", torch_wrapped_block)
    capture("meta", meta_block)
    capture("deepcopy", deepcopy_wrapped)
    if which == "shardwise":
        capture("mixed_precision", lambda: shardwise.fully_shard(TinyLM(CONFIG), mixed_precision="bf16"))
    return out


def test_each_unclear_message_is_one_clear_line():
    """FSDP2 takes in its own units (nothing to say), lists meta parameters at the first forward and refuses
    deepcopy; shardwise refuses torch's units at wrap time by name, lists the meta parameters in FSDP2's words
    (the first unit holding any, full names) and says how to materialize them, refuses deepcopy saying what to use, and names the policy argument passed."""
    theirs = run_distributed(_unclear_before, 1, "fsdp2")[0]
    ours = run_distributed(_unclear_before, 1, "shardwise")[0]
    assert theirs["torch_wrapped"] is None
    assert ours["torch_wrapped"].startswith(
        "ValueError: submodule 'blocks.0' (FSDPBlock) is already sharded by torch.distributed.fsdp.fully_shard")
    # FSDP2's words and list (the first unit holding meta parameters, its parameters by full name)
    listed = theirs["meta"][:theirs["meta"].index("]") + 1]
    assert listed.startswith("RuntimeError: FSDP parameters should be materialized from meta device before "
                             "training, but the following were still on meta device: ['blocks.1.norm1.weight', "
                             "'blocks.1.norm1.bias', 'blocks.1.qkv.weight', 'blocks.1.proj.weight'"), theirs["meta"]
    assert ours["meta"].startswith(listed), ours["meta"]
    assert "model.to_empty(device=...)" in ours["meta"]
    assert "deepcopy" in theirs["deepcopy"] and "state dict" in theirs["deepcopy"]
    assert ours["deepcopy"].startswith("TypeError: copy.deepcopy of a sharded module (ShardedTinyLM, a fully_shard "
                                       "unit) is not supported")
    assert "shardwise.full_state_dict(model)" in ours["deepcopy"]
    assert ours["mixed_precision"] == ("TypeError: mixed_precision='bf16' must be a MixedPrecisionPolicy "
                                       "(torch.distributed.fsdp's or shardwise's), got str")
    assert all("\n" not in message for message in ours.values())
