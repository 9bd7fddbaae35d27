"""Benchmark results: per-run records, a per-wrapper summary, JSON, a markdown table and a bar chart.

A *run* is one wrapper trained once on one size (the dicts
:func:`shardwise.app.bench.runner.run_one` returns). A *row* summarizes the runs of
one (size, wrapper, mode) over the repeats: mean tokens/s, the largest peak
memory and exposed communication, and the comparison against FSDP2 of the same
size and mode (ratios of the means; the loss check per repeat against FSDP2's
run of that repeat, which trained on the same data from the same weights) and
against the compute-only ceiling (``none``) of the same size and mode. The mode
is eager or compiled (each layer's forward compiled; "+compile" after the name).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["REFERENCE", "CEILING", "label", "annotate", "summarize", "markdown_table", "markdown_report", "write_json",
           "plot", "write_reports", "format_run"]

REFERENCE = "fsdp2"
CEILING = "none"


def _ok(run: dict) -> bool:
    return run.get("status") == "ok"


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _max(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return max(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _compiled(run: dict) -> bool:
    return bool(run.get("compiled", False))


def _mode(run: dict) -> tuple[bool, str, bool, str]:
    """A run's mode: compiled or not, its FP8 recipe ("" for bf16 linears), CUDA graphs or not, its optimizer
    ("adamw", or "muon": ``--optimizer``); runs compare within a mode."""
    return _compiled(run), run.get("fp8") or "", bool(run.get("cuda_graphs", False)), run.get("optimizer") or "adamw"


def label(run: dict) -> str:
    """The wrapper's name, with "+compile" for a compiled run or row and "+fp8 RECIPE" for FP8 linears."""
    return (run["wrapper"] + (" +compile" if _compiled(run) else "") + (f" +fp8 {run['fp8']}" if run.get("fp8") else "")
            + (" +graphs" if run.get("cuda_graphs") else "") + (" +muon" if run.get("optimizer") == "muon" else ""))


def annotate(runs: list[dict], loss_rtol: float) -> list[dict]:
    """Add each run's comparison with FSDP2's and the ceiling's runs of the same size, repeat and mode
    (in place)."""
    refs = {(r["size"], r["repeat"], _mode(r)): r for r in runs if r["wrapper"] == REFERENCE and _ok(r)}
    ceilings = {(r["size"], r["repeat"], _mode(r)): r for r in runs if r["wrapper"] == CEILING and _ok(r)}
    for run in runs:
        key = (run["size"], run["repeat"], _mode(run))
        ref, ceiling = refs.get(key), ceilings.get(key)
        run["ceiling_ratio"] = (_ratio(run["tokens_per_s_per_gpu"], ceiling["tokens_per_s_per_gpu"])
                                if _ok(run) and ceiling is not None else None)
        if not _ok(run) or ref is None:
            run.update(loss_rel_diff=None, loss_ok=None, tokens_ratio=None, mem_ratio=None)
            continue
        diff = abs(run["loss_last"] - ref["loss_last"]) / abs(ref["loss_last"])
        run.update(loss_rel_diff=diff, loss_ok=bool(diff <= loss_rtol),
                   tokens_ratio=_ratio(run["tokens_per_s_per_gpu"], ref["tokens_per_s_per_gpu"]),
                   mem_ratio=_ratio(run["peak_alloc_gib"], ref["peak_alloc_gib"]))
    return runs


def summarize(runs: list[dict], loss_rtol: float) -> list[dict]:
    """One row per (size, wrapper, mode), in the order they first ran."""
    annotate(runs, loss_rtol)
    keys = list(dict.fromkeys((r["size"], r["wrapper"], _mode(r)) for r in runs))
    rows = []
    for size, wrapper, mode in keys:
        mine = [r for r in runs if r["size"] == size and r["wrapper"] == wrapper and _mode(r) == mode]
        ok = [r for r in mine if _ok(r)]
        row = {"size": size, "wrapper": wrapper, "compiled": mode[0], "fp8": mode[1] or None, "cuda_graphs": mode[2],
               "optimizer": mode[3], **{k: mine[0][k] for k in ("ns_flops_per_rank", "ns_imbalance") if k in mine[0]},
               "params": mine[0]["params"],
               "device": mine[0]["device"], "world_size": mine[0]["world_size"], "runs": len(mine),
               "ok_runs": len(ok)}
        if not ok:
            row.update(status=mine[0]["status"], reason=mine[0].get("reason", ""))
            rows.append(row)
            continue
        row.update(
            status="ok",
            tokens_per_s_per_gpu=_mean([r["tokens_per_s_per_gpu"] for r in ok]),
            tokens_per_s_per_repeat=[r["tokens_per_s_per_gpu"] for r in ok],
            mfu=_mean([r["mfu"] for r in ok]),
            peak_alloc_gib=_max([r["peak_alloc_gib"] for r in ok]),
            peak_reserved_gib=_max([r["peak_reserved_gib"] for r in ok]),
            exposed_comm_frac=_max([r["exposed_comm_frac"] for r in ok]),
            exposed_comm_ms_per_step=_max([r["exposed_comm_ms_per_step"] for r in ok]),
            loss_first=ok[0]["loss_first"], loss_last=ok[0]["loss_last"],
            loss_rel_diff=_max([r["loss_rel_diff"] for r in ok]),
            loss_ok=None if any(r["loss_ok"] is None for r in ok) else all(r["loss_ok"] for r in ok),
            graph_breaks=_max([r.get("graph_breaks") for r in ok]),
            frames_compiled_timed=_max([r.get("frames_compiled_timed") for r in ok]),
        )
        rows.append(row)
    refs = {(r["size"], _mode(r)): r for r in rows if r["wrapper"] == REFERENCE and r["status"] == "ok"}
    ceilings = {(r["size"], _mode(r)): r for r in rows if r["wrapper"] == CEILING and r["status"] == "ok"}
    for row in rows:
        ref, ceiling = refs.get((row["size"], _mode(row))), ceilings.get((row["size"], _mode(row)))
        ok = row["status"] == "ok"
        row["ceiling_ratio"] = (_ratio(row["tokens_per_s_per_gpu"], ceiling["tokens_per_s_per_gpu"])
                                if ok and ceiling is not None else None)
        if not ok or ref is None:
            row.update(tokens_ratio=None, mem_ratio=None)
            continue
        row["tokens_ratio"] = _ratio(row["tokens_per_s_per_gpu"], ref["tokens_per_s_per_gpu"])
        row["mem_ratio"] = _ratio(row["peak_alloc_gib"], ref["peak_alloc_gib"])
    return rows


# ------------------------------------------------------------------ text
def _f(value, fmt: str, none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, fmt)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def markdown_table(rows: list[dict]) -> str:
    cpu = all(r["device"] == "cpu" for r in rows)
    mem = "peak RSS GiB (host)" if cpu else "peak alloc GiB"
    head = (f"| size | wrapper | tokens/s/{'rank' if cpu else 'GPU'} | vs FSDP2 | vs ceiling | MFU | {mem} | vs FSDP2 "
            "| peak reserved GiB | exposed comm | loss first -> last | loss vs FSDP2 | check |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        name = f"{r['size']} ({_params(r['params'])})"
        if r["status"] != "ok":
            lines.append(f"| {name} | {label(r)} | {r['status']}: {r.get('reason', '')} "
                         "| | | | | | | | | | |")
            continue
        per_repeat = r["tokens_per_s_per_repeat"]
        speed = f"{r['tokens_per_s_per_gpu']:,.0f}"
        if len(per_repeat) > 1:
            speed += " (" + ", ".join(f"{v:,.0f}" for v in per_repeat) + ")"
        exposed = "n/a" if r["exposed_comm_frac"] is None else (
            f"{100 * r['exposed_comm_frac']:.1f}% ({r['exposed_comm_ms_per_step']:.1f} ms/step)")
        check = {None: "n/a", True: "pass", False: "FAIL"}[r["loss_ok"]]
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {name} | {label(r)} | {speed} | {_f(r['tokens_ratio'], '.3f')}x "
            f"| {_f(r.get('ceiling_ratio'), '.3f')}x | {mfu} "
            f"| {_f(r['peak_alloc_gib'], '.2f')} | {_f(r['mem_ratio'], '.3f')}x "
            f"| {_f(r['peak_reserved_gib'], '.2f')} | {exposed} "
            f"| {r['loss_first']:.4f} -> {r['loss_last']:.4f} | {_f(r['loss_rel_diff'], '.2e')} | {check} |")
    return "\n".join(lines) + "\n"


def markdown_report(rows: list[dict], meta: dict) -> str:
    when = meta.get("date", "")
    lines = [f"# shardwise bench ({when})", ""]
    for key in ("command", "device_name", "world_size", "torch", "nccl", "versions"):
        if meta.get(key) not in (None, "", {}):
            value = meta[key]
            if isinstance(value, dict):
                value = ", ".join(f"{k}: {v}" for k, v in value.items())
            lines.append(f"- {key}: `{value}`" if key == "command" else f"- {key}: {value}")
    for name, size in meta.get("sizes", {}).items():
        lines.append(
            f"- {name}: dim {size.get('dim')}, {size.get('n_layers')} layers, {size.get('n_heads')}/"
            f"{size.get('n_kv_heads')} heads, ffn {size.get('ffn_hidden')}, vocab {size.get('vocab_size')}, "
            f"seq {size.get('seq_len')}, micro-batch {size.get('micro_batch')}, activation checkpointing "
            f"{'on' if size.get('activation_checkpointing') else 'off'}; {size.get('warmup')} warm-up + "
            f"{size.get('steps')} timed + {size.get('profile_steps', 0)} profiled steps")
    lines += ["", markdown_table(rows), *_notes(meta)]
    if rows and all(r["device"] == "cpu" for r in rows):
        lines += ["On CPU, per GPU means per rank (process). The tiny model on CPU is a smoke test of every "
                  "wrapper's code path: its speed and memory ratios say little about GPUs.", ""]
    return "\n".join(lines)


def _notes(meta: dict) -> list[str]:
    rtol = meta.get("loss_rtol")
    return [
        "Measured: tokens/s per GPU over the timed steps after the warm-up steps (device-synchronized "
        "wall clock, slowest rank); MFU = tokens/s x (6 x params + 12 x layers x dim x seq) / 989e12; "
        "peak memory = maximum over ranks of the allocator's peaks over warm-up + timed steps, reset after "
        "wrapping (the unsharded model built before wrapping is not counted; optimizer state is); "
        "exposed comm = time a NCCL kernel runs while no other GPU kernel/memcpy/memset does, over the "
        "profiled steps, divided by their wall time (worst rank); loss = mean over ranks at the first "
        "warm-up step and the last timed step; check = last-step loss within "
        f"{_f(rtol, '.2e')} relative of FSDP2's on the same data. Ratios are against FSDP2 in the same job.",
        "",
        "vs ceiling = tokens/s over those of `none` in the same job and mode: the same model, bf16 "
        "weights, each rank its own replica, no communication (its loss differs from FSDP2's by the bf16 "
        "rounding of its weight updates). +compile = each layer's forward compiled with torch.compile "
        "(shardwise.compile_units; the others torch.compile(layer) before wrapping, as torchtitan does). "
        "+fp8 = torchao Float8Linear for every linear but the output head (shardwise bench --fp8); within an "
        "FP8 mode, FSDP2 and the ceiling are FP8 too (fsdp2-fp8ag: with torchao's FP8 all-gather; "
        "shardwise-fp8ag: shardwise gathering FP8 bytes).",
        "",
    ]


def format_run(run: dict) -> str:
    """One line for a finished run, printed as soon as it ends."""
    head = f"[{run['size']} r{run['repeat']}] {label(run):22s}"
    if run["status"] != "ok":
        return f"{head} {run['status']}: {run.get('reason', '')}"
    mem = "peak RSS" if run["device"] == "cpu" else "peak alloc"
    mfu = f" MFU {100 * run['mfu']:.1f}%" if run.get("mfu") is not None else ""
    exposed = ("" if run.get("exposed_comm_frac") is None
               else f" exposed comm {100 * run['exposed_comm_frac']:.1f}%")
    reserved = ("" if run.get("peak_reserved_gib") is None else f" reserved {run['peak_reserved_gib']:.2f} GiB")
    compiled = ""
    if run.get("graph_breaks") is not None:
        first = "" if run.get("first_step_s") is None else f", first step {run['first_step_s']:.1f}s"
        compiled = (f"{first}, {run['graph_breaks']} graph breaks, "
                    f"{run['frames_compiled_timed']} recompiles while timed")
    per = "rank" if run["device"] == "cpu" else "GPU"  # on CPU a rank is a process, not a GPU
    return (f"{head} {run['tokens_per_s_per_gpu']:,.0f} tok/s/{per}{mfu} {mem} {run['peak_alloc_gib']:.2f} GiB"
            f"{reserved}{exposed} loss {run['loss_first']:.4f} -> {run['loss_last']:.4f} "
            f"(wrap {run['wrap_s']:.1f}s, step {1000 * run['step_s']:.0f} ms{compiled}){_muon_line(run)}")


def _muon_line(run: dict) -> str:
    """``--optimizer muon``: the Newton-Schulz GFLOPs each rank owns, their imbalance, Muon's step time per rank."""
    flops = run.get("ns_flops_per_rank")
    if not flops:
        return ""
    seconds = run.get("muon_step_s_per_rank")
    timed = "" if not seconds else ", Muon step ms/rank " + "/".join(f"{1000 * s:.0f}" for s in seconds)
    if run.get("ns_predicted_ms") is not None:  # the planner's term, to hold against (muon - adamw) step time
        timed += f", planner's Newton-Schulz term {run['ns_predicted_ms']:.1f} ms"
    return (f"\n    Newton-Schulz GFLOP/rank {'/'.join(f'{f / 1e9:.2f}' for f in flops)} "
            f"(max/mean {run['ns_imbalance']:.3f}){timed}")


# ------------------------------------------------------------------ files
def write_json(path: Path, meta: dict, runs: list[dict], rows: list[dict]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=2, default=str) + "\n")


def plot(path: Path, rows: list[dict]) -> None:
    """Bar chart: tokens/s per GPU (top) and peak memory (bottom), one column per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.2 * len(sizes), 6.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    wrappers = list(dict.fromkeys(label(r) for r in rows))
    for col, size in enumerate(sizes):
        mine = [r for r in rows if r["size"] == size]
        labels = [label(r) for r in mine]
        color = [colors[wrappers.index(w) % len(colors)] for w in labels]
        cpu = mine[0]["device"] == "cpu"
        for ax, key, title in ((axes[0][col], "tokens_per_s_per_gpu", f"tokens/s per {'rank' if cpu else 'GPU'}"),
                               (axes[1][col], "peak_alloc_gib",
                                "peak RSS GiB (host)" if cpu else "peak allocated GiB")):
            values = [r.get(key) or 0.0 for r in mine]
            bars = ax.bar(range(len(mine)), values, color=color)
            for bar, r in zip(bars, mine):
                digits = 0 if key.startswith("tok") else 2
                text = r["status"] if r["status"] != "ok" else f"{r.get(key) or 0:,.{digits}f}"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(mine)), labels, rotation=20, fontsize=8)
            ax.set_title(f"{size} ({_params(mine[0]['params'])}): {title}", fontsize=9)
            ax.margins(y=0.12)
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(out_dir, meta: dict, runs: list[dict], png: bool = True) -> str:
    """Write ``bench.json``, ``bench.md`` (and ``bench.png``) under ``out_dir``; return the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs, meta.get("loss_rtol", 1.6e-2))
    write_json(out / "bench.json", meta, runs, rows)
    (out / "bench.md").write_text(markdown_report(rows, meta))
    if png and rows:
        try:
            plot(out / "bench.png", rows)
        except Exception as e:  # noqa: BLE001 - e.g. no matplotlib on the machine: keep the rest
            print(f"shardwise bench: no bench.png ({type(e).__name__}: {e})", flush=True)
    return markdown_table(rows)
