"""The step-time rows of docs/plan.md's validation table, computed by the planner from each run's inputs.

Each row names a measured or published run (its model, GPUs, shape and configuration) and what it measured;
this script asks the planner's step model (``shardwise.app.plan.step_time``) for the same run and prints
the markdown rows, ratio = prediction / measurement. ``tests/app/test_plan_validation.py`` checks that
docs/plan.md shows exactly what this prints, so the table follows the model whenever a constant changes.

    python scripts/plan_validation.py          # the rows, as docs/plan.md has them
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardwise.app.plan.api import resolve_model
from shardwise.app.plan.candidates import Candidate
from shardwise.app.plan.hardware import EFFICIENCY, GPUS, Cluster, GpuSpec, parse_gpu
from shardwise.app.plan.step_time import step_time, unit_costs

# The bench's 0.9b (preset 1b without checkpointing) and 2.8b shapes (shardwise/app/bench/sizes.py).
BENCH_09B = "1b"
BENCH_28B = dict(layers=26, hidden=3072, heads=24, kv_heads=8, ffn=8192, vocab=32000)
LLAMA3_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)

# torchtitan's benchmark hosts (its docs/performance.md): H100 with 96 GB HBM2e at 2.4 TB/s, 500 W power limit.
GRAND_TETON_H100 = parse_gpu("H100:hbm=89.4,hbm_bw=2.4")

# This machine as `shardwise plan --calibrate` measured it (2026-12-05, 2 cores, quiet; the mean of three runs):
# one thread's bf16 tiny-layer rate, the gloo link between layer steps (latency + bus bandwidth, both
# collectives), AdamW's stream rate and the engine's host time per unit and pass (calibrate_engine.py).
CPU_HERE = GpuSpec("cpu (calibrated)", bf16_flops=66.7e9, fp8_flops=66.7e9, hbm_bytes=12 * 2**30, hbm_bw=7.53e9,
                   nvlink_bw=0.568e9, net_bw=0.568e9, nvlink_latency=751e-6, net_latency=751e-6, cores=2,
                   source="shardwise plan --calibrate, here (three runs: 64.8-67.7 GFLOP/s, 0.53-0.60 GB/s, "
                          "631-882 us, AdamW 7.2-7.9 GB/s)")
CPU_EFFICIENCY = replace(EFFICIENCY, matmul=1.0, elementwise_compiled=0.0, elementwise_eager=0.0, hbm=1.0,
                         fp8_speedup=1.0, host_per_unit_eager=0.58e-3, host_per_unit_compiled=0.58e-3)
CPU_NOTE = ("collectives: in the step a gloo call took 2.1 ms (gather) and 3.5 ms (reduce-scatter) per layer "
            "(torch.profiler, 5 steps) against 1.1 and 1.7 calibrated between layer steps: over a whole step the "
            "ranks drift further apart than over one layer and each call waits for the slower; and two ranks "
            "computing at once run 15% slower than one (the no-wrapper run: 53 ms against 46)")


@dataclass(frozen=True)
class Run:
    """One validation row: the run's inputs, what it measured, where that comes from, and why it may miss."""

    label: str
    model: object
    gpus: int
    gpu: GpuSpec
    seq: int
    global_batch: int
    candidate: Candidate
    measured: float  # tokens/s/GPU
    source: str
    compiled: bool = True
    gpus_per_node: int = 8
    note: str = ""
    eff: object = field(default=EFFICIENCY)

    def predicted(self) -> float:
        source = resolve_model(self.model, self.seq)
        units = unit_costs(source, self.seq, self.candidate.activation_checkpointing)
        cluster = Cluster(self.gpus, min(self.gpus_per_node, self.gpus), self.gpu)
        t = step_time(units, self.candidate, cluster, self.seq, self.global_batch, compiled=self.compiled,
                      eff=self.eff)
        return self.global_batch * self.seq / self.gpus / t.seconds


Z3 = Candidate("optim_grads_params")
Z3_AC = replace(Z3, activation_checkpointing=True)

JOB1 = "`docs/benchmarks.md` job 1 (2 x H200, eager)"
IDIOM = "`docs/performance.md`, \"The FSDP2 idiom costs nothing\" (1 x H200)"
FSDP2_NOTE = "FSDP2: the model is shardwise's engine; FSDP2 runs the same algorithm with its own overheads"

RUNS = [
    Run("0.9b, 2 x H200, eager, mb 2, shardwise", BENCH_09B, 2, GPUS["H200"], 4096, 4, replace(Z3, micro_batch=2),
        58_482, JOB1, compiled=False),
    Run("the same, FSDP2", BENCH_09B, 2, GPUS["H200"], 4096, 4, replace(Z3, micro_batch=2), 56_213, JOB1,
        compiled=False, note=FSDP2_NOTE),
    Run("2.8b, 2 x H200, eager, AC, shardwise", BENCH_28B, 2, GPUS["H200"], 4096, 2, Z3_AC, 15_315, JOB1,
        compiled=False),
    Run("the same, FSDP2", BENCH_28B, 2, GPUS["H200"], 4096, 2, Z3_AC, 14_337, JOB1, compiled=False,
        note=FSDP2_NOTE),
    Run("8b, 2 x H200, eager, AC, shardwise", "8b", 2, GPUS["H200"], 4096, 2, Z3_AC, 6_618, JOB1, compiled=False),
    Run("the same, FSDP2", "8b", 2, GPUS["H200"], 4096, 2, Z3_AC, 6_347, JOB1, compiled=False, note=FSDP2_NOTE),
    Run("0.9b, 1 x H200, compiled, mb 2, shardwise", BENCH_09B, 1, GPUS["H200"], 4096, 2, replace(Z3, micro_batch=2),
        81_459, IDIOM),
    Run("the same, FSDP2", BENCH_09B, 1, GPUS["H200"], 4096, 2, replace(Z3, micro_batch=2), 76_205, IDIOM,
        note=FSDP2_NOTE),
    Run("0.9b, 2 x H200, eager, ZeRO-3, mb 2", BENCH_09B, 2, GPUS["H200"], 4096, 4, replace(Z3, micro_batch=2),
        57_667, "`docs/performance.md` change 9, first probe", compiled=False,
        note="another job on that machine measured 48,701 (1.26): its runs sat 17% below the first job's"),
    Run("8b, 2 x H200, eager, AC (fitted)", "8b", 2, GPUS["H200"], 4096, 2, Z3_AC, 6_678,
        "`docs/performance.md` change 9", compiled=False),
    Run("0.9b, 1 x H200, compiled, mb 2 (fitted)", BENCH_09B, 1, GPUS["H200"], 4096, 2, replace(Z3, micro_batch=2),
        78_185, "`docs/performance.md` item 4"),
    Run("2.8b, 1 x H200, compiled, AC (fitted)", BENCH_28B, 1, GPUS["H200"], 4096, 1, Z3_AC, 19_532,
        "`docs/performance.md`, item 4 measured again"),
    Run("8b, 1 x H200, compiled, AC (fitted)", "8b", 1, GPUS["H200"], 4096, 1, Z3_AC, 7_776,
        "`docs/performance.md`, item 4 measured again"),
    Run("0.9b, 1 x H200, compiled, fp32 main weights (the ceiling pair's run)", BENCH_09B, 1, GPUS["H200"], 4096, 2,
        replace(Z3, micro_batch=2), 82_345, "`docs/performance.md`, the like-for-like ceiling pairs (graphs off)"),
    Run("Llama-3.1 8B, 8 x H100 (96 GB HBM2e, 500 W), eager, local batch 2, seq 8192 (torchtitan, FSDP)", "8b", 8,
        GRAND_TETON_H100, 8192, 16, replace(Z3_AC, micro_batch=2), 5_762,
        "torchtitan `docs/performance.md`, Table 1", compiled=False,
        note="torchtitan ran selective AC; the model has full AC (recomputes more: a lower bound on speed) or "
             "none; the 500 W power limit is on no datasheet"),
    Run("the same, torch.compile", "8b", 8, GRAND_TETON_H100, 8192, 16, replace(Z3_AC, micro_batch=2), 6_667,
        "torchtitan `docs/performance.md`, Table 1",
        note="as above: full AC here against selective AC there, and `matmul` fitted at 700 W on an H200"),
    Run("Llama-3 70B, 64 x GB200, MBS 2, GBS 128, seq 8192, FSDP, FP8 (Megatron-FSDP)", LLAMA3_70B, 64,
        GPUS["GB200"], 8192, 128, replace(Z3, micro_batch=2, fp8=True), 3_986,
        "Megatron-Bridge performance summary, 25.09 container (DGX-GB200)", gpus_per_node=72,
        note="the excerpt does not name the precision; 1,791 model TFLOP/s is 72% of GB200's dense bf16 peak, "
             "so FP8 is likely"),
    Run("the same in bf16", LLAMA3_70B, 64, GPUS["GB200"], 8192, 128, replace(Z3, micro_batch=2), 3_986,
        "as above", gpus_per_node=72,
        note="compute: GB200's efficiency is taken from H200's fit (and the run is likely FP8)"),
    Run("tiny, CPU, 2 gloo ranks, ZeRO-3, mb 4, seq 128", dict(layers=4, hidden=128, heads=4, kv_heads=2, ffn=384,
        vocab=256), 2, CPU_HERE, 128, 8, replace(Z3, micro_batch=4), 5_211,
        "`shardwise bench --sizes tiny --device cpu --nproc 2 --wrappers fsdp2,shardwise,none`, here, twice: 5,220 "
        "and 5,202", compiled=False, eff=CPU_EFFICIENCY, gpus_per_node=2, note=CPU_NOTE),
    Run("tiny, CPU, 4 gloo ranks on 2 cores", dict(layers=4, hidden=128, heads=4, kv_heads=2, ffn=384, vocab=256),
        4, CPU_HERE, 128, 16, replace(Z3, micro_batch=4), 1_969,
        "the same with `--nproc 4`, twice: 1,893 and 2,045", compiled=False, eff=CPU_EFFICIENCY, gpus_per_node=4,
        note="as above; each of the four ranks has half a core (`cores`)"),
]

TARGET = 0.15  # the issue's: each prediction within 15% of its measurement


def rows() -> list[str]:
    out = ["| run | predicted | measured | ratio | source | where it misses |", "|---|---|---|---|---|---|"]
    for run in RUNS:
        p = run.predicted()
        ratio = p / run.measured
        miss = run.note if abs(ratio - 1) > TARGET else (f"(within 15%; {run.note})" if run.note else "")
        out.append(f"| {run.label} | {p:,.0f} | {run.measured:,.0f} | {ratio:.2f} | {run.source} | {miss} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
