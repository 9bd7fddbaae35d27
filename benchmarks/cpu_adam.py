"""How fast torch's AdamW steps on the CPU: elements/s per variant, plain tensors and DTensors.

    python -m benchmarks.cpu_adam                                  # ~50M fp32 elements, torch's threads
    python -m benchmarks.cpu_adam --threads 1,2 --out runs/cpu_adam
    python -m benchmarks.cpu_adam --numel 200000 --tensors 20 --steps 2   # seconds

With ``OffloadPolicy`` the fp32 main weights, their gradients and AdamW's state
live in host memory and the user's ``torch.optim.AdamW(model.parameters())``
steps on the CPU, so the CPU step's speed bounds the offloaded run. This
measures one AdamW step over ``--tensors`` fp32 tensors that add up to about
``--numel`` elements (a transformer's mix: per layer four ``d x d`` attention
matrices, ``4d x d`` and ``d x 4d`` MLP matrices and two norm vectors, plus an
embedding that makes up the rest), for each of torch's implementations:

* ``default``: ``torch.optim.AdamW(params)``, whatever torch picks (on the CPU
  torch picks the per-tensor for-loop: foreach kernels are a CUDA-only default);
* ``foreach``: ``foreach=True`` (multi-tensor ops, each still one pass over memory);
* ``for-loop``: ``foreach=False`` (one op at a time per tensor);
* ``fused``: ``fused=True`` (torch's vectorized single-pass CPU kernel).

Each runs on plain ``nn.Parameter`` tensors and on DTensor parameters (a
1-process gloo group, ``DTensor.from_local`` on a 1-D CPU mesh, ``Shard(0)``),
which is what an offloaded shardwise model hands the optimizer, so the
DTensor dispatch cost per tensor and op shows up.

Reported per variant: the step time (median and min of ``--steps`` timed steps
after ``--warmup`` untimed ones), elements/s (elements updated per second),
GB/s at 28 bytes per fp32 element (AdamW reads the weight, gradient and both
moments and writes the weight and both moments: 7 x 4 bytes), the same against
the memory bandwidth simple torch kernels reach here at the same thread count
(``c = a + s*b`` and the in-place ``a += b*c``, the better of the two), and the largest difference of the updated
weights from the plain ``for-loop`` run (all variants start from the same
weights and gradients; ``fused`` may differ by rounding). Writes
``cpu_adam.json`` and ``cpu_adam.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["VARIANTS", "APIS", "transformer_shapes", "run_cpu_adam", "format_markdown", "main"]

#: name -> keyword arguments to ``torch.optim.AdamW``
VARIANTS: dict[str, dict] = {
    "for-loop": {"foreach": False},
    "default": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
REFERENCE = ("tensor", "for-loop")
APIS = ("tensor", "dtensor")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: AdamW's memory traffic per element, in units of the element size: reads weight,
#: gradient, exp_avg, exp_avg_sq (4); writes weight, exp_avg, exp_avg_sq (3)
ACCESSES_PER_ELEMENT = 7
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def transformer_shapes(numel: int, tensors: int) -> list[tuple[int, ...]]:
    """Shapes of about ``tensors`` tensors adding up to about ``numel`` elements, like a transformer's.

    Per layer: q, k, v, o ``(d, d)``, MLP ``(4d, d)`` and ``(d, 4d)``, two norms ``(d,)``;
    then ``(d,)`` vectors until ``tensors - 1``, and an embedding ``(rows, d)`` for the rest.
    """
    if numel < 64 or tensors < 1:
        raise ValueError(f"--numel {numel} must be >= 64 and --tensors {tensors} >= 1")
    per_layer = 8
    layers = max(1, (tensors - 1) // per_layer)
    d = max(8, int(math.sqrt(0.9 * numel / (12 * layers))) // 8 * 8)
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d), (d,), (d,)]
    while len(shapes) < tensors - 1:
        shapes.append((d,))
    rest = numel - sum(math.prod(s) for s in shapes)
    shapes.append((max(1, rest // d), d))
    return shapes


def _bandwidth_gbs(numel: int, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth that simple torch kernels reach here, for reference (GB/s, best of ``repeats``).

    ``triad``: ``c = a + s * b`` (3 accesses per element; the write-allocate read of ``c`` is not
    counted, so this reads low); ``inplace``: ``a += b * c`` (4 accesses, every write in place like
    AdamW's). ``best`` is the larger.
    """
    numel = max(1 << 16, min(numel, 32 << 20))
    a, b, c = (torch.rand(numel, dtype=dtype) for _ in range(3))
    size = a.element_size()

    def best_time(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    triad = 3 * numel * size / best_time(lambda: torch.add(a, b, alpha=0.5, out=c)) / 1e9
    inplace = 4 * numel * size / best_time(lambda: a.addcmul_(b, c, value=1e-12)) / 1e9
    return {"triad": triad, "inplace": inplace, "best": max(triad, inplace)}


def _resolved(kwargs: dict, params: list[torch.Tensor]) -> str:
    """Which implementation ``torch.optim.AdamW(params, **kwargs)`` runs."""
    if kwargs.get("fused"):
        return "fused"
    if "foreach" in kwargs:
        return "foreach" if kwargs["foreach"] else "for-loop"
    try:  # what Adam's functional entry does when neither is given
        from torch.optim.optimizer import _default_to_fused_or_foreach
        _, foreach = _default_to_fused_or_foreach(params, False, use_fused=False)
        return "foreach" if foreach else "for-loop"
    except Exception:  # private helper moved
        return "unknown"


class _Mesh:
    """A 1-D CPU mesh over a 1-process gloo group (made here when there is none)."""

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.created = False
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.created = True
        elif dist.get_world_size() != 1:
            raise RuntimeError("cpu_adam's DTensor runs need a 1-process group (or none); "
                               f"this one has {dist.get_world_size()} processes")
        self.mesh = init_device_mesh("cpu", (1,))

    def close(self) -> None:
        import torch.distributed as dist
        if self.created and dist.is_initialized():
            dist.destroy_process_group()


def _run_variant(api: str, kwargs: dict, weights, grads, mesh, warmup: int, steps: int):
    """Step times of one variant and its updated weights (local tensors)."""
    if api == "dtensor":
        from torch.distributed.tensor import DTensor, Shard

        def wrap(t):
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
        params = [nn.Parameter(wrap(w.clone())) for w in weights]
        for p, g in zip(params, grads):
            p.grad = wrap(g)
    else:
        params = [nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g
    optimizer = torch.optim.AdamW(params, **HYPER, **kwargs)
    resolved = _resolved(kwargs, params)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        optimizer.step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    local = [p.detach().to_local() if api == "dtensor" else p.detach() for p in params]
    del optimizer, params
    return times, resolved, local


def _differences(reference: list[torch.Tensor], result: list[torch.Tensor]) -> tuple[float, float]:
    """Largest absolute difference, and that over the reference's largest magnitude."""
    abs_diff = 0.0
    scale = 0.0
    for ref, res in zip(reference, result):
        abs_diff = max(abs_diff, (res.float() - ref.float()).abs().max().item())
        scale = max(scale, ref.float().abs().max().item())
    return abs_diff, abs_diff / max(scale, 1e-30)


def run_cpu_adam(numel: int = 50_000_000, tensors: int = 128, threads: list[int] | None = None,
                 dtype: str = "fp32", steps: int = 3, warmup: int = 1, rounds: int = 2,
                 variants: list[str] | None = None, apis: list[str] | None = None,
                 out: str | os.PathLike | None = None, seed: int = 0, log=print) -> dict:
    """Measure each variant at each thread count; returns (and writes under ``out``) the report.

    ``rounds`` times, for each thread count, each variant runs ``warmup + steps`` steps from the same
    start (fresh optimizer); the variants' order rotates from round to round, so load from other
    processes falls on all of them alike. A variant's step time is the median of its timed steps
    over all rounds.
    """
    variants = list(variants or VARIANTS)
    apis = list(apis or APIS)
    unknown = [v for v in variants if v not in VARIANTS] + [a for a in apis if a not in APIS]
    if unknown:
        raise ValueError(f"unknown variant/api {unknown}; variants {list(VARIANTS)}, apis {list(APIS)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {list(DTYPES)}")
    if steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"--steps {steps} and --rounds {rounds} must be >= 1, --warmup {warmup} >= 0")
    torch_dtype = DTYPES[dtype]
    initial_threads = torch.get_num_threads()
    threads = list(threads or [initial_threads])
    if any(t < 1 for t in threads):
        raise ValueError(f"--threads {threads}: each must be >= 1")
    shapes = transformer_shapes(numel, tensors)
    total = sum(math.prod(s) for s in shapes)
    bytes_per_element = ACCESSES_PER_ELEMENT * torch.empty((), dtype=torch_dtype).element_size()
    # the reference (plain for-loop) runs whatever was asked, so every variant has a comparison
    order = [REFERENCE] + [(a, v) for a in apis for v in variants if (a, v) != REFERENCE]

    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=generator).to(torch_dtype) for s in shapes]
    grads = [(torch.randn(s, generator=generator) * 1e-2).to(torch_dtype) for s in shapes]

    report = {
        "config": {"numel": total, "numel_asked": numel, "tensors": len(shapes), "dtype": dtype,
                   "steps": steps, "warmup": warmup, "rounds": rounds, "seed": seed,
                   "hyper": {**HYPER, "betas": list(HYPER["betas"])},
                   "bytes_per_element": bytes_per_element, "reference": "/".join(REFERENCE),
                   "largest_tensor": max(math.prod(s) for s in shapes),
                   "smallest_tensor": min(math.prod(s) for s in shapes)},
        "machine": {"nproc": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "torch_threads_default": initial_threads,
                    "cpu_capability": _cpu_capability(),
                    "loadavg_start": _loadavg()},
        "bandwidth_gbs": {},
        "results": [],
    }
    # (threads, api, variant) -> {"times": [...], "resolved", "max_abs_diff", "max_rel_diff", "load": [...]}
    measured: dict[tuple, dict] = {}
    mesh = _Mesh() if "dtensor" in apis else None
    reference = None
    try:
        for round_ in range(rounds):
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                bandwidth = _bandwidth_gbs(total, torch_dtype)
                kept = report["bandwidth_gbs"].setdefault(str(n_threads), bandwidth)
                for key in bandwidth:
                    kept[key] = max(kept[key], bandwidth[key])
                log(f"[cpu_adam] round {round_ + 1}/{rounds} threads={torch.get_num_threads()} numel={total} "
                    f"tensors={len(shapes)} bandwidth: triad {bandwidth['triad']:.1f} GB/s, "
                    f"in-place {bandwidth['inplace']:.1f} GB/s, load {_load(_loadavg())}")
                shift = round_ % len(order)
                for api, variant in order[shift:] + order[:shift]:
                    times, resolved, local = _run_variant(
                        api, VARIANTS[variant], weights, grads, mesh.mesh if api == "dtensor" else None,
                        warmup, steps)
                    if reference is None:  # the first run is the reference's (shift 0 in round 0)
                        reference = local
                    abs_diff, rel_diff = _differences(reference, local)
                    entry = measured.setdefault((n_threads, api, variant), {
                        "times": [], "load": [], "resolved": resolved, "max_abs_diff": 0.0, "max_rel_diff": 0.0})
                    entry["times"] += times
                    entry["load"].append(_loadavg()[0] if _loadavg() else None)
                    entry["max_abs_diff"] = max(entry["max_abs_diff"], abs_diff)
                    entry["max_rel_diff"] = max(entry["max_rel_diff"], rel_diff)
                    log(f"[cpu_adam]   {api:7s} {variant:8s} ({resolved}): "
                        f"{statistics.median(times) * 1e3:9.1f} ms "
                        f"{total / statistics.median(times) / 1e6:8.1f} Melem/s max|diff|={abs_diff:.2e}")
                    if local is not reference:
                        del local
                    gc.collect()
            report["results"] = _rows(measured, threads, order, apis, variants, total, bytes_per_element,
                                      report["bandwidth_gbs"])
            if out is not None:
                _write(report, out)
    finally:
        torch.set_num_threads(initial_threads)
        if mesh is not None:
            mesh.close()
    report["machine"]["loadavg_end"] = _loadavg()
    report["recommendation"] = _recommend(report)
    if out is not None:
        _write(report, out)
    return report


def _rows(measured, threads, order, apis, variants, total, bytes_per_element, bandwidth) -> list[dict]:
    rows = []
    for n_threads in threads:
        mine = []
        for api, variant in order:
            entry = measured.get((n_threads, api, variant))
            if entry is None:
                continue
            median = statistics.median(entry["times"])
            gb_per_s = total * bytes_per_element / median / 1e9
            mine.append({
                "threads": n_threads, "api": api, "variant": variant, "kwargs": VARIANTS[variant],
                "resolved": entry["resolved"], "asked": api in apis and variant in variants,
                "step_s": median, "step_s_min": min(entry["times"]), "step_s_all": entry["times"],
                "elements_per_s": total / median, "elements_per_s_best": total / min(entry["times"]),
                "gb_per_s": gb_per_s, "of_bandwidth": gb_per_s / bandwidth[str(n_threads)]["best"],
                "max_abs_diff": entry["max_abs_diff"], "max_rel_diff": entry["max_rel_diff"],
                "loadavg_1min": entry["load"]})
        for row in mine:  # against torch's default on the same kind of parameter
            base = next((r for r in mine if r["api"] == row["api"] and r["variant"] == "default"), None)
            row["vs_default"] = base["step_s"] / row["step_s"] if base else None
        rows += mine
    return rows


def _loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cpu_capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return None


def _recommend(report: dict) -> dict:
    """Per api: the fastest (variant, threads) measured, against torch's default at the same thread count."""
    rows = report["results"]
    best = {}
    for api in dict.fromkeys(r["api"] for r in rows):
        fastest = max((r for r in rows if r["api"] == api), key=lambda r: r["elements_per_s"])
        best[api] = {"variant": fastest["variant"], "threads": fastest["threads"],
                     "elements_per_s": fastest["elements_per_s"], "gb_per_s": fastest["gb_per_s"],
                     "of_bandwidth": fastest["of_bandwidth"], "vs_default": fastest["vs_default"]}
    return {"best": best}


def format_markdown(report: dict) -> str:
    c, m = report["config"], report["machine"]
    lines = [
        f"AdamW step on the CPU: {c['numel'] / 1e6:.1f}M {c['dtype']} elements in {c['tensors']} tensors "
        f"(largest {c['largest_tensor'] / 1e6:.2f}M); step time: median of {c['steps']} steps after "
        f"{c['warmup']} warm-up, in each of {c.get('rounds', 1)} rounds; "
        f"{m['nproc']} cores, torch {m['torch']} ({m.get('cpu_capability')}); "
        f"load average {_load(m.get('loadavg_start'))} at start, {_load(m.get('loadavg_end'))} at end.",
        "",
        f"GB/s counts {c['bytes_per_element']} bytes per element. Memory bandwidth here (GB/s, "
        "`c = a + s*b` / in-place `a += b*c`): " + "; ".join(
            f"{t} thread{'s' if t != '1' else ''}: {b['triad']:.1f} / {b['inplace']:.1f}"
            for t, b in report["bandwidth_gbs"].items())
        + ". \"of bw\": GB/s over the better of the two. Max abs diff: updated weights against the plain "
        "for-loop run.",
        "",
        "| threads | params | variant | runs | step (ms) | min (ms) | Melem/s | GB/s | of bw | vs default "
        "| max abs diff |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['threads']} | {r['api']} | {r['variant']} | {r['resolved']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['step_s_min'] * 1e3:.1f} | "
            f"{r['elements_per_s'] / 1e6:.0f} | {r['gb_per_s']:.1f} | {r['of_bandwidth'] * 100:.0f}% | "
            f"{(r.get('vs_default') or float('nan')):.2f}x | {r['max_abs_diff']:.1e} |")
    busy = max([x[0] for x in (m.get("loadavg_start"), m.get("loadavg_end")) if x] or [0.0])
    if m.get("nproc") and busy > m["nproc"]:
        lines += ["", f"Host busy: 1-minute load average up to {busy:.1f} on {m['nproc']} cores while measuring; "
                  "runs with more threads than idle cores are slowed far more than the load suggests (torch's "
                  "OpenMP threads wait for each other at every op), so compare variants within one thread count."]
    rec = report.get("recommendation") or {}
    for api, b in rec.get("best", {}).items():
        lines.append("")
        lines.append(f"Fastest on {api} parameters: `{b['variant']}` at {b['threads']} thread(s), "
                     f"{b['elements_per_s'] / 1e6:.0f} Melem/s ({b['gb_per_s']:.1f} GB/s, "
                     f"{b['of_bandwidth'] * 100:.0f}% of the bandwidth reference), "
                     f"{b['vs_default'] or float('nan'):.2f}x torch's default.")
    return "\n".join(lines) + "\n"


def _load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load) if load else "n/a"


def _write(report: dict, out) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_adam.json").write_text(json.dumps(report, indent=1))
    (out / "cpu_adam.md").write_text(format_markdown(report))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_adam",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=50_000_000, help="elements in all tensors together (default 50M)")
    p.add_argument("--tensors", type=int, default=128, help="how many tensors (default 128)")
    p.add_argument("--threads", type=_ints, default=None,
                   help="torch threads, a comma list to measure several (default: torch's, "
                        f"{torch.get_num_threads()} here)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (state allocation)")
    p.add_argument("--rounds", type=int, default=2,
                   help="repeat every (threads, variant) this often, order rotated (default 2)")
    p.add_argument("--variants", type=_names, default=None, help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--apis", type=_names, default=None, help=f"subset of {','.join(APIS)}")
    p.add_argument("--out", default="runs/cpu_adam", help="folder for cpu_adam.json and cpu_adam.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run_cpu_adam(numel=args.numel, tensors=args.tensors, threads=args.threads, dtype=args.dtype,
                              steps=args.steps, warmup=args.warmup, rounds=args.rounds, variants=args.variants, apis=args.apis,
                              out=args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_markdown(report))
    print(f"[cpu_adam] wrote {Path(args.out) / 'cpu_adam.json'} and cpu_adam.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
