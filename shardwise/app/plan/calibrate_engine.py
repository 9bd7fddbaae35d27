"""What the engine itself costs on this machine, for ``shardwise plan --calibrate``: host time per unit and
AdamW's rate.

One process (a one-rank group of the calibration's backend) trains the bench's ``tiny`` GPT two ways: as the
no-wrapper ceiling (``wrap_none``) and wrapped by shardwise (``wrap_shardwise``, the bench's units and
recipe). At this size the layers' work is small, so what the wrapped forward and backward take beyond the
ceiling's is the engine's own time per unit and pass (hooks, the parameter swaps, the one-rank gathers and
gradient copies): ``host_per_unit = (wrapped - ceiling) / (2 x units)``. The wrapped model's optimizer step
(fp32 main weights, AdamW) gives the rate the step model's ``ADAM_BYTES`` per parameter stream at.
"""

from __future__ import annotations

import torch

from .spawned import join_group, median_seconds, run_spawned

__all__ = ["measure_engine"]

SIZE = "tiny"  # the bench's size: small enough that the engine's own time shows


def _engine_worker(rank: int, world: int, port: int, backend: str, repeats: int, out) -> None:
    import torch.distributed as dist

    from ...models import GPT, GPTConfig
    from ..bench.sizes import SIZES
    from ..bench.wrappers import wrap_none, wrap_shardwise

    device = join_group(rank, world, port, backend)
    size = SIZES[SIZE]
    config = GPTConfig(**size.model, max_seq_len=size.seq_len)
    tokens = torch.randint(0, config.vocab_size, (size.micro_batch, size.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def forward_backward(model, optimizer):
        def run():
            optimizer.zero_grad(set_to_none=True)
            model(inputs, targets).backward()
        return run

    built = {}
    for name, wrap in (("ceiling", wrap_none), ("shardwise", wrap_shardwise)):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(config)
        built[name] = wrap(model, device)
    ceiling = median_seconds(forward_backward(*built["ceiling"]), device, repeats)
    wrapped = median_seconds(forward_backward(*built["shardwise"]), device, repeats)
    model, optimizer = built["shardwise"]
    model(inputs, targets).backward()  # gradients for the optimizer to step on
    adam = median_seconds(optimizer.step, device, repeats)
    units = config.n_layers + 2  # the bench's units: each layer, the embedding, the output head
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        out.put({"size": SIZE, "units": units, "params": params, "ceiling_s": ceiling, "wrapped_s": wrapped,
                 "adam_s": adam, "host_per_unit": max(0.0, wrapped - ceiling) / (2 * units)})
    dist.destroy_process_group()


def measure_engine(backend: str = "gloo", repeats: int = 7, timeout: float = 600.0) -> dict:
    """``host_per_unit`` (seconds per unit and pass), ``adam_s`` for ``params`` parameters, and the raw
    timings, from one spawned process of ``backend`` (on GPU 0 for NCCL)."""
    return run_spawned(_engine_worker, backend, 1, (repeats,), timeout)
