"""Learning-rate schedules as pure functions of the step (so a resumed run recomputes them).

    end = decay_end(cfg.schedule, run_steps=cfg.train.steps, epoch_steps=loader.epoch_steps)
    lr = lr_at(step, end, cfg.optim.lr, cfg.schedule)
"""
from __future__ import annotations

import math

from ..config import ConfigError, ScheduleConfig


def decay_end(cfg: ScheduleConfig, run_steps: int, epoch_steps: int | None = None) -> int:
    """The step at which the decay reaches the floor (``schedule.decay_horizon``): the run's last
    step ("run"), the step after one epoch of whole global batches ("epoch", the paper's: its
    last step is one short of the floor), or the number given. ConfigError where an epoch or a
    given number of steps ends within the warmup."""
    horizon = cfg.decay_horizon
    if horizon == "run":
        end = run_steps - 1
    elif horizon == "epoch":
        if epoch_steps is None:
            raise ValueError("decay_horizon 'epoch' needs the epoch's steps (the training data's)")
        end = epoch_steps
    else:
        end = int(horizon)
    # a run shorter than its warmup is a legitimate (test) run; a horizon within it is a mistake
    if horizon != "run" and cfg.kind != "constant" and end <= cfg.warmup_steps:
        where = f"one epoch of the data is {epoch_steps} steps" if horizon == "epoch" else f"{end} steps"
        raise ConfigError(f"schedule.decay_horizon = {horizon!r}: {where}, which end within "
                          f"the warmup (schedule.warmup_steps = {cfg.warmup_steps}); shorten the warmup or "
                          "lengthen the horizon")
    return end


def lr_at(step: int, end: int, peak_lr: float, cfg: ScheduleConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based), the decay reaching its floor at step
    ``end`` (decay_end) and staying there.

    warmup:   linear to peak over warmup_steps, from 0 (peak x (step + 1) / warmup) or from the
              floor (floor + (peak - floor) x step / warmup; ``warmup_from = "min_lr"``)
    cosine:   cosine from peak at the end of the warmup to min_lr_ratio x peak at ``end``.
    wsd:      stable at peak, linear decay to the floor over the last decay_fraction of steps to ``end``.
    constant: peak.
    """
    floor = cfg.min_lr_ratio * peak_lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        if cfg.warmup_from == "min_lr":
            return floor + (peak_lr - floor) * step / cfg.warmup_steps
        return peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return peak_lr
    if cfg.kind == "cosine":
        span = max(end - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    total = end + 1
    decay_steps = max(int(round(cfg.decay_fraction * total)), 1)
    decay_start = total - decay_steps
    if step < decay_start:
        return peak_lr
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    return peak_lr + (floor - peak_lr) * progress
