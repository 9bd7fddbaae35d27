"""What one layer's collectives cost over NCCL, four ways, alone and beside matmuls.

Run with one process per GPU (``torchrun --nproc_per_node 2 scripts/collectives_microbench.py``).
For a 0.89B and an 8B transformer layer (the bench's ``0.9b`` and ``8b`` shapes),
it times the layer's bf16 all-gather and fp32 AVG reduce-scatter on a side
stream, as the engine issues them: one flat collective, one coalesced group of
per-parameter collectives (shardwise's layout), a flat collective with a copy
in and out (FSDP2's), and per-parameter collectives one by one; each with the
default communicator and with NCCL's CTAs capped at 4, 8 and 16. "beside" runs
bf16 8192^3 matmuls on the compute stream at the same time. Rank 0 prints a
table (and writes it to ``$OUT/collectives.txt`` when ``OUT`` is set).
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

LAYERS = {
    "0.9b": [(2048,), (2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048), (2048,),
             (5632, 2048), (5632, 2048), (2048, 5632)],
    "8b": [(4096,), (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (4096,),
           (14336, 4096), (14336, 4096), (4096, 14336)],
}


def piece_numel(shape: tuple, world: int) -> int:
    """A torch.chunk piece of the parameter's rows (the largest, so every rank's is the same size)."""
    rows = -(-shape[0] // world)
    return rows * (shape[1] if len(shape) > 1 else 1)


def layer_collectives(shapes, world: int, group, kind: str, device) -> dict:
    """The four ways to run one layer's all-gather (``kind="ag"``) or reduce-scatter (``"rs"``)."""
    sizes = [piece_numel(s, world) for s in shapes]
    total = sum(sizes)
    if kind == "ag":
        ins = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in sizes]
        outs = [torch.empty(world * n, device=device, dtype=torch.bfloat16) for n in sizes]
        flat_in = torch.randn(total, device=device, dtype=torch.bfloat16)
        flat_out = torch.empty(world * total, device=device, dtype=torch.bfloat16)

        def one(out, inp):
            dist.all_gather_into_tensor(out, inp, group=group)

        def copy_in():
            torch.cat(ins, out=flat_in)

        def copy_out():
            torch.split_with_sizes_copy(flat_out.view(world, total), sizes, dim=1,
                                        out=[o.view(world, n) for o, n in zip(outs, sizes)])
    else:
        ins = [torch.randn(world * n, device=device) for n in sizes]
        outs = [torch.empty(n, device=device) for n in sizes]
        flat_in = torch.randn(world * total, device=device)
        flat_out = torch.empty(total, device=device)

        def one(out, inp):
            dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG, group=group)

        def copy_in():
            torch.cat([i.view(world, n) for i, n in zip(ins, sizes)], dim=1, out=flat_in.view(world, total))

        def copy_out():
            torch.split_with_sizes_copy(flat_out, sizes, out=outs)

    def coalesced():
        with _coalescing_manager(group=group, async_ops=False):
            for out, inp in zip(outs, ins):
                one(out, inp)

    def flat_with_copies():
        copy_in()
        one(flat_out, flat_in)
        copy_out()

    def one_by_one():
        for out, inp in zip(outs, ins):
            one(out, inp)

    return {"flat": lambda: one(flat_out, flat_in), "coalesced": coalesced, "flat+copies": flat_with_copies,
            "one by one": one_by_one}


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    groups = {"default": dist.group.WORLD}
    for cap in (4, 8, 16):
        options = dist.ProcessGroupNCCL.Options()
        options.config.min_ctas, options.config.max_ctas = 1, cap
        groups[f"{cap} CTAs"] = dist.new_group(list(range(world)), pg_options=options)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def ms_per_call(fn, calls: int = 10, matmuls: int = 0) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            start.record()
            for _ in range(calls):
                fn()
            end.record()
        for _ in range(matmuls):
            torch.mm(a, a)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls

    lines = ["| layer | collective | communicator | way | alone ms | beside matmuls ms |", "|---|---|---|---|---|---|"]
    for layer, shapes in LAYERS.items():
        for kind in ("ag", "rs"):
            for name, group in groups.items():
                for way, fn in layer_collectives(shapes, world, group, kind, device).items():
                    fn()  # warm: communicator setup, allocator
                    alone = statistics.median(ms_per_call(fn) for _ in range(3))
                    beside = statistics.median(ms_per_call(fn, matmuls=40) for _ in range(3))
                    what = "all-gather bf16" if kind == "ag" else "reduce-scatter fp32"
                    lines.append(f"| {layer} | {what} | {name} | {way} | {alone:.3f} | {beside:.3f} |")
    if rank == 0:
        text = "\n".join(lines)
        print(text)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "collectives.txt"), "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
