"""One GPU: the attention a context-parallel rank runs, against unsplit causal attention (issue 37, item 5).

A CP rank's attention is its ``seq / cp`` zig-zag queries against the whole sequence's keys and values
with an explicit boolean mask (``shardwise.models.context_parallel``). Without a second GPU the
exchange is left out: the gathered K/V are built locally, so this measures the kernel a rank runs,
which SDPA backend takes it, its speed and the mask's memory, against ``is_causal=True`` over the whole
sequence on one GPU (flash). Forward + backward, bf16.

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
from shardwise.models.context_parallel import zigzag_positions  # noqa: E402

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


def _step(q, k, v, **kw):
    def run():
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
    return run


def _backend(q, k, v, **kw) -> str:
    """The first of flash, efficient, cudnn, math that accepts these inputs (a hint at what SDPA picks)."""
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, **kw)
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
                k_pos = torch.cat([zigzag_positions(local, r, cp, device=dev) for r in range(cp)])
                mask = q_pos[:, None] >= k_pos[None, :]
                torch.cuda.reset_peak_memory_stats()
                seconds = _time(_step(q, k, v, attn_mask=mask, **gqa), args.repeat)
                rows.append(dict(seq=seq, cp=cp, rank=rank, backend=_backend(q, k, v, attn_mask=mask, **gqa),
                                 seconds=seconds, speedup_vs_whole=whole / seconds,
                                 mask_gib=mask.numel() * 2 / 2**30,  # as SDPA keeps it, in bf16
                                 peak_gib=torch.cuda.max_memory_allocated() / 2**30))
                print(rows[-1], flush=True)
                del q, k, v, mask
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  args=vars(args), rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
