"""What the misuse checks (``shardwise.engine.step_checks``) cost a steady step: tokens/s and collectives per step
with the checks on and off, interleaved in one job on the CPU bench's tiny model (2 gloo processes).

    PYTHONPATH=. python scripts/step_checks_cost.py [--rounds 6] [--steps 5]

Off means: the optimizer step pre-hook removed and the root pre-forward's two checks replaced by no-ops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COUNTED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather", "barrier",
           "all_gather_single", "reduce_scatter_single", "all_to_all_single")


def _count_collectives(counter: list[int]) -> None:
    for name in COUNTED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, **kwargs):
            counter[0] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)


def _checks(on: bool) -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import shardwise.engine.step_controller as step_controller
    import shardwise.engine.step_checks as step_checks

    if on and step_checks._hook is None:
        step_checks._hook = register_optimizer_step_pre_hook(step_checks._check_step)
    if not on and step_checks._hook is not None:
        step_checks._hook.remove()
        step_checks._hook = None
    step_controller.check_gathered_weights_current = step_checks.check_gathered_weights_current if on else (
        lambda units: None)
    step_controller.check_materialized = step_checks.check_materialized if on else (lambda state: None)


def _worker(rank: int, world: int, port: int, rounds: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import shardwise
    from shardwise.app.bench.sizes import SIZES
    from shardwise.models import GPT, GPTConfig, TransformerLayer

    size = SIZES["tiny"]
    torch.manual_seed(0)
    model = shardwise.fully_shard(GPT(GPTConfig(**size.model, max_seq_len=size.seq_len)),
                                  unit_modules=[TransformerLayer])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = [0]
    _count_collectives(counter)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, size.model["vocab_size"], (size.micro_batch, size.seq_len + 1), generator=gen)

    def step() -> None:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    rates = {True: [], False: []}
    counts = {True: set(), False: set()}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):  # ABBA: drift hits both alike
            _checks(on)
            dist.barrier()
            before, t0 = counter[0], time.perf_counter()  # the barrier not counted
            for _ in range(steps):
                step()
            elapsed = time.perf_counter() - t0
            counts[on].add((counter[0] - before) / steps)
            rates[on].append(steps * size.micro_batch * size.seq_len * world / elapsed)
    _checks(True)
    import shardwise.engine.step_checks as step_checks

    state, calls = model.sharded_state, 2000
    t0 = time.perf_counter()
    for _ in range(calls):  # what a steady step runs: the step hook and the root pre-forward's two checks
        step_checks._check_step(opt, (), {})
        step_checks.check_materialized(state)
        step_checks.check_gathered_weights_current(state.all_units)
    per_step_us = (time.perf_counter() - t0) / calls * 1e6
    if rank == 0:
        print(f"the checks of one steady step: {per_step_us:.1f} us ({len(state.all_units)} units, "
              f"{len(state.groups)} groups)")
        for on in (True, False):
            print(f"checks {'on ' if on else 'off'}: tokens/s median {statistics.median(rates[on]):,.0f} "
                  f"(min {min(rates[on]):,.0f}, max {max(rates[on]):,.0f}, {rounds} blocks of {steps} steps); "
                  f"collectives per step {sorted(counts[on])}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from shardwise.app.launch import free_port

    mp.spawn(_worker, args=(2, free_port(), args.rounds, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
