"""Predicted sweeps and node-hours: a preset over device counts (predict_sweep, paper_sweep), a
registry run's node-hours (estimate_node_hours), and the model's row for each measured point.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from optimus_core import presets
from optimus_core.config import ConfigError

from .machine import Machine
from .step import WHATIFS, Layout, point_layout, predict, predict_point


# ----------------------------------------------------------------------------- sweeps and node-hours

def efficiency(devices: Sequence[int], step_s: Sequence[float]) -> list[float]:
    """Strong-scaling efficiency T(base) x base / (T(n) x n), base = the smallest device count."""
    i0 = int(np.argmin(devices))
    return [step_s[i0] * devices[i0] / (t * n) for n, t in zip(devices, step_s)]


def predict_sweep(preset: str, tiles_list: Sequence[int], machine: Machine, *, global_batch: int,
                  ep: int, micro_batch: int = 1, seq_len: int = 0, dtype: str = "bfloat16",
                  optimizer: str = "ep_aware", overrides: Optional[dict] = None, overlap: str = "layers",
                  chunk_mb: float = 128.0, dp_shard: int = 0, experts: str = "triton",
                  checkpointing: Optional[dict] = None, reduce_bytes: int = 4,
                  exchange: str = "all_to_all", gathers: dict | None = None, pp: int = 1,
                  scenario: str | None = None) -> list[dict]:
    """One row per tile count: the layout (``overlap`` included), each phase, tokens/s and
    efficiency within the sweep. ``dp_shard``: the shard block (parallel.dp_shard), capped at
    each point's tile count. ``checkpointing``: {tiles: (mode, every)}, the activation
    checkpointing each point runs (none where absent); ``reduce_bytes``: of a gradient element in
    the reduction (2: parallel.reduce_dtype bfloat16); ``exchange``: the expert exchange the plan
    picks (Layout.exchange); ``gathers``: {tiles: the plan's weight_gathers} (per_micro_batch
    where absent); ``pp``: pipeline stages (Layout.pp). A what-if ``overlap`` (WHATIFS: one our
    step does not do), or ``scenario`` (another design of the runs), marks its rows with
    ``scenario`` so they never mix with the plain sweep."""
    p = presets.get(preset)
    cfg = p.run_config(**overrides).model if overrides else p.model
    seq_len = seq_len or p.seq_len
    rows = []
    for tiles in tiles_list:
        mode, every = (checkpointing or {}).get(tiles, ("none", 1))
        layout = Layout(devices=tiles, ep=ep, global_batch=global_batch, micro_batch=micro_batch,
                        seq_len=seq_len, optimizer=optimizer if tiles > 1 else "local", dtype=dtype, overlap=overlap,
                        chunk_mb=chunk_mb, dp_shard=dp_shard if 0 < dp_shard < tiles // pp else 0, experts=experts,
                        checkpointing=mode, checkpointing_every=every, reduce_bytes=reduce_bytes,
                        exchange=exchange if ep > 1 else "all_to_all",
                        gathers=(gathers or {}).get(tiles, "per_micro_batch"), pp=pp)
        label = scenario or (f"overlap {overlap}" if overlap in WHATIFS else None)
        pred = predict(cfg, layout, machine)
        rows.append({"preset": preset, "machine": machine.name, "devices": tiles, "ep": ep, "pp": pp,
                     "overlap": overlap, "dp_shard": layout.dp_shard, **({"scenario": label} if label else {}),
                     "nodes": math.ceil(tiles / machine.devices_per_node), "global_batch": global_batch,
                     "micro_batch": micro_batch, "seq_len": seq_len, "dtype": dtype, "optimizer": layout.optimizer,
                     "exchange": layout.exchange, "gathers": layout.gathers,
                     "checkpointing": mode + (f"/{every}" if mode == "full" and every > 1 else ""),
                     **pred.as_dict(), "tokens_per_s": global_batch * seq_len / pred.step_s})
    for row, eff in zip(rows, efficiency([r["devices"] for r in rows], [r["step_s"] for r in rows])):
        row["efficiency"] = eff
    return rows


def code_overlap(parallel) -> str:
    """The overlap our step does on several ranks: full sharding's per-unit collectives."""
    return "layers"


def reduce_bytes(cfg, dtype: str) -> int:
    """Bytes of a gradient element in the reduction of ``cfg`` (a RunConfig) run in ``dtype``:
    parallel.reduce_dtype's for a bf16 run, float32's for a float32 run (optimus_core.parallel.
    sharding reduces a float32 run's gradients in float32)."""
    return 2 if dtype == "bfloat16" and cfg.parallel.reduce_dtype == "bfloat16" else 4


def planned_run(cfg, machine: Machine, devices: int):
    """The whole execution plan of ``cfg`` (a RunConfig) on ``devices`` of ``machine`` as the run
    will resolve it there (optimus_core.execution.plan_execution; its kernels assumed to pass
    their self-check): activation checkpointing and weight gathers resolved against the device's
    budget (unknown memory: as configured, "auto" meaning none and per micro-batch).
    MemoryBudgetError where nothing fits."""
    from optimus_core.execution import plan_execution
    from optimus_core.memory import device_budget

    budget = device_budget(machine.memory_bytes) if machine.memory_bytes else None
    return plan_execution(cfg, machine.device_kind, devices, budget_bytes=budget, probe=False,
                          run=f"{cfg.preset} on {devices} {machine.name} devices")


def paper_sweep(machine: Machine, overlap: Optional[str] = None, design: str = "authors") -> list[dict]:
    """The paper's strong-scaling sweep of Mula-220B-A10B as the registry defines it
    (workflow/experiments.py: SCALING_TILES, SCALING_BATCH, EP 12, bf16), one sequence per
    micro-batch, in ``design`` (workflow.experiments.DESIGNS: the authors' pipelined layout, or
    our own, whose rows carry ``scenario`` "design <name>"). ``overlap`` None: what the run's
    configuration does (code_overlap); a what-if otherwise."""
    from workflow import experiments as ex

    runs = {tiles: ex.get(f"scaling-mula-220b-a10b-{tiles}").scale("paper", design) for tiles in ex.SCALING_TILES}
    run = runs[ex.SCALING_TILES[0]]
    cfg = run.run_config()
    plans = {tiles: planned_run(r.run_config(), machine, tiles) for tiles, r in runs.items()}
    plan = plans[run.devices]
    checkpointing = {tiles: p.checkpointing for tiles, p in plans.items()}
    gathers = {tiles: p.weight_gathers or "per_micro_batch" for tiles, p in plans.items()}
    return predict_sweep(run.preset, ex.SCALING_TILES, machine, global_batch=ex.SCALING_BATCH, ep=run.ep,
                         micro_batch=1, dtype=plan.dtype, experts=plan.experts or "loop", overlap=overlap or code_overlap(cfg.parallel),
                         dp_shard=runs[ex.SCALING_TILES[-1]].run_config().parallel.dp_shard, checkpointing=checkpointing,
                         reduce_bytes=reduce_bytes(cfg, plan.dtype), exchange=plan.expert_exchange or "all_to_all",
                         gathers=gathers, pp=run.pp, scenario=None if design == ex.AUTHORS else f"design {design}")


def estimate_node_hours(run_scale, machine: Machine, micro_batch: int = 1) -> dict[str, Any]:
    """Hours and node-hours of a registry run (workflow.experiments.RunScale) on ``machine``:
    steps x predicted step time. ``source`` says it is the model's estimate."""
    cfg = run_scale.run_config()
    data_devices = run_scale.devices // cfg.parallel.pp  # with pipeline stages: one stage's
    local = cfg.train.global_batch // data_devices
    if local < 1 or cfg.train.global_batch % data_devices:
        raise ConfigError(f"global_batch = {cfg.train.global_batch}: must be a multiple of the "
                          f"{data_devices} data-parallel devices for the performance model")
    mb = cfg.train.micro_batch or (micro_batch if local % micro_batch == 0 else 0)
    plan = planned_run(cfg, machine, run_scale.devices)
    mode, every = plan.checkpointing
    layout = Layout(devices=run_scale.devices, ep=cfg.parallel.ep, global_batch=cfg.train.global_batch,
                    micro_batch=mb, seq_len=cfg.data.seq_len, experts=plan.experts or "loop",
                    optimizer=cfg.parallel.optimizer if run_scale.devices > 1 else "local", dtype=plan.dtype,
                    overlap=code_overlap(cfg.parallel), dp_shard=cfg.parallel.dp_shard,
                    reduce_bytes=reduce_bytes(cfg, plan.dtype), exchange=plan.expert_exchange or "all_to_all",
                    gathers=plan.weight_gathers or "per_micro_batch", checkpointing=mode, checkpointing_every=every,
                    pp=cfg.parallel.pp, pp_chunks=cfg.parallel.pp_chunks)
    pred = predict(cfg.model, layout, machine)
    hours = run_scale.steps * pred.step_s / 3600
    nodes = math.ceil(run_scale.devices / machine.devices_per_node)
    return {"source": f"perfmodel:{machine.name}", "step_s": pred.step_s, "steps": run_scale.steps,
            "checkpointing": (mode, every),
            "hours": hours, "nodes": nodes, "node_hours": hours * nodes, "prediction": pred}


def predict_points(points: Sequence[dict], machine: Machine) -> list[dict]:
    """The model's row for each measured point (same identity fields, predicted phases), e.g. to
    draw a calibrated model beside a measured sweep."""
    rows = []
    for p in points:
        pred = predict_point(p, machine)
        rows.append({**({"run_id": p["run_id"]} if p.get("run_id") else {}),
                     "preset": p["preset"], "device": p.get("device", machine.name), "machine": machine.name,
                     "devices": int(p["devices"]), "ep": int(p.get("ep", 1)),
                     "optimizer": point_layout(p).optimizer, **pred.as_dict(),
                     "tokens_per_s": int(p["global_batch"]) * int(p["seq_len"]) / pred.step_s})
    return rows
