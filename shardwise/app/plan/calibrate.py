"""``shardwise plan --calibrate``: this machine's numbers for the step model, measured and stored.

One code path, two machines:

* with 2 or more CUDA GPUs, one process per local GPU (NCCL, each on its own device) times bf16
  all-gathers and fp32 reduce-scatters (the engine reduces in the gradient dtype) of 64 KiB to 256 MiB;
  without CUDA, 2 gloo processes of one thread time the same two collectives of 64 KiB to 16 MiB (seconds).
  Each size: warm-up calls first, then the median of a few timed samples, each between a one-element
  all-reduce and a device synchronize (``torch.cuda.synchronize``); on the CPU each sample follows the tiny
  layer's forward and backward instead, as a step calls them (``measure_collectives(between=...)``). ``fit_alpha_beta``
  fits ``latency + (n - 1) / n x bytes / bus bandwidth`` to each collective and, for the ``GpuSpec`` row,
  to both together (the step model has one link per span). On GPUs these are the node's NVLink numbers: the
  network cannot be measured on one node, so ``net_bw`` / ``net_latency`` stay the named row's (the file's
  ``measured.links`` says so). One GPU measures no collectives and keeps the row's link numbers.
* A reference transformer layer's bf16 forward and backward (``measure_layer``): on a GPU the bench's 0.9b
  (``--preset 1b``) and 8b layers at their preset sequence length and micro-batch, eager and, where
  ``torch.compile`` works, compiled; on the CPU the ``tiny`` layer on one thread, eager.
* The engine's own time (``calibrate_engine.measure_engine``): one rank trains the bench's ``tiny`` GPT
  wrapped and unwrapped; the difference per unit and pass becomes ``host_per_unit_eager`` (on the CPU also
  ``_compiled``), and on the CPU the wrapped model's AdamW step gives the rate its state streams at (``hbm_bw``).
* ``fit_efficiency`` turns the layer timings into ``Efficiency`` fields through the step model's own compute
  term (``step_time.py``: forward plus backward of a layer is ``3 F / (matmul x peak) + elementwise x width /
  hbm_bw`` seconds per token, ``F`` its matmul and attention FLOPs per token): one ``matmul`` shared by all
  points and one ``elementwise_*`` per mode, by least squares. The two widths (2048, 4096) separate them:
  ``F`` grows as width squared, the elementwise term as width. A mode measured at one width only keeps its
  ``elementwise_*`` constant; a fitted ``elementwise_*`` below 0 is held at 0.
* The GPU row comes from ``torch.cuda.get_device_name()`` (``identify_gpu``: H100, H200, B200, GB200). On a
  device with no row (a CPU, another GPU) the peak is unknown: the widest layer's measured FLOP rate becomes
  ``bf16_flops`` (and ``fp8_flops``) with ``matmul`` 1 and the elementwise terms 0.

The file (JSON) holds ``gpu`` (``GpuSpec`` fields), ``efficiency`` (``Efficiency`` fields) and ``measured``
(backend, world, device, every point, torch and NCCL versions, date, notes); ``load_calibration`` reads it
and ``shardwise plan --calibration FILE`` plans for that machine. ``build_record`` makes it from the
measurements alone, so its arithmetic is tested without a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from .calibrate_engine import measure_engine
from .hardware import EFFICIENCY, GPUS, GpuSpec
from .spawned import join_group, median_seconds, run_spawned, sync
from .step_time import ADAM_BYTES

__all__ = ["calibrate", "measure_collectives", "measure_layer", "fit_alpha_beta", "fit_efficiency",
           "identify_gpu", "build_record", "summary", "CPU_SIZES", "GPU_SIZES"]

CPU_SIZES = [2**16, 2**18, 2**20, 2**22, 2**24]  # bytes of the whole payload: 64 KiB .. 16 MiB
GPU_SIZES = [2**16 * 4**i for i in range(7)]  # 64 KiB .. 256 MiB: latency-bound to bandwidth-bound on NVLink
COLLECTIVES = {"all_gather": torch.bfloat16, "reduce_scatter": torch.float32}  # as the engine's defaults
CPU_LAYERS = [("tiny", 128, 4)]  # (preset, seq, micro-batch)
GPU_LAYERS = [("1b", 4096, 2), ("8b", 4096, 1)]  # the presets' own seq_len and micro_batch_size


def fit_alpha_beta(points: list[tuple[float, float]], n: int) -> tuple[float, float]:
    """(latency s, bus bandwidth bytes/s) of ``t = a + (n - 1) / n x bytes / bw`` through ``(bytes, seconds)``.

    Least squares of the relative error (each point weighted by ``1 / t**2``): the small payloads fix the
    latency, the large ones the bandwidth, instead of the largest time outweighing all. A latency below 0 is
    taken as 0 (the bandwidth then fitted alone)."""
    xs = [(n - 1) / n * b for b, _ in points]
    ys = [t for _, t in points]
    ws = [1.0 / t**2 for t in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    latency = my - slope * mx
    if latency < 0:
        latency, slope = 0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
    return latency, 1.0 / slope


def identify_gpu(device_name: str) -> str | None:
    """The ``GPUS`` row a ``torch.cuda.get_device_name()`` names (``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``), or
    ``None``. GB200 is looked for before B200 (a substring of it); a GH200 (Grace Hopper, a different memory
    system) names no row."""
    name = device_name.upper()
    if "GH200" in name:
        return None
    return next((row for row in ("GB200", "B200", "H200", "H100") if row in name), None)


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], calls: int,
                       repeats: int, between: tuple | None, out) -> None:
    import torch.distributed as dist

    device = join_group(rank, world, port, backend)
    work = reference_layer_step(*between, device=device)[0] if between else None
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    flag = torch.zeros(1, device=device)
    results = {}
    for name, dtype in COLLECTIVES.items():
        points = []
        for nbytes in sizes:
            shard = torch.ones(max(1, nbytes // dtype.itemsize // world), dtype=dtype, device=device)
            full = torch.ones(shard.numel() * world, dtype=dtype, device=device)
            call = (lambda: gather(full, shard)) if name == "all_gather" else (lambda: scatter(shard, full))
            for _ in range(2):  # warm-up: the first calls of a size set up buffers (and NCCL its channels)
                call()
            times = []
            for _ in range(repeats):
                if work is None:
                    dist.all_reduce(flag)  # every rank starts together
                else:  # as in a step: each rank computes, then calls (waiting for the slower one, on busy cores)
                    work()
                sync(device)
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                sync(device)
                times.append((time.perf_counter() - t0) / calls)
            points.append((full.numel() * dtype.itemsize, statistics.median(times)))
        results[name] = points
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure_collectives(backend: str = "gloo", world: int = 2, sizes: list[int] = CPU_SIZES, *, calls: int = 1,
                        repeats: int = 5, between: tuple | None = None,
                        timeout: float = 600.0) -> dict[str, list[tuple[int, float]]]:
    """``{"all_gather": [(bytes, seconds)], "reduce_scatter": [...]}`` over ``world`` spawned processes of
    ``backend`` (``nccl``: rank ``r`` on GPU ``r``); each point the median of ``repeats`` samples, a sample the
    mean of ``calls`` back-to-back calls. ``bytes`` is the whole payload (the gathered or the reduced tensor).

    ``between``: ``(preset, seq, micro_batch)`` of a layer whose forward and backward each rank runs before each
    sample, as a training step does between its collectives (else the ranks are lined up by a one-element
    all-reduce). On the CPU that is what a call costs in a step: gloo's threads share the cores the ranks
    compute on, and a call waits for the slower rank (measured here: a tiny layer's gather 1.0-1.2 ms between
    layers against 0.4-0.5 ms back to back)."""
    results = run_spawned(_collective_worker, backend, world, (sizes, calls, repeats, between), timeout)
    return {name: [(int(b), float(t)) for b, t in points] for name, points in results.items()}


def reference_layer_step(shape: str = "tiny", seq: int = 128, micro_batch: int = 4, *,
                         device: str | torch.device = "cpu", compiled: bool = False):
    """``(step, layer, config)``: ``step()`` runs one reference layer's bf16 forward and backward (``shape``: a
    preset's layer) on ``device`` at ``seq`` x ``micro_batch`` tokens."""
    from ...models import GPTConfig, TransformerLayer
    from ...models.norm_rope import rope_tables
    from ..presets import PRESETS

    names = {f.name for f in fields(GPTConfig)}
    cfg = GPTConfig(**{k: v for k, v in PRESETS[shape].items() if k in names}, max_seq_len=seq)
    device = torch.device(device)
    torch.manual_seed(0)
    layer = TransformerLayer(cfg).to(device=device, dtype=torch.bfloat16)
    run = torch.compile(layer, fullgraph=True, dynamic=False) if compiled else layer  # as the bench compiles
    x = torch.randn(micro_batch, seq, cfg.dim, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn_like(x).detach()
    cos, sin = rope_tables(seq, cfg.head_dim, cfg.rope_theta, device=device)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        run(x, cos, sin).backward(grad)

    return step, layer, cfg


def measure_layer(shape: str = "tiny", seq: int = 128, micro_batch: int = 4, *, device: str | torch.device = "cpu",
                  compiled: bool = False, repeats: int = 5) -> dict:
    """One reference layer (``shape``: a preset's layer) timed through bf16 forward and backward on ``device``,
    after two warm-up passes (a compiled layer compiles there); on the CPU on one thread, as ``shardwise bench``
    runs each rank. Returns the point ``fit_efficiency`` takes: ``width``, ``seq``, ``micro_batch``,
    ``compiled``, ``flops_per_token`` (the planner's count: 2 per parameter and attention's ``4 width seq``,
    forward), ``seconds`` (median of ``repeats``) and ``flops_per_s`` (forward and backward, 3x forward)."""
    device = torch.device(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        step, layer, cfg = reference_layer_step(shape, seq, micro_batch, device=device, compiled=compiled)
        seconds = median_seconds(step, device, repeats)
    finally:
        torch.set_num_threads(threads)
    params = sum(p.numel() for p in layer.parameters())
    flops = 2.0 * params + 4.0 * cfg.dim * seq
    return {"shape": shape, "width": cfg.dim, "seq": seq, "micro_batch": micro_batch, "compiled": compiled,
            "flops_per_token": flops, "seconds": seconds, "flops_per_s": 3 * flops * micro_batch * seq / seconds}


def fit_efficiency(layers: list[dict], peak: float, hbm_bw: float) -> tuple[dict[str, float], list[str]]:
    """``matmul`` and ``elementwise_eager`` / ``elementwise_compiled`` from ``measure_layer`` points, through
    ``seconds / tokens = 3 F / (matmul x peak) + elementwise x width / hbm_bw`` (least squares over the points,
    one ``matmul`` for all). A mode measured at fewer than two widths keeps its ``EFFICIENCY`` constant; a
    fitted elementwise term below 0 is held at 0. Returns the fields and notes on what was held."""
    modes = {"elementwise_eager": [p for p in layers if not p["compiled"]],
             "elementwise_compiled": [p for p in layers if p["compiled"]]}
    held = {k: getattr(EFFICIENCY, k) for k, pts in modes.items() if len({p["width"] for p in pts}) < 2}
    notes = [f"{k}: kept at {v:g} ({'one width' if modes[k] else 'not'} measured)" for k, v in held.items()]
    while True:
        free = [k for k in modes if k not in held]
        rows, rhs = [], []
        for p in layers:
            key = "elementwise_compiled" if p["compiled"] else "elementwise_eager"
            per_token = p["seconds"] / (p["micro_batch"] * p["seq"])
            term = p["width"] / hbm_bw
            rows.append([3 * p["flops_per_token"] / peak] + [term if k == key else 0.0 for k in free])
            rhs.append(per_token - (held[key] * term if key in held else 0.0))
        a = torch.tensor(rows, dtype=torch.float64)
        b = torch.tensor(rhs, dtype=torch.float64).unsqueeze(1)
        solution = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1).tolist()
        found = dict(zip(free, solution[1:]))
        negative = [k for k, v in found.items() if v < 0]
        if not negative:
            break
        for k in negative:
            held[k] = 0.0
            notes.append(f"{k}: fitted below 0, held at 0")
    return {"matmul": 1.0 / solution[0], **found, **held}, notes


def build_record(collectives: dict[str, list[tuple[int, float]]], layers: list[dict], *, backend: str, world: int,
                 device_name: str, memory: float, versions: dict, notes: list[str] = (), cores: int = 0,
                 engine: dict | None = None) -> dict:
    """The calibration file's content from the measurements: ``gpu`` (a ``GpuSpec``'s fields), ``efficiency``
    and ``measured``. ``memory``: bytes per process (used where the device names no row); ``cores``: the CPU's,
    which its ranks share (gloo; default: this machine's); ``engine``: ``calibrate_engine.measure_engine``'s result (host time per unit;
    on the CPU also AdamW's rate, which stands for the HBM bandwidth there)."""
    notes = list(notes)
    row = identify_gpu(device_name) if backend != "gloo" else None
    fits = {name: fit_alpha_beta(points, world) for name, points in collectives.items()}
    measured = {
        "backend": backend, "world": world, "device": device_name, "gpu_row": row, **versions,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "collectives": {name: {"dtype": str(COLLECTIVES[name]).removeprefix("torch."), "points": points,
                               "latency": fits[name][0], "bus_bw": fits[name][1]}
                        for name, points in collectives.items()},
        "layers": layers,
    }
    if backend == "gloo":  # the CPU: one process's share is the "GPU", the gloo ring every link
        spec = GpuSpec("cpu (calibrated)", 0.0, 0.0, memory, 1e12, 0.0, 0.0, cores=cores or os.cpu_count() or 1)
    elif row is not None:
        spec = replace(GPUS[row], name=f"{row} (calibrated)")
    else:
        spec = replace(GPUS["H100"], name=f"custom (calibrated): {device_name}", hbm_bytes=memory)
        notes.append(f"{device_name!r} names no GPU row: links and HBM bandwidth start from the H100 row")
    if collectives:
        latency, bw = fit_alpha_beta([pt for points in collectives.values() for pt in points], world)
        spec = replace(spec, nvlink_bw=bw, nvlink_latency=latency)
        if backend == "gloo":
            spec = replace(spec, net_bw=bw, net_latency=latency)
            measured["links"] = f"nvlink_* and net_*: one fit through both collectives over {world} gloo processes"
        else:
            measured["links"] = (f"nvlink_bw, nvlink_latency: one fit through both collectives over this node's "
                                 f"{world} GPUs; net_bw, net_latency: the row's, not measured (one node)")
    else:
        measured["links"] = "one GPU: no collectives measured; nvlink_* and net_* are the row's"
    if row is not None:
        eff, how = fit_efficiency(layers, spec.bf16_flops, spec.hbm_bw)
        notes += how
        measured["efficiency"] = (f"matmul (of {row}'s {spec.bf16_flops / 1e12:g} TFLOP/s) and elementwise_* by "
                                  "least squares through the layer points (calibrate.py)")
    else:  # no known peak: the rate itself, of the widest layer in the planner's default mode (compiled)
        pick = max(layers, key=lambda p: (p["compiled"], p["width"]))
        spec = replace(spec, bf16_flops=pick["flops_per_s"], fp8_flops=pick["flops_per_s"])
        eff = {"matmul": 1.0, "elementwise_compiled": 0.0, "elementwise_eager": 0.0, "fp8_speedup": 1.0}
        if backend == "gloo":
            eff["hbm"] = 1.0
        measured["efficiency"] = (f"bf16_flops: the {pick['shape']} layer's measured rate "
                                  f"({'compiled' if pick['compiled'] else 'eager'}); matmul 1, elementwise 0")
    if engine is not None:
        measured["engine"] = engine
        eff["host_per_unit_eager"] = engine["host_per_unit"]
        if backend == "gloo":  # no compiler on the CPU runs; AdamW streams its state at the measured rate
            eff["host_per_unit_compiled"] = engine["host_per_unit"]
            spec = replace(spec, hbm_bw=ADAM_BYTES * engine["params"] / engine["adam_s"])
    where = f"{world} {backend} process{'es' if world > 1 else ''}, {device_name}"
    spec = replace(spec, source=f"shardwise plan --calibrate ({where}, {measured['when']})")
    measured["notes"] = notes
    return {"measured": measured, "gpu": asdict(spec), "efficiency": eff}


def calibrate(path: str | os.PathLike, world: int | None = None) -> Path:
    """Measure this machine (its GPUs where CUDA sees any, collectives over 2 or more; else the CPU), write the
    file; returns its path. ``world``: processes (default: every GPU; 2 on the CPU)."""
    notes = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:  # ---- GPU branch: NCCL over every local GPU, layers on GPU 0 (not run on the CPU-only CI) ----
        backend, world = "nccl", world or gpus
        if world > gpus:
            raise ValueError(f"world={world}: this machine has {gpus} GPUs (one process per GPU)")
        sizes, calls, repeats, device = GPU_SIZES, 5, 10, torch.device("cuda", 0)
        device_name = torch.cuda.get_device_name(device)
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        nccl = torch.cuda.nccl.version()  # a tuple (2, 27, 3); an int in old torch
        versions = {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}
        shapes, modes = GPU_LAYERS, (False, True)
    else:  # ---- CPU branch: gloo processes of one thread each, the tiny layer on one thread ----
        backend, world = "gloo", world or 2
        if world < 2:
            raise ValueError(f"world={world}: the CPU calibration times collectives over 2 or more processes")
        sizes, calls, repeats, device = CPU_SIZES, 1, 15, torch.device("cpu")
        device_name = "cpu"
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        memory = float(pages) / world
        versions = {"torch": torch.__version__}
        shapes, modes = CPU_LAYERS, (False,)
    # ---- shared from here: the same functions on either device ----
    # on the CPU each sample follows a layer's work, as in a step (the ranks' threads and gloo's share the cores)
    between = CPU_LAYERS[0] if backend == "gloo" else None
    collectives = (measure_collectives(backend, world, sizes, calls=calls, repeats=repeats, between=between)
                   if world >= 2 else {})
    layers = []
    for compiled in modes:
        for shape, seq, micro_batch in shapes:
            try:
                layers.append(measure_layer(shape, seq, micro_batch, device=device, compiled=compiled))
            except Exception as error:  # noqa: BLE001 - torch.compile's failures have no one type
                if not compiled:
                    raise
                first = (str(error).strip().splitlines() or [""])[0][:200]
                notes.append(f"torch.compile failed at the {shape} layer ({type(error).__name__}: {first}): no "
                             "compiled point from it on")
                break
    engine = measure_engine(backend)
    record = build_record(collectives, layers, backend=backend, world=world, device_name=device_name,
                          memory=memory, versions=versions, notes=notes, engine=engine)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return out


def summary(record: dict) -> list[str]:
    """A few lines for the terminal: what was measured and what the planner will use."""
    m, gpu, eff = record["measured"], record["gpu"], record["efficiency"]
    lines = [f"{m['world']} x {m['device']} ({m['backend']}), torch {m['torch']}"
             + (f", NCCL {m['nccl']}" if m.get("nccl") else "")]
    for name, c in m["collectives"].items():
        lines.append(f"{name} ({c['dtype']}): latency {c['latency'] * 1e6:.1f} us, bus bandwidth "
                     f"{c['bus_bw'] / 1e9:.2f} GB/s")
    for p in m["layers"]:
        lines.append(f"layer {p['shape']} seq {p['seq']} mb {p['micro_batch']} "
                     f"{'compiled' if p['compiled'] else 'eager'}: {p['seconds'] * 1e3:.2f} ms, "
                     f"{p['flops_per_s'] / 1e12:.3f} TFLOP/s")
    if "engine" in m:
        e = m["engine"]
        lines.append(f"engine ({e['size']}, one rank): {e['wrapped_s'] * 1e3:.1f} ms forward and backward against "
                     f"{e['ceiling_s'] * 1e3:.1f} unwrapped over {e['units']} units: {e['host_per_unit'] * 1e3:.2f} ms "
                     f"per unit and pass; AdamW {e['adam_s'] * 1e3:.2f} ms for {e['params']:,} parameters")
    lines.append(f"gpu row: {gpu['name']}, bf16 {gpu['bf16_flops'] / 1e12:.3f} TFLOP/s, link "
                 f"{gpu['nvlink_bw'] / 1e9:.2f} GB/s + {gpu['nvlink_latency'] * 1e6:.1f} us")
    lines.append("efficiency: " + ", ".join(f"{k} {v:.3g}" for k, v in eff.items()))
    lines += [m["links"]] + list(m["notes"])
    return lines
