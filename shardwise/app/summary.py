"""The end of a ``shardwise train`` run: ``summary.json``, ``loss.png`` and the lines printed, from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from .config import TrainConfig

__all__ = ["summarize", "finish", "model_label"]


def summarize(records: list[dict]) -> dict:
    """Numbers for the whole run from its ``metrics.jsonl`` records (every launch of a resumed run).

    Throughput is tokens over time of the steady steps: each launch's first step (allocation,
    warm-up) is left out unless nothing else is there. Tokens per step are differences of the
    cumulative ``tokens``, so launches on different numbers of ranks count right. ``pp_bubble``
    (``--pp`` runs): the mean over the steady steps of each step's measured bubble, averaged over
    the ranks (:class:`.pipeline_train.StageTimer` says what it counts).
    """
    launches: dict[int, list[dict]] = {}
    for r in records:
        launches.setdefault(r.get("launch", 1), []).append(r)
    step_tokens, previous = [], 0
    for r in records:
        step_tokens.append(r["tokens"] - previous)
        previous = r["tokens"]
    by_step = dict(zip((r["step"] for r in records), step_tokens))
    steady = [r for part in launches.values() for r in part[1:]] or records
    steady_time = sum(r["step_time_s"] for r in steady)
    tail = [r["loss"] for r in records[-10:]]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    bubbles = [r["pp_bubble"] for r in steady if r.get("pp_bubble") is not None]
    last_eval = {"eval_loss": evals[-1]["eval_loss"], "eval_perplexity": evals[-1]["eval_perplexity"],
                 "eval_step": evals[-1]["step"]} if evals else {}
    return {
        "steps": records[-1]["step"], "launches": len(launches),
        "resumed_at": [part[0]["step"] for part in list(launches.values())[1:]],
        "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
        "last10_mean_loss": sum(tail) / len(tail), "tokens": records[-1]["tokens"],
        "tokens_per_s": sum(by_step[r["step"]] for r in steady) / steady_time if steady_time > 0 else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "peak_mem_gib": max(r["mem_gib"] for r in records),
        "train_time_s": sum(part[-1]["elapsed_s"] for part in launches.values()),
        **({"pp_bubble": sum(bubbles) / len(bubbles)} if bubbles else {}),
        **last_eval,
    }


def model_label(cfg: TrainConfig) -> str:
    """What the run trains (summary, progress bar, plot): the preset, or the Hugging Face config or folder it
    came from (whose model is not the preset's; the preset gave only the training settings)."""
    if cfg.hf_config and cfg.hf_config != cfg.init_from:
        return f"hf-config:{Path(cfg.hf_config).name}"
    return f"init-from:{Path(cfg.init_from).name}" if cfg.init_from else cfg.preset


def finish(out_dir: Path, cfg: TrainConfig, n_params: int, world: int, wall_time: float,
           startup_time: float | None = None) -> dict:
    """Write ``summary.json`` and ``loss.png``, print the summary. ``wall_time``: this launch from its process's
    start; ``startup_time``: the part of it before the first step (imports, processes, data, model set-up)."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    label = model_label(cfg)
    summary = {"model": label, "preset": None if label != cfg.preset else cfg.preset, "params": n_params, "world_size": world, **summarize(records),
               "wall_time_s": wall_time, **({"startup_time_s": startup_time} if startup_time is not None else {}),
               "out_dir": str(out_dir)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(out_dir / "loss.png", records, summary["resumed_at"], cfg)
    mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] is not None else ""
    resumed = f" (resumed at step {', '.join(map(str, summary['resumed_at']))})" if summary["resumed_at"] else ""
    speed = f"{summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "tokens/s n/a"
    bubble = (f", pipeline bubble {100 * summary['pp_bubble']:.1f}% (time outside the stages' computation)"
              if "pp_bubble" in summary else "")
    startup = (f" (of which {startup_time:.1f}s start-up before the first step: imports, processes, data, model)"
               if startup_time is not None else "")
    evaluated = (f"  eval loss {summary['eval_loss']:.3f} (perplexity {summary['eval_perplexity']:.2f}) at step "
                 f"{summary['eval_step']}\n" if "eval_loss" in summary else "")
    print(f"\n{label}: {n_params / 1e6:.2f}M params, {world} ranks, {summary['steps']} steps{resumed}\n"
          f"  loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
          f"(last-10 mean {summary['last10_mean_loss']:.3f})\n"
          f"{evaluated}"
          f"  {speed}{mfu}{bubble}, peak mem {summary['peak_mem_gib']:.2f} GiB\n"
          f"  train {summary['train_time_s']:.1f}s, wall {wall_time:.1f}s{startup}\n"
          f"  outputs: {out_dir}/ (metrics.jsonl, loss.png, summary.json, config.json"
          f"{', tensorboard/' if cfg.tensorboard else ''}{', wandb/' if cfg.wandb else ''})", flush=True)
    return summary


def _plot(path: Path, records: list[dict], resumed_at: list[int], cfg: TrainConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], label="train")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", markersize=3, label="eval")
        ax_loss.legend(loc="upper center", fontsize=8)
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)",
                title=f"{model_label(cfg)}: training{' and eval' if evals else ''} loss")
    ax_speed.plot(steps, [r["tokens_per_s"] for r in records])
    ax_speed.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        for step in resumed_at:
            ax.axvline(step - 0.5, color="gray", linestyle="--", linewidth=0.8)
    if resumed_at:
        ax_loss.text(0.99, 0.98, "dashed: resumed", transform=ax_loss.transAxes, ha="right", va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

