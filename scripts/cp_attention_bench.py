"""One GPU: the attention a context-parallel rank runs, against unsplit causal attention.

A CP rank's attention is its ``seq / cp`` zig-zag queries against the whole sequence's keys and values
(``shardwise.models.context_parallel.attend_gathered``: each query chunk against the keys before it,
causal aligned to the lower right, which flash attention takes as a flag). Without a second GPU the
exchange is left out: the gathered K/V are built locally, so this measures the kernels a rank runs
and their speed against ``is_causal=True`` over the whole sequence on one GPU (flash); an explicit
boolean mask over all keys (the simplest exact alternative) is timed beside it. Forward + backward, bf16.

    python scripts/cp_attention_bench.py --seq 16384 32768 --cp 2 4 --out cp_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shardwise.models.context_parallel import attend_gathered, zigzag_positions  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / 1e3


def _step(q, k, v, attention=F.scaled_dot_product_attention, **kw):
    def run():
        for t in (q, k, v):
            t.grad = None
        attention(q, k, v, **kw).sum().backward()
    return run


def _backend(q, k, v, attention=F.scaled_dot_product_attention, **kw) -> str:
    """The first of flash, efficient, cudnn, math that runs every SDPA call of ``attention`` (what SDPA picks,
    near enough)."""
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                attention(q, k, v, **kw)
            return name
        except RuntimeError:
            continue
    return "none"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dev, dtype, rows = torch.device("cuda"), torch.bfloat16, []
    gqa = dict(enable_gqa=args.kv_heads != args.heads)
    for seq in args.seq:
        def tensors(queries: int):
            q = torch.randn(1, args.heads, queries, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(1, args.kv_heads, seq, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
                    for _ in range(2))
            return q, k, v

        q, k, v = tensors(seq)
        whole = _time(_step(q, k, v, is_causal=True, **gqa), args.repeat)
        rows.append(dict(seq=seq, cp=1, backend=_backend(q, k, v, is_causal=True, **gqa), seconds=whole))
        print(rows[-1], flush=True)
        del q, k, v
        for cp in args.cp:
            local = seq // cp
            for rank in sorted({0, cp - 1}):
                q, k, v = tensors(local)
                q_pos = zigzag_positions(local, rank, cp, device=dev)
                k_pos = torch.arange(seq, device=dev)  # the gathered keys, in sequence order
                mask = q_pos[:, None] >= k_pos[None, :]
                torch.cuda.reset_peak_memory_stats()
                seconds = _time(_step(q, k, v, attention=attend_gathered, rank=rank, cp=cp, causal=True, **gqa),
                                args.repeat)
                peak = torch.cuda.max_memory_allocated() / 2**30
                masked = _time(_step(q, k, v, attn_mask=mask, **gqa), args.repeat)
                rows.append(dict(seq=seq, cp=cp, rank=rank, seconds=seconds,
                                 backend=_backend(q, k, v, attention=attend_gathered, rank=rank, cp=cp, causal=True,
                                                  **gqa), speedup_vs_whole=whole / seconds,
                                 ideal_speedup=cp, peak_gib=peak, masked_seconds=masked,
                                 masked_backend=_backend(q, k, v, attn_mask=mask, **gqa),
                                 masked_speedup_vs_whole=whole / masked,
                                 mask_gib=mask.numel() * 2 / 2**30))  # as SDPA keeps it, in bf16
                print(rows[-1], flush=True)
                del q, k, v, mask
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  args=vars(args), rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
