"""Learning-rate schedules as pure functions of the step (so a resumed run recomputes them)."""
from __future__ import annotations

import math

from ..config import ScheduleConfig


def lr_at(step: int, total_steps: int, peak_lr: float, cfg: ScheduleConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    cosine:   linear warmup to peak, cosine decay to min_lr_ratio * peak at the last step.
    wsd:      warmup, stable at peak, linear decay to min over the last decay_fraction of steps.
    constant: warmup, then peak.
    """
    floor = cfg.min_lr_ratio * peak_lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return peak_lr
    if cfg.kind == "cosine":
        span = max(total_steps - 1 - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(int(round(cfg.decay_fraction * total_steps)), 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return peak_lr
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    return peak_lr + (floor - peak_lr) * progress
