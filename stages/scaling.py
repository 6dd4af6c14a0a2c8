"""Stage `scaling`: a strong-scaling sweep measured on the hardware at hand.

    from stages.scaling import ScalingConfig, ScalingOutputs, run_scaling
    result = run_scaling(ScalingConfig(preset="mula-7b-a1b@laptop", devices=(1, 2)),
                         ScalingOutputs(store=Path("results/store.zarr"), jsonl=Path("results/scaling/cpu.jsonl")))
    result.points    # one dict per device count (the contract of workflow/perfmodel.py)

Every point trains the same model at the same global batch (strong scaling) for ``warmup`` +
``steps`` steps on ``n`` local ranks (CPU processes with gloo, or one GPU each with nccl / xccl)
started fresh for that point, and records the step time split into compute, expert all-to-all,
gradient reduce-scatter / all-gather, optimizer and idle (optimus_core.train.measure) with

    efficiency(n) = T(base) x base / (T(n) x n)      base = the smallest device count swept.

``ep="all"`` splits the experts over every rank of each point (ep = n); an integer keeps one EP
degree (it must divide every n swept). The points go to the results store as run ``run_id``
(table ``scaling``, one row per device count, ``step`` = device count; strings in the run's
attrs) and, one JSON line each, to ``jsonl``. On the CPU each rank gets ``threads_per_rank``
threads (1: n ranks use n cores, so the sweep measures processes, not threads).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError, RunConfig

TABLE = "scaling"
STRING_FIELDS = ("preset", "device", "optimizer", "experts_backend", "dtype")


@dataclass
class ScalingConfig:
    preset: str
    devices: tuple[int, ...] = (1, 2)
    ep: Union[int, str] = "all"  # "all": ep = n on n ranks; an int: that EP degree everywhere
    optimizer: str = "ep_aware"
    global_batch: int = 0  # sequences per step, fixed across the sweep (0: the preset's)
    micro_batch: int = 0  # sequences per forward/backward (0: the whole local batch)
    steps: int = 5
    warmup: int = 2
    device: str = "cpu"  # cpu | cuda | xpu | auto
    threads_per_rank: int = 1  # CPU threads of each rank
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted config paths
    run_id: str = ""  # "" = scaling-<preset>-<device>

    def __post_init__(self):
        self.devices = tuple(sorted(set(int(n) for n in self.devices)))
        if not self.devices or self.devices[0] < 1:
            raise ConfigError(f"scaling.devices = {list(self.devices)}: need device counts >= 1")
        if self.ep != "all" and not (isinstance(self.ep, int) and self.ep >= 1):
            raise ConfigError(f"scaling.ep = {self.ep!r}: must be 'all' or an integer >= 1")
        for name in ("steps", "threads_per_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scaling.{name} = {getattr(self, name)}: must be >= 1")
        if self.warmup < 0:
            raise ConfigError(f"scaling.warmup = {self.warmup}: must be >= 0")

    def ep_for(self, n: int) -> int:
        return n if self.ep == "all" else int(self.ep)

    def run_config(self, n: int) -> RunConfig:
        """The validated RunConfig of the point with ``n`` ranks (a bad layout fails here)."""
        from optimus_core import presets
        from optimus_core.parallel.mesh import group_layout

        overrides = {**self.overrides, "parallel.ep": self.ep_for(n), "parallel.optimizer": self.optimizer,
                     "train.device": "auto" if self.device == "auto" else self.device}
        if self.global_batch:
            overrides["train.global_batch"] = self.global_batch
        if self.micro_batch:
            overrides["train.micro_batch"] = self.micro_batch
        cfg = presets.get(self.preset).run_config(**overrides)
        moe = cfg.model.moe
        group_layout(n, cfg.parallel.ep, moe.n_experts if moe else None)
        local = cfg.train.global_batch // n
        if cfg.train.global_batch % n or (cfg.train.micro_batch and local % cfg.train.micro_batch):
            raise ConfigError(f"train.global_batch = {cfg.train.global_batch} sequences: must split evenly over "
                              f"{n} ranks (and into micro-batches of {cfg.train.micro_batch})")
        return cfg


@dataclass
class ScalingOutputs:
    store: Path | None = None
    jsonl: Path | None = None


@dataclass
class ScalingResult:
    run_id: str
    points: list[dict]


def device_slug(requested: str) -> str:
    """"cpu", or the accelerator's name as a file-name slug ("nvidia-h200")."""
    import re

    from optimus_core.device import device_info

    info = device_info(requested)
    return "cpu" if info.type == "cpu" else re.sub(r"[^a-z0-9]+", "-", info.name.lower()).strip("-")


def _rank_main(cfg_json: str, steps: int, warmup: int, threads: int, out_path: str) -> None:
    """One rank of one point (spawned): join the world, measure, rank 0 writes the point."""
    import torch

    from optimus_core.parallel import init_distributed, shutdown
    from optimus_core.train.measure import measure_steps

    torch.set_num_threads(threads)
    cfg = RunConfig.from_json(cfg_json)
    moe = cfg.model.moe
    mesh = init_distributed(cfg.parallel, n_experts=moe.n_experts if moe else None, device=cfg.train.device)
    try:
        point = measure_steps(cfg, mesh, steps=steps, warmup=warmup)
    finally:
        shutdown(mesh)
    if mesh.rank == 0:
        atomic_write(out_path, json.dumps(point))


def measure_point(config: ScalingConfig, n: int) -> dict:
    """Run one point on ``n`` fresh local ranks and return its measurement."""
    from optimus_core.parallel.launch import spawn_local

    cfg = config.run_config(n)
    with tempfile.TemporaryDirectory(prefix="optimus-scaling-") as tmp:
        out = Path(tmp) / "point.json"
        spawn_local(_rank_main, n, (cfg.to_json(), config.steps, config.warmup, config.threads_per_rank, str(out)))
        point = json.loads(out.read_text())
    moe = cfg.model.moe
    point.update(preset=config.preset, overrides=dict(config.overrides), device=device_slug(config.device),
                 optimizer=config.optimizer if n > 1 else "local", global_batch=cfg.train.global_batch,
                 micro_batch=cfg.train.micro_batch or cfg.train.global_batch // n, seq_len=cfg.data.seq_len,
                 dtype=cfg.train.dtype, experts_backend=moe.experts_backend if moe else "none",
                 threads_per_rank=config.threads_per_rank)
    return point


def add_efficiency(points: list[dict]) -> list[dict]:
    """efficiency = T(base) x base / (T(n) x n) against the smallest device count."""
    base = min(points, key=lambda p: p["devices"])
    for p in points:
        p["efficiency"] = base["step_s"] * base["devices"] / (p["step_s"] * p["devices"])
    return points


def write_points(run_id: str, points: list[dict], outputs: ScalingOutputs, attrs: dict) -> None:
    if outputs.jsonl:
        Path(outputs.jsonl).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(outputs.jsonl, "".join(json.dumps({"run_id": run_id, **p}) + "\n" for p in points))
    if outputs.store:
        from optimus_core.store import open_store

        first = points[0]
        run_attrs = {**attrs, "experiment": "scaling", "kind": "scaling",
                     **{k: first[k] for k in STRING_FIELDS if k in first}, "overrides": first.get("overrides", {})}
        with open_store(outputs.store).run_writer(run_id, attrs=run_attrs) as writer:
            writer.update_attrs(optimizers={str(p["devices"]): p["optimizer"] for p in points})
            for p in points:
                row = {k: v for k, v in p.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                writer.log(TABLE, {"step": p["devices"], **row})


def run_scaling(config: ScalingConfig, outputs: ScalingOutputs, progress: bool = True) -> ScalingResult:
    import torch

    from optimus_core.device import resolve_device_type

    for n in config.devices:  # every layout is checked before the first point runs
        config.run_config(n)
    device_type = resolve_device_type(config.device)
    if device_type != "cpu":
        count = getattr(torch, device_type).device_count()
        if config.devices[-1] > count:
            raise ConfigError(f"scaling.devices = {list(config.devices)}: this machine has {count} {device_type} "
                              f"device(s)")
    run_id = config.run_id or f"scaling-{config.preset.replace('@', '-')}-{device_slug(config.device)}"
    points = []
    for n in config.devices:
        point = measure_point(config, n)
        points.append(point)
        if progress:
            print(f"[scaling] {n} rank(s): {point['step_s']:.3f} s/step, {point['tokens_per_s']:,.0f} tokens/s",
                  flush=True)
    add_efficiency(points)
    write_points(run_id, points, outputs, attrs={"preset": config.preset, "devices": list(config.devices)})
    return ScalingResult(run_id, points)


def format_table(points: list[dict]) -> str:
    cols = ("devices", "ep", "step_s", "compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s",
            "tokens_per_s", "efficiency")
    lines = [" ".join(f"{c:>12}" for c in cols)]
    for p in points:
        lines.append(" ".join(f"{p[c]:>12.4g}" if isinstance(p[c], float) else f"{p[c]:>12}" for c in cols))
    return "\n".join(lines)

