"""What clipping by the global norm costs around a fused AdamW step, on one GPU.

``python scripts/clip_microbench.py [--ranks 2]``: for the bench's ``0.9b`` and
``8b`` models, one rank's fp32 gradient shards (each parameter's numel over
``--ranks``) with a fused AdamW over them; times, with CUDA events (mean of 10
after 3 warm-up), the step alone, the norm (``torch._foreach_norm`` and the
sum), the in-place scaling (``torch._foreach_mul_``), and clipping then stepping
both ways: scaling in place, or the factor folded into the step as
``optimizer.grad_scale`` (what ``shardwise.clip_grad_norm_(..., optimizer=)``
does). Prints one line per model (and writes ``$OUT/clip.json`` when ``OUT``
is set).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from shardwise.app.bench.sizes import SIZES, model_config
from shardwise.models import GPT


def time_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(size: str, ranks: int, max_norm: float = 0.5) -> dict:
    with torch.device("meta"):
        numels = [-(-p.numel() // ranks) for p in GPT(model_config(SIZES[size])).parameters()]
    params = [torch.nn.Parameter(torch.randn(n, device="cuda") * 0.02) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)

    def norm():
        return torch.stack(torch._foreach_norm(grads, 2.0)).pow(2).sum().sqrt()

    def coef():
        return torch.clamp(max_norm / (norm() + 1e-6), max=1.0)

    def clip_in_place():
        torch._foreach_mul_(grads, coef())
        opt.step()

    def clip_folded():
        opt.grad_scale = torch.reciprocal(coef())
        opt.step()
        del opt.grad_scale

    cases = {"step": opt.step, "norm": norm, "scale in place": lambda: torch._foreach_mul_(grads, 1.0),
             "clip in place + step": clip_in_place, "clip folded + step": clip_folded}
    return {"size": size, "ranks": ranks, "numel": sum(numels), **{k: round(time_ms(fn), 3) for k, fn in cases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="shard each parameter over this many ranks")
    parser.add_argument("--sizes", default="0.9b,8b")
    args = parser.parse_args()
    rows = []
    for size in args.sizes.split(","):
        rows.append(measure(size, args.ranks))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "clip.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
