"""Stage `scaling`: a strong-scaling sweep measured on the hardware at hand.

    from stages.scaling import ScalingConfig, ScalingOutputs, run_scaling
    result = run_scaling(ScalingConfig(preset="mula-7b-a1b@laptop", devices=(1, 2)),
                         ScalingOutputs(store=Path("results/store.zarr"), jsonl=Path("results/scaling/cpu.jsonl")))
    result.points    # one dict per measured layout (the contract of workflow/perfmodel/)

    # a held-out design: EP=n and EP=1 at every multi-rank count, the main setting (16 sequences)
    # and micro-batches of 2 fitted, half the batch held out (its multi-rank points predicted)
    ScalingConfig(preset="mula-7b-a1b@laptop", devices=(1, 2), ep=("all", 1), global_batch=16,
                  fitted=((16, 2),), holdout=((8, 0),), rounds=2)

Every point trains the same model at a fixed global batch (strong scaling) for ``warmup`` +
``steps`` steps on ``n`` local ranks (CPU processes with gloo, or one GPU each with nccl / xccl)
and records the step time split into compute, expert all-to-all, gradient reduce-scatter /
all-gather, optimizer and idle (optimus_core.train.measure) with

    efficiency(n) = T(base) x base / (T(n) x n)      base = the smallest device count swept.

``ep``: one EP rule or several, each measured at every multi-rank count: ``"all"`` splits the
experts over every rank of the point (ep = n), an integer keeps that degree (it must divide
every n swept). ``global_batch`` / ``micro_batch`` are the main setting; ``fitted`` and
``holdout`` add settings (global batch, micro-batch; 0 = the preset's / the whole local batch)
measured at every device count too. With ``holdout``, every point carries a ``role``: the
multi-rank points of a held-out setting are "held-out" (the performance model is calibrated
without them and must predict them: workflow/scaling_study.py), the rest "fitted" -- chosen
before anything is timed. A second fitted multi-rank setting is what lets the model tell a
collective's per-call latency from its per-byte cost (one setting gives one equation for the
two): micro-batches of 2 at the main batch make 4x the all-to-alls of 1/4 the size each.

Timing on a shared box drifts (other work comes and goes), so the layouts are measured
interleaved: ``rounds`` passes over all of them, each pass ``warmup`` + ``steps`` steps of each
layout (the median step of the pass), and a point is its fastest pass (``best_point``): drift
then hits every layout alike, and a pass slowed by other work does not count. How much other
work there was is measured too: ``cpu_wait`` is the share of its pass the slowest rank spent
runnable but waiting for a core (Linux schedstat; absent elsewhere) -- 0 on an idle box, about
1/2 when one other busy process shares the two cores of two ranks. When the pass a layout would
keep waited more than ``max_cpu_wait`` of it, the layout is measured again, up to ``retries`` more
passes over such layouts (other work on a shared box comes and goes: a later pass may be quiet).
Other work can also slow a pass without taking its cores (memory bandwidth, caches): ``cpu_wait``
does not see that, the spread over passes (``step_s_spread``) and over whole sweeps does.
One process group per multi-rank count serves all its layouts (one mesh per EP degree), and the
one-rank points run on rank 0 of the smallest multi-rank world while its other ranks wait at a
barrier, so they interleave with the rest too. On the CPU each rank gets ``threads_per_rank``
threads (1: n ranks use n cores, so the sweep measures processes, not threads).

The points go to the results store as run ``run_id`` (table ``scaling``, one row per point,
``step`` = its index; strings in the run's attrs: ``optimizers`` per device count, ``roles`` per
row) and, one JSON line each, to ``jsonl``.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError, RunConfig
from optimus_core.log import get_logger

_log = get_logger(__name__)

TABLE = "scaling"
STRING_FIELDS = ("preset", "device", "optimizer", "experts_backend", "dtype")
POINT_STRINGS = ("role", "setting", "sharding")  # per point: in the run attrs, one list entry per row
ROLES = ("fitted", "held-out")
EpRule = Union[int, str]


@dataclass(frozen=True)
class PointLayout:
    """One point of a sweep: ranks, EP degree, the setting (global batch, micro-batch), its role."""

    devices: int
    ep: int
    global_batch: int  # 0: the preset's
    micro_batch: int  # 0: the whole local batch
    role: str = ""  # "" (no held-out design) | fitted | held-out


@dataclass
class ScalingConfig:
    preset: str
    devices: tuple[int, ...] = (1, 2)
    ep: Union[EpRule, Sequence[EpRule]] = "all"  # "all": ep = n on n ranks; an int: that EP degree; or several
    optimizer: str = "ep_aware"
    global_batch: int = 0  # sequences per step, fixed across the sweep (0: the preset's)
    micro_batch: int = 0  # sequences per forward/backward (0: the whole local batch)
    fitted: tuple[tuple[int, int], ...] = ()  # extra (global_batch, micro_batch) settings, fitted (needs holdout)
    holdout: tuple[tuple[int, int], ...] = ()  # extra (global_batch, micro_batch) settings: multi-rank points held out
    steps: int = 5
    warmup: int = 2
    rounds: int = 1  # interleaved passes over every layout (module doc)
    retries: int = 0  # more passes, at most, over layouts whose kept pass waited for a core (module doc)
    max_cpu_wait: float = 0.1  # a pass whose ranks waited longer than this share of it for a core is loaded
    device: str = "cpu"  # cpu | cuda | xpu | auto
    threads_per_rank: int = 1  # CPU threads of each rank
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted config paths
    run_id: str = ""  # "" = scaling-<preset>-<device>

    def __post_init__(self):
        self.devices = tuple(sorted(set(int(n) for n in self.devices)))
        if not self.devices or self.devices[0] < 1:
            raise ConfigError(f"scaling.devices = {list(self.devices)}: need device counts >= 1")
        rules = tuple(self.ep) if isinstance(self.ep, (list, tuple)) else (self.ep,)
        if not rules:
            raise ConfigError("scaling.ep = []: need at least one EP rule ('all' or an integer >= 1)")
        for rule in rules:
            if rule != "all" and not (isinstance(rule, int) and not isinstance(rule, bool) and rule >= 1):
                raise ConfigError(f"scaling.ep = {rule!r}: must be 'all' or an integer >= 1")
        self.ep_rules: tuple[EpRule, ...] = tuple(dict.fromkeys(rules))
        for name in ("steps", "threads_per_rank", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scaling.{name} = {getattr(self, name)}: must be >= 1")
        if self.warmup < 0:
            raise ConfigError(f"scaling.warmup = {self.warmup}: must be >= 0")
        if self.retries < 0:
            raise ConfigError(f"scaling.retries = {self.retries}: must be >= 0")
        if not 0 < self.max_cpu_wait < 1:
            raise ConfigError(f"scaling.max_cpu_wait = {self.max_cpu_wait}: must be in (0, 1) (a share of a pass)")
        seen = {(self.global_batch, self.micro_batch): "the main (fitted) setting"}
        for name in ("fitted", "holdout"):
            settings = []
            for setting in getattr(self, name):
                if (not isinstance(setting, (list, tuple)) or len(setting) != 2
                        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in setting)):
                    raise ConfigError(f"scaling.{name}: {setting!r}: must be a (global_batch, micro_batch) pair "
                                      f"of integers >= 0")
                setting = tuple(setting)
                if setting in seen:
                    raise ConfigError(f"scaling.{name}: {setting}: is {seen[setting]}; every setting is measured "
                                      f"once, in one role")
                seen[setting] = f"already in scaling.{name}"
                settings.append(setting)
            setattr(self, name, tuple(settings))
        if self.fitted and not self.holdout:
            raise ConfigError(f"scaling.fitted = {list(self.fitted)}: extra fitted settings belong to a held-out "
                              f"design; give scaling.holdout too (the settings the model must predict)")

    def ep_for(self, n: int, rule: EpRule | None = None) -> int:
        rule = self.ep_rules[0] if rule is None else rule
        return n if rule == "all" else int(rule)

    def layouts(self) -> list[PointLayout]:
        """Every point of the sweep, setting by setting (the main one first), then by device
        count and EP rule; the one-rank point once per setting (EP rules coincide there)."""
        settings = [(self.global_batch, self.micro_batch, "fitted" if self.holdout else "")]
        settings += [(gb, mb, "fitted") for gb, mb in self.fitted]
        settings += [(gb, mb, "held-out") for gb, mb in self.holdout]
        out = []
        for gb, mb, role in settings:
            for n in self.devices:
                eps = dict.fromkeys(self.ep_for(n, rule) for rule in self.ep_rules) if n > 1 else {1: None}
                for ep in eps:
                    out.append(PointLayout(n, ep, gb, mb, role if n > 1 or not role else "fitted"))
        return out

    def run_config(self, n: int, ep: int | None = None, global_batch: int | None = None,
                   micro_batch: int | None = None) -> RunConfig:
        """The validated RunConfig of a point with ``n`` ranks (by default the main setting and
        the first EP rule); a bad layout fails here."""
        from optimus_core import presets
        from optimus_core.parallel.mesh import group_layout

        ep = self.ep_for(n) if ep is None else ep
        global_batch = self.global_batch if global_batch is None else global_batch
        micro_batch = self.micro_batch if micro_batch is None else micro_batch
        overrides = {**self.overrides, "parallel.ep": ep, "parallel.optimizer": self.optimizer,
                     "train.device": "auto" if self.device == "auto" else self.device}
        if global_batch:
            overrides["train.global_batch"] = global_batch
        if micro_batch:
            overrides["train.micro_batch"] = micro_batch
        cfg = presets.get(self.preset).run_config(**overrides)
        moe = cfg.model.moe
        group_layout(n, cfg.parallel.ep, moe.n_experts if moe else None)
        local = cfg.train.global_batch // n
        if cfg.train.global_batch % n or (cfg.train.micro_batch and local % cfg.train.micro_batch):
            raise ConfigError(f"train.global_batch = {cfg.train.global_batch} sequences: must split evenly over "
                              f"{n} ranks (and into micro-batches of {cfg.train.micro_batch})")
        return cfg

    def layout_config(self, layout: PointLayout) -> RunConfig:
        return self.run_config(layout.devices, layout.ep, layout.global_batch, layout.micro_batch)


@dataclass
class ScalingOutputs:
    store: Path | None = None
    jsonl: Path | None = None


@dataclass
class ScalingResult:
    run_id: str
    points: list[dict]


def best_point(samples: list[dict]) -> dict:
    """One point from its interleaved passes: the pass with the shortest step, whole (its phases
    add up to its step). Other work on a shared box only ever slows a step down, so the fastest
    pass is the closest to what the machine itself does, as a benchmark's best-of-N is; the
    spread over the passes is kept as ``step_s_spread`` (slowest / fastest - 1)."""
    best = min(samples, key=lambda s: s["step_s"])
    return {**best, "steps": sum(s["steps"] for s in samples), "rounds": len(samples),
            "step_s_spread": max(s["step_s"] for s in samples) / best["step_s"] - 1}


def cpu_wait_s() -> float:
    """Seconds this thread has been runnable but waiting for a core (Linux /proc schedstat's
    run delay); NaN where the kernel does not say."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def _timed(measure, world: int) -> dict:
    """``measure()``'s point with ``cpu_wait``: the largest share of the call any rank waited for a core."""
    import time

    import torch.distributed as dist

    wait0, t0 = cpu_wait_s(), time.perf_counter()
    point = measure()
    share = (cpu_wait_s() - wait0) / (time.perf_counter() - t0)
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, share)
        share = max(shares)
    if share == share:  # NaN: not measured here
        point["cpu_wait"] = share
    return point


def loaded(samples: list[dict], max_cpu_wait: float) -> bool:
    """Whether the pass a point would keep (the fastest) waited for a core longer than ``max_cpu_wait``."""
    return min(samples, key=lambda s: s["step_s"]).get("cpu_wait", 0.0) > max_cpu_wait


def _rank_main(jobs_json: str, steps: int, warmup: int, rounds: int, threads: int, out_path: str,
               retries: int = 0, max_cpu_wait: float = 0.1) -> None:
    """One rank of one world (spawned): measure every job, ``rounds`` interleaved passes, then up
    to ``retries`` passes over the loaded ones (``loaded``, decided by rank 0); rank 0 writes the
    points. A job is (n, config): n = the world size, or 1 (rank 0 alone)."""
    import torch
    import torch.distributed as dist

    from optimus_core.parallel import Mesh, init_distributed, shutdown
    from optimus_core.train.measure import measure_steps

    torch.set_num_threads(threads)
    jobs = [(n, RunConfig.from_json(c)) for n, c in json.loads(jobs_json)]
    world = max(n for n, _ in jobs)
    meshes: dict[int, Mesh] = {}

    def mesh_for(cfg: RunConfig) -> Mesh:  # one mesh (EP and expert-dp groups) per EP degree
        if cfg.parallel.ep not in meshes:
            moe = cfg.model.moe
            meshes[cfg.parallel.ep] = init_distributed(cfg.parallel, n_experts=moe.n_experts if moe else None,
                                                       device=cfg.train.device)
        return meshes[cfg.parallel.ep]

    owner = mesh_for(next(cfg for n, cfg in jobs if n == world))  # joins the world first
    samples: list[list[dict]] = [[] for _ in jobs]
    def one_pass(todo: Sequence[int]) -> None:
        for i in todo:
            n, cfg = jobs[i]
            if n == world:
                mesh = mesh_for(cfg)
                samples[i].append(_timed(lambda: measure_steps(cfg, mesh, steps=steps, warmup=warmup), world))
                continue
            if owner.rank == 0:  # a one-rank point: the other ranks wait, idle, at the barrier
                single = Mesh.single(owner.device)
                samples[i].append(_timed(lambda: measure_steps(cfg, single, steps=steps, warmup=warmup), 1))
            if world > 1:
                dist.barrier()

    try:
        for _ in range(rounds):
            one_pass(range(len(jobs)))
        for _ in range(retries):
            todo = [[i for i, s in enumerate(samples) if loaded(s, max_cpu_wait)] if owner.rank == 0 else None]
            if world > 1:  # rank 0 holds every sample (one-rank jobs run there): it decides for all
                dist.broadcast_object_list(todo, src=0)
            if not todo[0]:
                break
            one_pass(todo[0])
    finally:
        shutdown(owner)
    if owner.rank == 0:
        atomic_write(out_path, json.dumps([best_point(s) for s in samples]))


def _worlds(layouts: Sequence[PointLayout]) -> dict[int, list[int]]:
    """Layout indices per spawned world: one world per multi-rank count; the one-rank layouts
    join the smallest (or run alone when nothing else is swept)."""
    counts = sorted({lay.devices for lay in layouts})
    multi = [n for n in counts if n > 1]
    worlds: dict[int, list[int]] = {n: [] for n in (multi or [1])}
    for i, lay in enumerate(layouts):
        worlds[lay.devices if lay.devices > 1 else (multi or [1])[0]].append(i)
    return worlds


def _describe(config: ScalingConfig, layout: PointLayout, cfg: RunConfig, point: dict) -> dict:
    from optimus_core.device import device_slug

    n = layout.devices
    plan = point.pop("plan", None) or {}  # the execution plan the point ran (measure_steps)
    for window in ("synced_window_unix_s", "back_to_back_window_unix_s"):  # wall-clock stamps: the benchmarks'
        point.pop(window, None)
    point.update(preset=config.preset, overrides=dict(config.overrides), device=device_slug(config.device),
                 optimizer=config.optimizer if n > 1 else "local", global_batch=cfg.train.global_batch,
                 micro_batch=cfg.train.micro_batch or cfg.train.global_batch // n, seq_len=cfg.data.seq_len,
                 dtype=plan.get("dtype", ""), experts_backend=plan.get("experts") or "none",
                 sharding="full" if n > 1 else "none", dp_shard=cfg.parallel.dp_shard,
                 reduce_dtype=cfg.parallel.reduce_dtype, threads_per_rank=config.threads_per_rank)
    point["setting"] = setting_label(cfg.train.global_batch, layout.micro_batch)
    if layout.role:
        point["role"] = layout.role
    return point


def parse_setting(text: str, field: str = "holdout") -> tuple[int, int]:
    """A setting as the command line writes it: "8" (global batch 8, whole local batches) or
    "16:2" (global batch 16 in micro-batches of 2); ``field`` names it in the error."""
    batch, _, micro = str(text).partition(":")
    try:
        setting = int(batch), int(micro or 0)
    except ValueError:
        setting = (-1, -1)
    if setting[0] < 1 or setting[1] < 0:
        raise ConfigError(f"scaling.{field} = {text!r}: must be GLOBAL_BATCH or GLOBAL_BATCH:MICRO_BATCH "
                          f"(integers, batch >= 1)")
    return setting


def setting_label(global_batch: int, micro_batch: int) -> str:
    """A setting's name: "batch 16", or "batch 16 micro 2" when micro-batches are fixed."""
    return f"batch {global_batch}" + (f" micro {micro_batch}" if micro_batch else "")


def measure_layouts(config: ScalingConfig, layouts: Sequence[PointLayout], progress: bool = False) -> list[dict]:
    """Measure ``layouts`` (module doc: interleaved, one process group per multi-rank count)."""
    from optimus_core.parallel.launch import spawn_local

    cfgs = [config.layout_config(lay) for lay in layouts]
    points: list[dict | None] = [None] * len(layouts)
    for world, idx in _worlds(layouts).items():
        jobs = json.dumps([(layouts[i].devices, cfgs[i].to_json()) for i in idx])
        with tempfile.TemporaryDirectory(prefix="optimus-scaling-") as tmp:
            out = Path(tmp) / "points.json"
            spawn_local(_rank_main, world, (jobs, config.steps, config.warmup, config.rounds,
                                            config.threads_per_rank, str(out), config.retries,
                                            config.max_cpu_wait))
            for i, point in zip(idx, json.loads(out.read_text())):
                points[i] = _describe(config, layouts[i], cfgs[i], point)
                if progress:
                    lay = layouts[i]
                    _log.info(f"scaling: {lay.devices} rank(s), ep {lay.ep}, {points[i]['setting']}"
                              f"{' (' + lay.role + ')' if lay.role else ''}: "
                              f"{point['step_s']:.3f} s/step, {point['tokens_per_s']:,.0f} tokens/s")
    return points  # type: ignore[return-value]


def measure_point(config: ScalingConfig, n: int) -> dict:
    """One point: ``n`` fresh local ranks, the main setting and the first EP rule."""
    return measure_layouts(config, [PointLayout(n, config.ep_for(n) if n > 1 else 1, config.global_batch,
                                                config.micro_batch)])[0]


def add_efficiency(points: list[dict]) -> list[dict]:
    """efficiency = T(base) x base / (T(n) x n) against the smallest device count of the same
    ``setting`` (points without one form one group)."""
    groups: dict[Any, list[dict]] = {}
    for p in points:
        groups.setdefault(p.get("setting"), []).append(p)
    for group in groups.values():
        base = min(group, key=lambda p: p["devices"])
        for p in group:
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
            writer.update_attrs(optimizers={str(p["devices"]): p["optimizer"] for p in points},
                                **{f"{k}s": [str(p.get(k, "")) for p in points] for k in POINT_STRINGS})
            for i, p in enumerate(points):
                row = {k: int(v) if isinstance(v, bool) else v for k, v in p.items() if isinstance(v, (int, float))}
                writer.log(TABLE, {**row, "step": i})


def run_scaling(config: ScalingConfig, outputs: ScalingOutputs, progress: bool = True) -> ScalingResult:
    import torch

    from optimus_core.device import device_slug, resolve_device_type

    layouts = config.layouts()
    for lay in layouts:  # every layout is checked before the first point runs
        config.layout_config(lay)
    device_type = resolve_device_type(config.device)
    if device_type != "cpu":
        count = getattr(torch, device_type).device_count()
        if config.devices[-1] > count:
            raise ConfigError(f"scaling.devices = {list(config.devices)}: this machine has {count} {device_type} "
                              f"device(s)")
    run_id = config.run_id or f"scaling-{config.preset.replace('@', '-')}-{device_slug(config.device)}"
    points = add_efficiency(measure_layouts(config, layouts, progress=progress))
    write_points(run_id, points, outputs, attrs={"preset": config.preset, "devices": list(config.devices)})
    return ScalingResult(run_id, points)


def format_table(points: list[dict]) -> str:
    cols = ("devices", "ep", "global_batch", "micro_batch", "step_s", "compute_s", "a2a_s", "grad_sync_s",
            "optimizer_s", "idle_s", "tokens_per_s", "efficiency")
    extra = ("step_s_spread", "cpu_wait")  # the passes' spread; how long a rank waited for a core
    lines = [" ".join(f"{c:>12}" for c in cols + extra) + "  role"]
    for p in points:
        cells = [f"{p[c]:>12.4g}" if isinstance(p[c], float) else f"{p[c]:>12}" for c in cols]
        cells += [f"{p[c]:>12.1%}" if c in p else f"{'':>12}" for c in extra]
        lines.append(" ".join(cells) + f"  {p.get('role', '')}")
    return "\n".join(lines)
