"""Timed training steps on synthetic tokens: the measurement behind `optimus scaling` and bench/.

    mesh = init_distributed(cfg.parallel, n_experts=...)       # or Mesh.single("cuda")
    point = measure_steps(cfg, mesh, steps=10, warmup=3)       # every rank calls it
    point["step_s"], point["compute_s"], point["a2a_s"], point["grad_sync_s"], point["optimizer_s"]

What is timed is the training step itself (optimus_core.train.step.train_step) on the model and
optimizer a real run of ``cfg`` builds (optimus_core.train.build: fully sharded with
ShardedAdamW in ``cfg.parallel.optimizer``'s mode when distributed); only the data differ:
uniform random tokens from a seeded generator, so no dataset is needed.

Phases (optimus_core.timing, exclusive device seconds per step): ``compute`` forward + backward,
``a2a`` the experts' token exchange (the all-to-alls and their count exchanges, or the paper's
all-gathers and reduce-scatters), ``grad_sync`` what the host waits for of the gradient
synchronisation after the backward (the losses' and routing counts' all-reduces; FSDP2's per-unit all-gathers and reduce-scatters run
inside the forward and backward and count there), ``optimizer`` grad norm + AdamW; ``idle_s`` is the wall
time of the step left over (host overhead, waiting for other ranks). Each is the median over
the timed steps on each rank, then the mean over ranks; ``step_s`` is the slowest rank's median;
``step_back_to_back_s`` (GPUs) the median time between step boundaries with no host sync between
steps, the slowest rank's: what a run gets, where the synced ``step_s`` cannot show work that
one step overlaps with the next; ``tokens_per_s_back_to_back`` from it.
``synced_window_unix_s`` and ``back_to_back_window_unix_s``: this rank's [start, end] of each
series in time.time() (bench/gpu_telemetry.py reads the GPU's clocks and power over them).
``peak_memory_bytes`` the most any rank allocated during the timed steps, ``peak_reserved_bytes``
the most its allocator held (what the device had in use: CUDA graphs' private pools count here,
not in the allocated figure).

With ``OPTIMUS_TRACE_DIR`` set in the environment (bench/distributed.py --trace sets it for the
processes it launches), every rank runs two more steps after the timed ones under torch.profiler
and writes their timeline, host and device, to ``trace-<world>r-ep<ep>-rank<rank>.json.gz`` there
(bench/trace_gaps.py reads it: where the device waits, and on what).
"""
from __future__ import annotations

import gzip
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..parallel import Mesh
from ..timing import PhaseTimer
from ..execution import plan_execution
from .build import build_model, build_run_optimizer
from .step import train_step

PHASES = ("compute", "a2a", "grad_sync", "optimizer")


def _sync(device: torch.device) -> None:
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).synchronize(device)


def _peak_memory(device: torch.device, reserved: bool = False) -> float:
    if device.type in ("cuda", "xpu"):
        backend = getattr(torch, device.type)
        return float((backend.max_memory_reserved if reserved else backend.max_memory_allocated)(device))
    return float("nan")


def measure_steps(cfg: RunConfig, mesh: Mesh, *, steps: int = 10, warmup: int = 3) -> dict:
    """Median step time and its phases for ``cfg`` on this mesh (collective: every rank calls it)."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps = {steps}, warmup = {warmup}: need steps >= 1 and warmup >= 0")
    if cfg.train.global_batch % mesh.world_size:
        raise ValueError(f"train.global_batch = {cfg.train.global_batch} sequences does not split over "
                         f"{mesh.world_size} ranks")
    device = mesh.device
    plan = plan_execution(cfg, device, mesh.world_size)
    model = build_model(cfg, mesh, plan=plan)
    optimizer = build_run_optimizer(model, cfg, mesh, plan)
    local_batch = cfg.train.global_batch // mesh.world_size
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 7919 + mesh.rank)
    batch_BS1 = torch.randint(0, cfg.model.vocab_size, (local_batch, cfg.data.seq_len + 1),
                              generator=generator, device=device)
    def step():
        return train_step(model, optimizer, batch_BS1, micro_batch=cfg.train.micro_batch,
                          grad_clip=cfg.optim.grad_clip, lr=cfg.optim.lr, dtype=plan.dtype, mesh=mesh)

    timer = PhaseTimer(device)
    samples: dict[str, list[float]] = {name: [] for name in (*PHASES, "step", "idle")}
    losses = []
    for i in range(warmup + steps):
        _sync(device)
        mesh.barrier()  # every rank starts the step together: waits inside it are the step's
        if i == warmup:
            synced_from = time.time()
        timer.reset()
        t0 = time.perf_counter()
        with timer.active():
            stats = step()
        float(stats.grad_norm)
        _sync(device)  # the update too, on whatever stream it runs (beside the next forward: the plan's)
        wall = time.perf_counter() - t0
        if i < warmup:
            if i == warmup - 1 and device.type in ("cuda", "xpu"):
                # Peak memory of the timed steps (the steady state), not of the autotuning and
                # compilation of the warm-up, which allocate scratch space once.
                getattr(torch, device.type).reset_peak_memory_stats(device)
            continue
        phases = timer.totals()
        for name in PHASES:
            samples[name].append(phases.get(name, 0.0))
        samples["step"].append(wall)
        samples["idle"].append(max(0.0, wall - sum(phases.get(n, 0.0) for n in PHASES)))
        losses.append(stats.loss)
    synced_window = [synced_from, time.time()]
    back_to_back = _back_to_back(step, mesh, steps)
    back_to_back_window = [synced_window[1], time.time()]
    if os.environ.get("OPTIMUS_TRACE_DIR"):
        _trace(Path(os.environ["OPTIMUS_TRACE_DIR"]), mesh, lambda: float(step().grad_norm))
    local = {f"{name}_s": statistics.median(values) for name, values in samples.items()}
    if back_to_back:
        local["step_back_to_back_s"] = statistics.median(back_to_back)
    local["peak_memory_bytes"] = _peak_memory(device)
    local["peak_reserved_bytes"] = _peak_memory(device, reserved=True)
    ranks = [local]
    if mesh.distributed:
        ranks = [None] * mesh.world_size
        dist.all_gather_object(ranks, local)
    point = {key: statistics.fmean(r[key] for r in ranks) for key in local}
    point["step_s"] = max(r["step_s"] for r in ranks)
    point["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in ranks)
    point["peak_reserved_bytes"] = max(r["peak_reserved_bytes"] for r in ranks)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    if "step_back_to_back_s" in point:
        point["step_back_to_back_s"] = max(r["step_back_to_back_s"] for r in ranks)
        point["tokens_per_s_back_to_back"] = tokens / point["step_back_to_back_s"]
    point.update(tokens_per_step=tokens, tokens_per_s=tokens / point["step_s"], loss=losses[-1],
                 devices=mesh.world_size, ep=mesh.ep, steps=steps, warmup=warmup, plan=plan.to_dict(),
                 synced_window_unix_s=synced_window, back_to_back_window_unix_s=back_to_back_window)
    return point


def _back_to_back(step, mesh: Mesh, steps: int) -> list[float]:
    """Seconds between consecutive step boundaries with steps queued back to back, as a run
    trains and as OLMo-core's harness times itself (../shared/peers/olmo_core_step.py): an event
    on the device at each boundary, no host sync between steps, so what one step's work overlaps
    with the next (the update beside the forward, optimus_core.execution) shows. GPUs only
    (empty elsewhere: on a CPU the synced steps already are back to back)."""
    device = mesh.device
    if device.type not in ("cuda", "xpu"):
        return []
    backend = getattr(torch, device.type)
    events = [backend.Event(enable_timing=True) for _ in range(steps + 1)]
    _sync(device)
    mesh.barrier()
    events[0].record()
    for event in events[1:]:
        step()
        event.record()
    _sync(device)
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]


def _trace(out_dir: Path, mesh: Mesh, step, steps: int = 2) -> Path:
    """Run ``step`` ``steps`` times under torch.profiler (host + device) and write the timeline."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if mesh.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    elif mesh.device.type == "xpu":
        activities.append(ProfilerActivity.XPU)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"trace-{mesh.world_size}r-ep{mesh.ep}-rank{mesh.rank}.json"
    with profile(activities=activities) as prof:
        for _ in range(steps):
            _sync(mesh.device)
            mesh.barrier()
            with torch.profiler.record_function("optimus.step"):
                step()
            _sync(mesh.device)
    return write_timeline(prof, path)


def write_timeline(prof, path: Path) -> Path:
    """A finished torch.profiler's timeline as ``<path>.gz`` (Chrome trace JSON, gzipped)."""
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return Path(f"{path}.gz")
