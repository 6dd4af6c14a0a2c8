"""THE experiment registry: every run of the paper, at paper scale and at laptop scale.

Snakemake (workflow/rules/*.smk), the `optimus` command (``--experiment NAME --scale S``) and,
later, the Parsl launcher all read this module; nothing else says how long a run is or where
it runs (house rule 2). Model shapes are not here: they live in optimus_core/presets.py.

    >>> from workflow.experiments import get, pretraining
    >>> exp = get("pretrain-mula-7b-a1b")
    >>> exp.paper.steps, exp.laptop.steps
    (953675, 240)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from optimus_core import presets
from optimus_core.config import ConfigError

Scale = Literal["laptop", "paper"]
TILES_PER_NODE = 12  # Aurora: 6 PVC GPUs x 2 tiles, one rank per tile


@dataclass(frozen=True)
class RunScale:
    """One experiment at one scale: what is trained, on how much data, on how many devices."""

    preset: str
    tokens: int  # training token budget
    devices: int  # GPU tiles (paper) or CPU processes (laptop)
    walltime_h: float = 0.0  # per PBS job (paper scale)
    extra: dict[str, Any] = field(default_factory=dict)  # further --set overrides

    def __post_init__(self):
        presets.get(self.preset)  # unknown preset names fail at import, not at submit time
        if self.tokens < self.tokens_per_step:
            raise ConfigError(f"tokens = {self.tokens}: less than one step ({self.tokens_per_step} tokens)")

    @property
    def tokens_per_step(self) -> int:
        p = presets.get(self.preset)
        return p.global_batch * p.seq_len

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_step)

    @property
    def nodes(self) -> int:
        return math.ceil(self.devices / TILES_PER_NODE)

    def overrides(self) -> dict[str, Any]:
        return {"train.steps": self.steps, **self.extra}


@dataclass(frozen=True)
class Experiment:
    name: str
    kind: Literal["pretrain"]
    paper: RunScale
    laptop: RunScale
    description: str = ""

    def scale(self, scale: Scale) -> RunScale:
        if scale not in ("laptop", "paper"):
            raise ConfigError(f"scale = {scale!r}: must be 'laptop' or 'paper'")
        return self.paper if scale == "paper" else self.laptop

    def run_id(self, scale: Scale) -> str:
        return f"{scale}-{self.name}"

    def describe(self) -> str:
        p, l = self.paper, self.laptop
        return (f"{self.name:24s} paper: {p.preset} {p.tokens / 1e12:.3g}T tokens, {p.steps:,} steps, "
                f"{p.devices} tiles ({p.nodes} nodes) | laptop: {l.preset} {l.tokens:,} tokens, "
                f"{l.steps} steps, {l.devices} proc")


T = 10**12
# Laptop budgets: 2 CPU cores, the whole `make reproduce` within 15 minutes.
LAPTOP_EVAL = {"train.eval_every": 40, "train.eval_batches": 4, "train.log_every": 1}

_REGISTRY = [
    Experiment(
        "pretrain-mula-1b", "pretrain",
        paper=RunScale("mula-1b", 4 * T, devices=3072, walltime_h=24),
        laptop=RunScale("mula-1b@laptop", 240 * 2048, devices=1, extra=LAPTOP_EVAL),
        description="dense Mula-1B on OLMoE-mix-0924 (4T tokens)",
    ),
    Experiment(
        "pretrain-mula-7b-a1b", "pretrain",
        paper=RunScale("mula-7b-a1b", 4 * T, devices=3072, walltime_h=24),
        laptop=RunScale("mula-7b-a1b@laptop", 240 * 2048, devices=1, extra=LAPTOP_EVAL),
        description="MoE Mula-7B-A1B (OLMoE-1B-7B) on OLMoE-mix-0924 (4T tokens)",
    ),
]
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in _REGISTRY}


def get(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ConfigError(f"experiment = {name!r}: unknown; known: {', '.join(EXPERIMENTS)}") from None


def pretraining() -> list[Experiment]:
    return [e for e in EXPERIMENTS.values() if e.kind == "pretrain"]
