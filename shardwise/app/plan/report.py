"""How a plan reads: a ranked table, the recommendation and why; or the same as JSON."""

from __future__ import annotations

import json

from .planner import Plan

__all__ = ["render", "as_json"]


def render(found: Plan, top: int = 12) -> str:
    c = found.cluster
    lines = [f"shardwise plan: {found.model} on {c.gpus} x {c.gpu.name} ({c.gpus_per_node} per node), seq "
             f"{found.seq}, global batch {found.global_batch} sequences",
             f"{len(found.rows)} candidates, {sum(r.fits for r in found.rows)} fit in "
             f"{c.gpu.hbm_bytes / 2**30:.0f} GiB",
             "",
             f"{'#':>3}  {'configuration':46s} {'fits':4s} {'peak GiB':>8s} {'step s':>8s} {'tok/s/GPU':>10s} "
             f"{'MFU':>6s}  dominant   (MFU: model FLOPs over the bf16 peak)"]
    for i, r in enumerate(found.rows[:top], 1):
        peak = f"{'>' if r.memory.bound else ''}{r.memory.peak / 2**30:.1f}"  # >: the fast path's bound, not traced
        lines.append(f"{i:>3}  {r.candidate.label():46s} {'yes' if r.fits else 'no':4s} {peak:>8s} "
                     f"{r.time.seconds:8.3f} {r.tokens_per_s_per_gpu:10,.0f} {r.mfu:6.1%}  {r.time.dominant()}")
    best = found.recommended
    lines.append("")
    if best is not None:
        parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in sorted(best.memory.parts.items(), key=lambda kv: (-kv[1], kv[0]))
                          if v >= 2**27)
        terms = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in best.time.terms.items() if v >= 5e-4)
        lines += [f"recommended: {best.candidate.label()}",
                  f"  memory: peak {best.memory.peak / 2**30:.1f} GiB per GPU at {best.memory.phase} ({parts})"
                  + (f", host {best.memory.host / 2**30:.1f} GiB per GPU" if best.memory.host else ""),
                  f"  step: {best.time.seconds:.3f} s ({terms})",
                  f"  why: {found.why()}"]
    else:
        lines.append(f"recommended: none; {found.why()}")
    if any(r.memory.bound for r in found.rows[:top]):
        lines.append("(peak >N: a lower bound, not traced: what must be live at once already passes the device)")
    if found.dry_run is not None:
        from .dry_run_report import render_dry_run

        lines += ["", render_dry_run(found.dry_run, best)]
    return "\n".join(lines)


def as_json(found: Plan) -> str:
    c = found.cluster
    best = found.recommended
    return json.dumps({
        "model": found.model, "seq": found.seq, "global_batch": found.global_batch,
        "cluster": {"gpus": c.gpus, "gpus_per_node": c.gpus_per_node, "gpu": c.gpu.name,
                    "hbm_gib": c.gpu.hbm_bytes / 2**30},
        "recommended": best.as_dict() if best else None, "why": found.why(),
        "candidates": [r.as_dict() for r in found.rows],
        "dry_run": found.dry_run.as_dict() if found.dry_run is not None else None,
    }, indent=1)
