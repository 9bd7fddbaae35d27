"""Every number the step-time model uses, named once, each with where it comes from.

``GPUS``: the accelerators (peak dense tensor-core FLOP/s, HBM, links); ``Cluster``: how many and how they are
wired; ``Efficiency``: what fraction of a peak the software reaches, with the measurement each is fitted to.
A custom spec (``GpuSpec(...)`` or ``--gpu custom:bf16=...,fp8=...,hbm=...,nvlink=...,net=...``) replaces a row;
``shardwise plan --calibrate`` measures the efficiencies and links of the machine it runs on (``calibrate.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

__all__ = ["GpuSpec", "GPUS", "Cluster", "Efficiency", "EFFICIENCY", "parse_gpu", "load_calibration"]

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator. FLOP/s are dense (no sparsity); bandwidths per GPU and per direction, in bytes/s.

    nvlink_bw / net_bw: what NCCL's ring collectives reach per GPU (bus bandwidth) inside a node (NVLink)
    and between nodes (the GPU's network adapter); latency: per collective call, each link."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes: float
    hbm_bw: float
    nvlink_bw: float
    net_bw: float
    nvlink_latency: float = 20e-6
    net_latency: float = 40e-6
    source: str = ""
    # A ring that crosses nodes pays, besides net_latency, a latency per step: NCCL's own tuning model (its
    # src/graph/tuning.cc, ring algorithm, Simple protocol, Hopper: 3.4 us per NVLink step, 14 us per network
    # step), so a collective's latency grows with the ranks and nodes it spans.
    ring_step_nvlink: float = 3.4e-6
    ring_step_net: float = 14e-6
    # A CPU "device" (a calibrated machine): the ranks of a node share ``cores`` cores, and a rank's Python,
    # kernels and (gloo's synchronous) collectives run one after another, so nothing overlaps. 0: a GPU.
    cores: int = 0

    @property
    def synchronous(self) -> bool:
        return self.cores > 0


# Peak numbers: NVIDIA's datasheets (H100 SXM5, H200 SXM, DGX B200, GB200 NVL72), dense. NVLink bus bandwidth:
# measured here on 2 x H200 (docs/performance.md, "What the collectives cost": an 8b layer's bf16 all-gather
# moves 218 MB per rank in 0.953 ms, its fp32 reduce-scatter 436 MB in 1.713 ms: 229-255 GB/s; 240 taken),
# the same NVLink 4 on H100; NVLink 5 doubles the links (B200, GB200: 480 taken, not measured). Network: one
# 400 Gb/s ConnectX-7 per GPU (DGX H100/H200/B200 user guides) = 50 GB/s, 0.9 of it for NCCL's rings
# (assumed; calibrate to replace). Latencies: assumed, of the order of NCCL's small-message times.
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 989 * TERA, 1979 * TERA, 80 * 2**30, 3.35e12, 240 * GB, 45 * GB,
                    source="NVIDIA H100 SXM5 datasheet; links as above"),
    "H200": GpuSpec("H200", 989 * TERA, 1979 * TERA, 141e9, 4.8e12, 240 * GB, 45 * GB,
                    source="NVIDIA H200 SXM datasheet; NVLink measured on 2 x H200"),
    "B200": GpuSpec("B200", 2250 * TERA, 4500 * TERA, 180e9, 8.0e12, 480 * GB, 45 * GB,
                    source="NVIDIA DGX B200 datasheet (72 PF FP8 sparse / 8 GPUs, halved); links assumed"),
    "GB200": GpuSpec("GB200", 2500 * TERA, 5000 * TERA, 186e9, 8.0e12, 480 * GB, 45 * GB,
                     source="NVIDIA GB200 NVL72 datasheet (per GPU, dense); NVLink domain of 72"),
}


def parse_gpu(text: str) -> GpuSpec:
    """``H100`` / ``H200`` / ``B200`` / ``GB200``, or ``custom:bf16=TFLOPS,fp8=TFLOPS,hbm=GiB,hbm_bw=TB/s,
    nvlink=GB/s,net=GB/s`` (a named row's values where a key is left out: ``H100:net=90``)."""
    base, _, rest = text.partition(":")
    if base.upper() in GPUS:
        spec = GPUS[base.upper()]
    elif base == "custom":
        spec = GPUS["H100"]
    else:
        raise ValueError(f"gpu={text!r}: expected one of {sorted(GPUS)} or custom:bf16=...,fp8=...,hbm=...,"
                         "nvlink=...,net=...")
    units = {"bf16": ("bf16_flops", TERA), "fp8": ("fp8_flops", TERA), "hbm": ("hbm_bytes", 2**30),
             "hbm_bw": ("hbm_bw", 1e12), "nvlink": ("nvlink_bw", GB), "net": ("net_bw", GB)}
    changes = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in units:
            raise ValueError(f"gpu={text!r}: unknown key {key!r}; keys: {sorted(units)}")
        try:
            changes[units[key][0]] = float(value) * units[key][1]
        except ValueError:
            raise ValueError(f"gpu={text!r}: {key}={value!r} is not a number") from None
    name = spec.name if base != "custom" else "custom"
    return replace(spec, name=name, source=spec.source + (" (changed: " + rest + ")" if rest else ""), **changes)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu: GpuSpec = field(default_factory=lambda: GPUS["H100"])

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"gpus={self.gpus} must be at least 1")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be at least 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus={self.gpus} must be a multiple of gpus_per_node={self.gpus_per_node}")

    def link(self, group: int, stride: int = 1, kind: str = "all_gather") -> tuple[float, float]:
        """(bus bandwidth, latency) of ``kind`` over ``group`` ranks ``stride`` apart: NVLink when they all sit
        in one node, else the network (a ring over nodes runs at the slowest link's pace) with a latency that
        grows with the ring's steps, as NCCL models it: ``group - 1`` steps (twice that for an all-reduce), of
        which one per node boundary (``nodes - 1``) crosses the network and the rest stay on NVLink."""
        span = group * stride
        if span <= self.gpus_per_node:
            return self.gpu.nvlink_bw, self.gpu.nvlink_latency
        nodes = group if stride >= self.gpus_per_node else -(-span // self.gpus_per_node)
        steps, crossing = group - 1, nodes - 1
        if kind == "all_reduce":
            steps, crossing = 2 * steps, 2 * crossing
        latency = (self.gpu.net_latency + (steps - crossing) * self.gpu.ring_step_nvlink
                   + crossing * self.gpu.ring_step_net)
        return self.gpu.net_bw, latency


@dataclass(frozen=True)
class Efficiency:
    """What the software reaches of the hardware's peaks (fitted to measurements, see ``EFFICIENCY``).

    A layer's time per token is its matmul FLOPs over ``matmul`` x peak, plus ``elementwise_*`` bytes per unit
    of width (norms, RoPE, SwiGLU, casts: memory-bound) over the HBM bandwidth."""

    matmul: float = 0.63
    elementwise_compiled: float = 146.0
    elementwise_eager: float = 750.0
    fp8_speedup: float = 1.24  # of a layer's matmuls under FP8 tensorwise compute
    hbm: float = 0.8
    host_per_unit_eager: float = 0.9e-3
    host_per_unit_compiled: float = 0.35e-3
    source: str = ""


# matmul and elementwise_compiled: least squares over shardwise's compiled steps on one H200 (docs/performance.md:
# 0.9b 78,185, 2.8b 19,532 and 8b 7,776 tokens/s, bf16, the two larger with checkpointing; no communication on
# one GPU): 0.63 of 989 TFLOP/s and 146 bytes per unit of width per token and layer; the fit is within 4% of
# each. elementwise_eager: the same matmul rate and the eager steps, 0.9b on one H200 (57,503: 889) and 8b on
# two (6,678 with 2.6% exposed communication: 621); 750 taken. fp8_speedup: the no-wrapper ceiling's FP8
# tensorwise over bf16 at 8b on one H200, 10,718 / 8,637. hbm: AdamW's fused step streams its state at about
# 0.8 of HBM bandwidth (assumed). host_per_unit: Python and launches per unit and pass (assumed; only exposed
# where a unit's GPU work is shorter).
EFFICIENCY = Efficiency(source="fitted to docs/performance.md's 1 x H200 / 2 x H200 steps; see hardware.py")


def load_calibration(path: str | Path) -> tuple[Efficiency, dict]:
    """An ``Efficiency`` and the ``GpuSpec`` fields a ``--calibrate`` run stored (``calibrate.py``).

    Reads ``efficiency`` and ``gpu`` (the same keys in every version of the file); keys that ``Efficiency`` or
    ``GpuSpec`` does not have are left out. ``measured`` (what was timed) only names the source."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"calibration={str(path)!r}: no such file (shardwise plan --calibrate writes one)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"calibration={str(path)!r}: not JSON ({error})") from None
    measured = data.get("measured", {})
    what = ", ".join(f"{measured[k]}" for k in ("backend", "device", "when") if measured.get(k))
    eff = replace(EFFICIENCY, **{k: v for k, v in data.get("efficiency", {}).items() if k in asdict(EFFICIENCY)},
                  source=f"calibrated: {path}" + (f" ({what})" if what else ""))
    known = {f.name for f in fields(GpuSpec)}
    return eff, {k: v for k, v in data.get("gpu", {}).items() if k in known}
