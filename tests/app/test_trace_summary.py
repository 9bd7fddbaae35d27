"""scripts/trace_summary.py reads a bench trace: exposed NCCL, idle gaps and the host's lead."""

from __future__ import annotations

import json

from scripts.trace_summary import summarize


def _kernel(name, ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _launch(ts, dur, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def test_exposed_comm_idle_gaps_and_host_lead(tmp_path):
    # a matmul 0-100 us, NCCL 50-200 us (100 us of it alone), nothing 200-300 us, a copy 300-310 us
    events = [
        _kernel("nvjet_sm90_gemm", 0, 100, 1), _launch(-5_000, 10, 1),  # starts 4.99 ms after its launch call ends
        _kernel("ncclDevKernel_AllGather_RING_LL", 50, 150, 2), _launch(-20, 10, 2),
        _kernel("Memcpy DtoD copy", 300, 10, 3), _launch(280, 10, 3),  # 10 us after
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = summarize(str(path))
    assert "exposed NCCL 0.10 ms" in text
    assert "idle gaps >= 30 us: 1, 0.10 ms" in text
    assert "host lead, median per eighth of the window (ms): 4.99 0.06 0.01" in text
