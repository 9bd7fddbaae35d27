"""Summarize a chrome trace from ``shardwise bench --save-traces``: is the step GPU- or host-bound?

``python scripts/trace_summary.py runs/bench/traces/0.9b-shardwise-r0-rank0.json [more ...]``
prints, per trace: GPU time by kind of kernel; NCCL time with nothing else
running (exposed); time with no GPU activity at all (idle gaps of 30 us or
more); and how far ahead of the GPU the host launches (each kernel's start
minus the end of its launch call), as a median per eighth of the traced window.
A lead near zero means the GPU is waiting for the host: the time to win back
is in Python, not in kernels.
"""

from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys

from shardwise.app.bench.runner import exposed_length, merge_intervals

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl " + (low.split("_")[1] if "_" in low else low)[:20]
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90", "flash", "fmha", "attention")):
        return "matmul / attention"
    if "copy" in low:
        return "copy"
    if "memset" in low:
        return "memset"
    if any(k in low for k in ("multi_tensor", "foreach", "adam")):
        return "optimizer / foreach"
    return "other"


def summarize(path: str) -> str:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_EVENTS]
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "args" in e}
    t0, t1 = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"## {path}: {len(gpu)} GPU events over {(t1 - t0) / 1e3:.1f} ms"]
    time_by, count_by = collections.Counter(), collections.Counter()
    for e in gpu:
        time_by[kind_of(e["name"])] += e["dur"]
        count_by[kind_of(e["name"])] += 1
    lines += [f"   {k:22} {v / 1e3:9.2f} ms {count_by[k]:7d} events" for k, v in time_by.most_common()]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" in e["name"].lower()]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" not in e["name"].lower()]
    busy = merge_intervals((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= 30]
    lines.append(f"   exposed NCCL {exposed_length(comm, other) / 1e3:.2f} ms; idle gaps >= 30 us: {len(gaps)}, "
                 f"{sum(gaps) / 1e3:.2f} ms")
    lead_by_eighth = collections.defaultdict(list)
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None:
            eighth = int(8 * (e["ts"] - t0) / (t1 - t0 + 1))
            lead_by_eighth[eighth].append(e["ts"] - launch["ts"] - launch["dur"])
    if lead_by_eighth:
        lines.append("   host lead, median per eighth of the window (ms): "
                     + " ".join(f"{statistics.median(lead_by_eighth[i]) / 1e3:.2f}" for i in sorted(lead_by_eighth)))
    return "\n".join(lines)


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(summarize(trace))
