"""The learning-rate schedule of ``shardwise train``: linear warm-up, cosine decay, and how a resumed run continues it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .config import TrainConfig

__all__ = ["LRSchedule", "lr_schedule", "resumed_schedule"]


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up then cosine decay, possibly continuing from ``(start, start_lr)`` of a resumed run.

    For ``start < step <= warmup_end`` the rate rises linearly from ``start_lr`` to ``peak``;
    after ``warmup_end`` it follows a cosine from ``top`` down to ``floor`` at step ``end``.
    ``settings`` are the flags it was made from (steps, lr, min_lr_ratio, warmup_steps): a resumed
    run with the same flags keeps the checkpoint's schedule exactly.
    """

    peak: float
    floor: float
    end: int
    warmup_end: int
    top: float
    start: int = 0
    start_lr: float = 0.0
    settings: tuple = ()
    note: str = ""

    def __call__(self, step: int) -> float:
        if step <= self.warmup_end:
            return self.start_lr + (self.peak - self.start_lr) * (step - self.start) / (self.warmup_end - self.start)
        begin = max(self.warmup_end, self.start)
        progress = min(1.0, (step - begin) / max(1, self.end - begin))
        return self.floor + (self.top - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def describe(self) -> str:
        parts = []
        if self.start:
            parts.append(f"continues from {self.start_lr:.3g} at step {self.start}")
        if self.warmup_end > self.start:
            parts.append(f"linear warm-up to {self.peak:.3g} over steps {self.start + 1}-{self.warmup_end}")
        begin = max(self.warmup_end, self.start)
        if math.isclose(self.top, self.floor, rel_tol=1e-6):
            parts.append(f"constant at the floor {self.floor:.3g} over steps {begin + 1}-{self.end}")
        else:
            parts.append(f"cosine decay from {self.top:.3g} to {self.floor:.3g} over steps {begin + 1}-{self.end}")
        return "lr: " + ", then ".join(parts) + (f" ({self.note})" if self.note else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "settings": list(self.settings)}

    @classmethod
    def from_dict(cls, d: dict) -> "LRSchedule":
        return cls(**{**d, "settings": tuple(d.get("settings", ()))})


def _settings(cfg: TrainConfig) -> tuple:
    return (cfg.steps, cfg.lr, cfg.min_lr_ratio, cfg.warmup_steps)


def lr_schedule(cfg: TrainConfig) -> LRSchedule:
    """The schedule of a new run: warm-up (at most half of --steps), then cosine decay to the floor."""
    warmup = min(cfg.warmup_steps, cfg.steps // 2)
    note = (f"warm-up capped at half of --steps {cfg.steps}; --warmup-steps is {cfg.warmup_steps}"
            if warmup < cfg.warmup_steps else "")
    return LRSchedule(peak=cfg.lr, floor=cfg.lr * cfg.min_lr_ratio, end=cfg.steps, warmup_end=warmup,
                      top=cfg.lr, settings=_settings(cfg), note=note)


def resumed_schedule(saved: LRSchedule | None, cfg: TrainConfig, step: int) -> LRSchedule:
    """The schedule after resuming at checkpoint ``step``: the saved one, or one that continues it.

    When --steps, --lr, --min-lr-ratio or --warmup-steps differ from the checkpoint's run, the
    rate continues from where it was (no jump): a warm-up still under way goes on to --lr at the
    new warm-up end; otherwise the cosine decays from the current rate to the floor at --steps.
    """
    fresh = lr_schedule(cfg)
    if saved is None or saved.settings == fresh.settings:
        return saved or fresh
    lr_now = saved(step)
    old = dict(zip(("steps", "lr", "min_lr_ratio", "warmup_steps"), saved.settings))
    changed = ", ".join(f"--{k.replace('_', '-')} {old[k]:g} -> {getattr(cfg, k):g}" for k in old
                        if old[k] != getattr(cfg, k))
    note = f"changed since the checkpoint: {changed}" if changed else ""
    if cfg.steps > step and math.isclose(lr_now, fresh.floor, rel_tol=1e-6):  # it would train flat at the floor
        note += (f"; the rate already decayed to its floor {lr_now:.3g} by step {step}, so steps {step + 1}-"
                 f"{cfg.steps} stay there: for a decay over all {cfg.steps} steps, start a new run with --steps "
                 f"{cfg.steps} (the first launch's --steps sets the schedule)")
    if step < saved.warmup_end and step < fresh.warmup_end:  # still warming up: go on to the peak
        return replace(fresh, start=step, start_lr=lr_now, note=note)
    return replace(fresh, start=step, start_lr=lr_now, warmup_end=step, top=lr_now, note=note)

