"""The training loop of ``shardwise train``: the steps, the metrics line each writes, the checkpoints it saves."""

from __future__ import annotations

import contextlib
import json
import time

import torch
import torch.distributed as dist

from ..engine.optim import grad_norm as global_grad_norm, takes_clip_factor

__all__ = ["Phase", "DataParallelRun", "run_steps", "memory_gib", "PEAK_FLOPS_PER_GPU"]

PEAK_FLOPS_PER_GPU = 989e12  # H100/H200 dense bf16


class Phase:
    """Where this rank is (step and collective), for the one line a stalled peer causes; :meth:`watch` says it
    while start-up takes long (nothing else is printed then)."""

    def __init__(self, now: str = "process-group setup"):
        self.now, self.since, self.starting = now, time.monotonic(), True

    def __call__(self, text: str) -> None:
        self.now, self.since = text, time.monotonic()

    def started(self) -> None:
        """The first step is starting: the watch ends (the progress bar takes over)."""
        self.starting = False

    def watch(self, say, after_s: float = 5.0, every_s: float = 10.0) -> None:
        """A daemon thread: while starting, a phase that has lasted ``after_s`` is said, then every ``every_s``."""
        import threading

        def run():
            said = {}
            while self.starting:
                time.sleep(0.5)
                now, lasted = self.now, time.monotonic() - self.since
                if self.starting and lasted >= after_s and lasted - said.get(now, -every_s) >= every_s:
                    said[now] = lasted
                    say(f"start-up: {now} ({lasted:.0f} s so far)")

        threading.Thread(target=run, name="startup-phase", daemon=True).start()


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class DataParallelRun:
    """One model on every rank: each step runs ``grad_accum`` micro-batches, all but the last under ``no_sync``.

    The loop's view of what it trains (:class:`.pipeline_train.PipelineRun` is the other): ``module`` (what a
    checkpoint saves and an evaluation runs; ``modules``, all this rank holds), ``parameters``, the process groups the gradient norm also spans
    (``extra_groups``), the ranks whose summed losses make the step's loss (``data_ranks``; this rank reads
    the rows of ``data_rank``), and
    ``step_metrics`` (extra fields of the metrics line).
    """

    extra_groups: list = []

    def __init__(self, model: torch.nn.Module):
        self.module = model
        self.modules = [model]
        self.data_ranks = dist.get_world_size()
        self.data_rank = dist.get_rank()  # which rows this rank reads

    def train(self) -> None:
        self.module.train()

    def optimizer(self, make):
        """The optimizer the loop steps: ``make(module)`` of the model."""
        return make(self.module)

    def checkpointed(self, optimizer):
        """``(model, optimizer)`` as a checkpoint saves and loads them."""
        return self.module, optimizer

    def parameters(self) -> list:
        return list(self.module.parameters())

    def forward_backward(self, loader, grad_accum: int, device: torch.device) -> torch.Tensor:
        """The sum over this rank's micro-batches of their mean loss (the gradients are those of its mean)."""
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            inputs, targets = next(loader)
            last = micro == grad_accum - 1
            with contextlib.nullcontext() if last else self.module.no_sync():
                loss = self.module(inputs, targets)
                (loss / grad_accum).backward()
            loss_sum += loss.detach().float()
        return loss_sum

    def step_metrics(self) -> dict:
        return {}


def run_steps(cfg, run, optimizer, loader, checkpoints, schedule, start, grad_accum, tokens, device, phase, bar,
              metrics_file, launch, flops_per_token, evaluator=None, loggers=None) -> int:
    """Steps ``start..cfg.steps`` of ``run`` (a :class:`DataParallelRun` or a pipeline's); rank 0 writes a
    metrics line per step. Returns the steps trained.

    After the steps ``evaluator.due`` names, every rank evaluates (outside the step time); the
    result goes into that step's metrics line.
    """
    import shardwise

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * grad_accum * run.data_ranks
    trained, loop_start = 0, time.perf_counter()
    bar_eval = ""  # the last eval loss, shown in the progress bar
    run.train()
    params = run.parameters()
    for step in range(start, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = schedule(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        phase(f"step {step}, forward/backward (parameter all-gathers, gradient reduce-scatters"
              f"{', pipeline sends and receives' if run.extra_groups else ''})")
        loss_sum = run.forward_backward(loader, grad_accum, device)
        phase(f"step {step}, gradient norm (all-reduce)")
        if cfg.max_grad_norm > 0:
            # fused: the factor goes into the step's kernel instead of a pass over the gradients
            grad_norm = shardwise.clip_grad_norm_(params, cfg.max_grad_norm,
                                                  optimizer=optimizer if takes_clip_factor(optimizer) else None,
                                                  extra_groups=run.extra_groups)
        else:
            grad_norm = global_grad_norm(params, extra_groups=run.extra_groups)
        phase(f"step {step}, optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phase(f"step {step}, loss all-reduce")
        dist.all_reduce(loss_sum)  # ranks that hold no loss (a pipeline's other stages) add zeros
        loss_value = loss_sum.item() / (grad_accum * run.data_ranks)  # .item() syncs the device
        step_time = time.perf_counter() - t0
        measured = run.step_metrics()  # a collective where there is something to gather (the pipeline bubble)
        tokens += tokens_per_step
        trained += 1
        evaluated = {}
        if evaluator is not None and evaluator.due(step):
            phase(f"step {step}, evaluation (forwards, loss all-reduce)")
            evaluated = evaluator(run.module)
        if rank == 0:  # the metrics line goes out before the checkpoint that covers it
            record = {
                "step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                "tokens": tokens, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                "mfu": (tokens_per_step / step_time * flops_per_token / (PEAK_FLOPS_PER_GPU * world)
                        if device.type == "cuda" else None),
                "mem_gib": memory_gib(device), "elapsed_s": time.perf_counter() - loop_start, "launch": launch,
                **measured, **evaluated,
            }
            metrics_file.write(json.dumps(record) + "\n")
            if loggers is not None:
                loggers.log(record)
            if evaluated:
                bar_eval = f"{evaluated['eval_loss']:.3f}"
            postfix = {"loss": f"{loss_value:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}",
                       "mem": f"{record['mem_gib']:.2f}G"}
            if evaluator is not None and bar_eval:
                postfix["eval"] = bar_eval
            if record["mfu"] is not None:
                postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
            bar.set_postfix(postfix, refresh=False)
            bar.update()
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
            phase(f"step {step}, checkpoint save")
            facts = {"world_size": world, "data_ranks": run.data_ranks, "micro_batch_size": cfg.micro_batch_size,
                     "grad_accum": grad_accum, "global_batch": cfg.micro_batch_size * grad_accum * run.data_ranks,
                     "seq_len": cfg.seq_len, "tokens": tokens, "schedule": schedule.to_dict()}
            checkpoints.save(step, *run.checkpointed(optimizer), extra={"data": loader.state_dict(), "run": facts})
    return trained

