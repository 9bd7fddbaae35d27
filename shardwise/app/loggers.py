"""``shardwise train --tensorboard / --wandb``: the metrics where torchtitan and Megatron-LM users look.

Rank 0 only, from the same record that goes to ``metrics.jsonl``: ``train/loss``,
``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/mem_gib``
(``train/mfu`` on GPUs), and ``eval/loss``, ``eval/perplexity`` at the steps that
evaluate; the x axis is the optimizer step.

* TensorBoard (``torch.utils.tensorboard``, needs the ``tensorboard`` package):
  event files in ``<out-dir>/tensorboard``; a resumed run opens them with
  ``purge_step`` at its first step, so TensorBoard drops the steps it redoes.
* Weights & Biases (``wandb``): offline by default (``WANDB_MODE`` overrides, as
  everywhere in wandb), files under ``<out-dir>/wandb``; the run id is kept in
  ``<out-dir>/wandb-run-id`` so a resumed run continues the same W&B run.
  ``wandb sync <out-dir>/wandb/offline-run-*`` uploads it later.

Both are optional extras; a flag whose package is missing is refused before
training with a line saying how to install it.
"""

from __future__ import annotations

import importlib
import os
import secrets
from pathlib import Path

__all__ = ["missing_package", "RunLoggers", "TENSORBOARD_DIR", "WANDB_ID_FILE", "SCALARS"]

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-run-id"
# record key -> logged name
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
           "mem_gib": "train/mem_gib", "mfu": "train/mfu", "eval_loss": "eval/loss",
           "eval_perplexity": "eval/perplexity"}
_INSTALL = {"tensorboard": "pip install 'shardwise[tensorboard]' (or pip install tensorboard)",
            "wandb": "pip install 'shardwise[wandb]' (or pip install wandb)"}


def missing_package(flag: str) -> str | None:
    """Why ``--tensorboard`` / ``--wandb`` cannot run here (its package is not installed), or ``None``."""
    try:
        importlib.import_module("torch.utils.tensorboard" if flag == "tensorboard" else "wandb")
    except ImportError:
        return f"needs the {flag} package, which is not installed (an optional extra): {_INSTALL[flag]}"
    return None


class RunLoggers:
    """The loggers the flags ask for, on rank 0; ``log(record)`` after each step, ``close()`` at the end."""

    def __init__(self, cfg, out_dir: Path, start_step: int, config: dict):
        self.writer = self.wandb_run = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out_dir / TENSORBOARD_DIR), flush_secs=10,
                                        purge_step=start_step if start_step > 1 else None)
        if cfg.wandb:
            import wandb

            id_file = out_dir / WANDB_ID_FILE
            resumed = start_step > 1 and id_file.is_file()
            run_id = id_file.read_text().strip() if resumed else secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
            self.wandb_run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "shardwise"), name=out_dir.name, id=run_id,
                resume="allow", dir=str(out_dir), config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, record: dict) -> None:
        values = {name: float(record[key]) for key, name in SCALARS.items() if record.get(key) is not None}
        step = record["step"]
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
