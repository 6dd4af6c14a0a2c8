"""One rank of a real layout, rehearsed on the local device: the peak memory it allocates, beside
the memory model's estimate.

    record = rehearse(cfg, world=12288, rank=0, steps=2, device="cuda")   # cfg: the job's RunConfig
    record["peak_allocated_gib"], record["model_gib"], record["terms"]
    record = rehearse(cfg, world=12288, device="meta")   # no device: the shares' sizes only

torch's fake process group stands in for the other ranks (torch.testing._internal.distributed.
fake_pg: every collective completes at once and moves nothing), so the rank builds its real
share of the real model (EP, FSDP2 units, the sharded AdamW: optimus_core.train.build) and runs
real steps of its share of the global batch (random tokens) with the real kernels and sizes.
Collectives return what they would if every rank held what this one holds ("loopback"): an
all-gather repeats this rank's shard (with a little noise, so that the routers' gathered rows
differ and tokens spread over the experts as they do in training), a reduce-scatter keeps this
rank's part, an all-reduce sums the group's identical copies, an all-to-all hands each rank back
what it sent. Counts and buffer sizes are then those of balanced routing, and the values stay
finite; the losses and norms are not the job's (a rank outside the first shard block counts
nothing towards the clip's norm, as in the job, but here no other rank adds the rest).

With pipeline stages (parallel.pp) the rank rehearsed belongs to the heaviest stage (the memory
model's: optimus_core.memory.heaviest_stage): the loopback world is that stage's ranks, and each
step runs the stage's micro-batches in its 1F1B order -- as many forwards in flight as the stage
holds, then one backward and one forward at a time; interleaved, each of the rank's stages in
Megatron's order (schedule_order) -- on random hidden states from the stage
before and random gradients from the stage after, where the schedule would receive them, its
gradients synchronised as the pipeline's are (the last backward reduces where the plan gathers
once a step). The step time is then one stage's compute with its sends and receives left out.

Rehearse in a process of its own, as `optimus rehearse` does: a process that rehearsed a layout
and then forked real gloo ranks whose device meshes had the same shape (4 ranks after a
rehearsed stage of 4) has been seen to save checkpoints whose shards all claimed the first
rank's place (torch's DeviceMesh compares equal across process groups; clearing DTensor's
caches did not help, and the cause is not known).

On the meta device nothing is allocated or run: the rank's shares are built and their sizes
compared with the memory model's static terms (weights, gradients, optimizer state), which is
what CI checks for every paper run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ConfigError, RunConfig
from .memory import GIB, MemoryLayout, estimate, heaviest_stage, static_bytes
from .parallel.mesh import Mesh, build_groups, pipeline_layout

LOOPBACK_NOISE = 1e-3  # added to all-gathered weights: breaks the ties of repeated router rows


# ----------------------------------------------------------------------------- the loopback world

def _loopback_collectives(rank_of):
    """{name: replacement} for torch.distributed's data collectives (module doc). ``rank_of(group)``
    is this rank's index in a group."""
    def gather(real):
        def all_gather(output, input, group=None, async_op=False):
            work = real(output, input, group=group, async_op=async_op)
            with torch.no_grad():
                output.view(-1, input.numel()).copy_(input.reshape(1, -1).clone())  # input may be a view of output
                if output.is_floating_point():  # the same noise at every gather of a unit: a recomputed
                    # forward (activation checkpointing) must see the weights its forward saw
                    noise = torch.Generator(device=output.device).manual_seed(output.numel())
                    output.add_(torch.randn(output.shape, generator=noise, device=output.device, dtype=output.dtype),
                                alpha=LOOPBACK_NOISE)
            return work
        return all_gather

    def scatter(real):
        def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = real(output, input, op=op, group=group, async_op=async_op)
            with torch.no_grad():
                output.copy_(input.view(-1, output.numel())[rank_of(group)].view_as(output).clone())
            return work
        return reduce_scatter

    def exchange(real):
        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            work = real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
            with torch.no_grad():
                output.copy_(input)  # the counts were exchanged the same way: the sizes agree
            return work
        return all_to_all_single

    def reduce(real):
        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = real(tensor, op=op, group=group, async_op=async_op)
            if op == dist.ReduceOp.SUM:
                with torch.no_grad():
                    tensor.mul_(dist.get_world_size(group))
            return work
        return all_reduce

    out = {"all_reduce": reduce(dist.all_reduce)}
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            out[name] = gather(getattr(dist, name))
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            out[name] = scatter(getattr(dist, name))
    out["all_to_all_single"] = exchange(dist.all_to_all_single)
    return out


@contextlib.contextmanager
def loopback_world(cfg: RunConfig, world: int, rank: int, device: torch.device, stage: int = 0):
    """A Mesh for rank ``rank`` of ``world`` on the fake process group, with loopback collectives
    (module doc); torch.distributed is restored on exit. With pipeline stages, ``world`` is the
    ranks of one stage, ``stage`` (no pipeline group: the stage's neighbours are not there)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers "fake")

    if dist.is_initialized():
        raise RuntimeError("rehearse: a process group already exists in this process")
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank}: must be in [0, {world})")
    from .parallel.mesh import group_layout

    group_layout(world, cfg.parallel.ep, cfg.model.moe.n_experts if cfg.model.moe else None,
                 cfg.parallel.dp_shard)  # clear errors first
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    patches = _loopback_collectives(lambda group: dist.get_rank(group))
    saved = {name: getattr(dist, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(dist, name, fn)
        mesh = build_groups(Mesh(rank, world, 0, cfg.parallel.ep, device, "fake", dp_shard=cfg.parallel.dp_shard))
        mesh.pp, mesh.pp_rank = cfg.parallel.pp, stage
        yield mesh
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the rehearsal

def static_terms(model) -> dict[str, float]:
    """Bytes of this rank's float32 shares, their gradients and AdamW moments, from the built model."""
    from .parallel.layout import local_tensor

    elements = sum(local_tensor(p).numel() for p in model.parameters())
    return {"weights": 4.0 * elements, "gradients": 4.0 * elements, "optimizer": 8.0 * elements}


def rehearse(cfg: RunConfig, world: int, *, rank: int = 0, steps: int = 2, device: str = "cuda",
             micro_batches: int | None = None, checkpointing: tuple[str, int] | None = None,
             weight_gathers: str | None = None, save_dir: str | None = None, warmup: int = 0) -> dict:
    """Rehearse rank ``rank`` of ``cfg`` on ``world`` ranks (module doc). ``micro_batches``: at most
    this many of the rank's micro-batches per step (the peak is reached by the second: the
    gradients exist from the first on); ``checkpointing``: the resolved (mode, every) (default:
    the configured mode, "auto" resolved by the memory model on the device's budget);
    ``weight_gathers``: the resolved execution.weight_gathers of a sharded rank (default: the
    configured, "auto" resolved as the run resolves it on the device's budget); ``save_dir``:
    after the steps, write this rank's part of a checkpoint there (its rows of every parameter
    and moment, as a run's save writes them, without the collectives of the planning) and
    record the device's peak during the save (``save_peak_allocated_gib``); ``warmup``: steps
    run first and neither timed nor counted in the peak (the kernels' compilation and autotuning,
    whose buffers a run allocates once)."""
    from .execution import device_memory_bytes, resolve_choices, resolve_weight_gathers
    from .memory import device_budget, resolve_checkpointing
    from .train.build import build_model, build_run_optimizer
    from .train.step import train_step

    from .config import ConfigError
    from .parallel.mesh import group_layout

    if steps < 1:
        raise ValueError(f"--steps {steps}: must be >= 1")
    pipeline_layout(world, cfg.parallel.pp, cfg.parallel.ep)
    stage_world = cfg.parallel.stage_world(world)  # the ranks of one pipeline stage (the world without stages)
    group_layout(stage_world, cfg.parallel.ep, cfg.model.moe.n_experts if cfg.model.moe else None,
                 cfg.parallel.dp_shard)
    if cfg.train.global_batch % stage_world:
        raise ConfigError(f"train.global_batch = {cfg.train.global_batch}: must be a multiple of the {stage_world} "
                          f"data-parallel ranks")
    if not 0 <= rank < stage_world:
        raise ConfigError(f"--rank {rank}: must be in [0, {stage_world})" +
                          (" (a rank of the heaviest pipeline stage)" if cfg.parallel.pp > 1 else ""))
    dev = torch.device(device)
    plan = resolve_choices(cfg, dev, world)  # as rank ``rank`` of the world would execute
    if checkpointing is None:
        checkpointing = resolve_checkpointing(cfg, world, plan, device_budget(device_memory_bytes(dev)))
    plan = dataclasses.replace(plan, checkpointing=checkpointing)
    if plan.weight_gathers is not None:  # a sharded rank
        if weight_gathers is not None:
            plan = dataclasses.replace(plan, weight_gathers=weight_gathers)
        elif cfg.execution.weight_gathers == "auto":
            plan = resolve_weight_gathers(cfg, world, plan, checkpointing, None,
                                          device_budget(device_memory_bytes(dev)))[0]
    if micro_batches is not None and cfg.parallel.pp_chunks > 1:  # interleaved: whole groups of pp micro-batches
        micro_batches = -(-micro_batches // cfg.parallel.pp) * cfg.parallel.pp
    layout = heaviest_stage(cfg.model, MemoryLayout.of_run(cfg, world, checkpointing, plan, micro_batches))
    predicted = estimate(cfg.model, layout)
    record = {"preset": cfg.preset, "world": world, "rank": rank, "ep": cfg.parallel.ep,
              "pp": cfg.parallel.pp, "pp_chunks": cfg.parallel.pp_chunks, "stage": layout.stage,
              "in_flight": layout.in_flight,
              "optimizer": cfg.parallel.optimizer, "dtype": plan.dtype, "seq_len": cfg.data.seq_len,
              "micro_batch": layout.micro_batch, "accumulation": layout.accumulation,
              "checkpointing": f"{checkpointing[0]}" + (f"/{checkpointing[1]}" if checkpointing[0] == "full" else ""),
              "weight_gathers": plan.weight_gathers or "",
              "experts_backend": plan.experts or "", "exchange": plan.expert_exchange or "",
              "model_gib": predicted.peak_gib, "model_at": predicted.at,
              "terms_gib": {k: v / GIB for k, v in predicted.terms.items()}, "device": dev.type,
              "torch": torch.__version__}
    gpu = getattr(torch, dev.type) if dev.type in ("cuda", "xpu") else None
    # What the device held before this rehearsal built anything (another user of the device) is
    # held throughout: the peak recorded is the rehearsal's own, that subtracted, and the record
    # says how much it was. An earlier rehearsal's model is collected first: left as cyclic
    # garbage, it could be collected inside this rehearsal and be counted twice by the
    # subtraction; its cached blocks are returned, so the reserved peak is this one's.
    gc.collect()
    if gpu is not None:
        gpu.empty_cache()
    held_before = gpu.memory_allocated(dev) if gpu is not None else 0
    # the meta rehearsal's mesh is the CPU's (torch has no meta process groups); its shares stay meta
    with loopback_world(cfg, stage_world, rank, torch.device("cpu") if dev.type == "meta" else dev,
                        stage=layout.stage) as mesh:
        model = build_model(cfg, mesh, device=dev, plan=plan)
        optimizer = build_run_optimizer(model, cfg, mesh, plan)
        record["shares_gib"] = {k: v / GIB for k, v in static_terms(model).items()}
        record["model_shares_gib"] = {k: v / GIB for k, v in static_bytes(cfg.model, layout).items()}
        if dev.type == "meta":
            return record
        per_step = layout.micro_batch * layout.accumulation
        generator = torch.Generator(device=dev).manual_seed(cfg.train.seed * 7919 + rank)
        times = []
        for i in range(warmup + steps):
            if i == warmup and gpu is not None:
                gpu.reset_peak_memory_stats(dev)
            batch_BS1 = torch.randint(0, cfg.model.vocab_size, (per_step, cfg.data.seq_len + 1), generator=generator,
                                      device=dev)
            t0 = time.perf_counter()
            if cfg.parallel.pp > 1:
                stats = _stage_step(model, optimizer, batch_BS1, layout, plan, cfg, generator)
            else:
                stats = train_step(model, optimizer, batch_BS1, micro_batch=layout.micro_batch,
                                   grad_clip=cfg.optim.grad_clip, lr=cfg.optim.lr, dtype=plan.dtype, mesh=mesh)
            record.setdefault("grad_norms", []).append(float(stats.grad_norm))
            if gpu is not None:
                gpu.synchronize(dev)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        record.update(steps=steps, warmup=warmup, step_s=times, loss=float(stats.loss))
        if gpu is not None:  # the caching allocator's peaks over the steps: what the device had to hold
            record.update(peak_allocated_gib=(gpu.max_memory_allocated(dev) - held_before) / GIB,
                          held_before_gib=held_before / GIB,
                          peak_reserved_gib=gpu.max_memory_reserved(dev) / GIB,
                          device_name=gpu.get_device_name(dev),
                          device_total_gib=gpu.get_device_properties(dev).total_memory / GIB)
            record["model_error"] = record["model_gib"] / record["peak_allocated_gib"] - 1
        if save_dir is not None:  # after the steps' peak is read: the save resets the counters
            record.update(_rehearse_save(model, optimizer, mesh, save_dir, gpu))
    return record


def schedule_order(pp: int, chunks: int, stage: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """The forwards and backwards of pipeline rank ``stage`` in one step, as ("F" or "B", chunk,
    micro-batch): under 1F1B (``chunks`` 1) pp - stage forwards, then a backward and a forward at
    a time, then the last backwards; interleaved, Megatron's order of the rank's chunks (groups of
    pp micro-batches per chunk, the backwards from the last chunk down), its warm-up 2 (pp -
    stage - 1) + (chunks - 1) pp forwards, then a forward and a backward at a time (the memory
    model's in_flight counts the same)."""
    if chunks > 1 and micro_batches % pp:
        raise ValueError(f"{micro_batches} micro-batches: interleaved stages run them in groups of pp = {pp}")
    if chunks == 1:
        warm = min(pp - stage, micro_batches)
        order = [("F", 0, i) for i in range(warm)]
        for i in range(micro_batches):
            order.append(("B", 0, i))
            if warm + i < micro_batches:
                order.append(("F", 0, warm + i))
        return order
    total = micro_batches * chunks

    def place(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % chunks
        return (chunks - 1 - chunk if backward else chunk), (k // (pp * chunks)) * pp + k % pp

    warm = min(total, 2 * (pp - stage - 1) + (chunks - 1) * pp)
    order = [("F", *place(k, False)) for k in range(warm)]
    for k in range(total - warm):
        order += [("F", *place(warm + k, False)), ("B", *place(k, True))]
    return order + [("B", *place(k, True)) for k in range(total - warm, total)]


def _stage_step(model, optimizer, batch_BS1: torch.Tensor, layout: MemoryLayout, plan, cfg: RunConfig,
                generator: torch.Generator):
    """One step of a pipeline rank alone (module doc): its stages' micro-batches in the schedule's
    order (schedule_order) with random inputs and output gradients where its neighbours would
    send them, each stage's gradients synchronised as the pipeline's are, then its update.
    Returns the step's StepStats (loss: the last stage's, else nan)."""
    from .parallel.pipeline import StageModule, routing_sums_size
    from .train.step import _update, autocast_context

    dev, m = batch_BS1.device, layout.accumulation
    cut = cfg.parallel.stage_layers(cfg.model.n_layers)
    act_dtype = getattr(torch, plan.residual_dtype)
    modules = [StageModule(model, first=s == 0, last=s == len(cut) - 1, weight=1.0 / m, act_dtype=act_dtype,
                           layers=range(*cut[s]), autocast=lambda: autocast_context(dev.type, plan.dtype))
               for s in cfg.parallel.rank_stages(layout.stage)]
    chunks = batch_BS1.split(layout.micro_batch)
    moe = model.cfg.moe is not None

    def forward(module, chunk):
        tokens, targets = chunk[:, :-1], chunk[:, 1:]
        if module.first:
            inputs = (tokens,)
        else:
            h = torch.randn(*tokens.shape, model.cfg.d_model, generator=generator, device=dev).to(act_dtype)
            sums = (torch.zeros(routing_sums_size(model.cfg.moe.n_experts), device=dev),) if moe else ()
            inputs = tuple(t.requires_grad_() for t in (h, *sums))
        return module(*inputs, targets=targets if module.last else None)

    def backward(module, out):
        if module.last:
            out.sum().backward()
        else:
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.randn(o.shape, generator=generator, device=dev).to(o.dtype) * 1e-3
                                           for o in outs])

    model.train()
    sync = getattr(optimizer, "before_micro_batch", lambda last, layers=None: None)  # as Pipeline.step
    sync(False)
    in_flight = {}
    for op, v, i in schedule_order(layout.pp, layout.chunks, layout.stage, m):
        if op == "F":
            in_flight[v, i] = forward(modules[v], chunks[i])
        else:
            sync(i == m - 1, modules[v].layers)
            backward(modules[v], in_flight.pop((v, i)))
    model.clear_routing()
    parts = modules[-1].parts
    sums_4 = torch.stack(parts).double().mean(0) if parts else torch.full((4,), float("nan"), dtype=torch.float64)
    return _update(model, optimizer, sums_4, None, [], grad_clip=cfg.optim.grad_clip, lr=cfg.optim.lr, accept=None)


def _rehearse_save(model, optimizer, mesh, save_dir: str, gpu) -> dict:
    """This rank's checkpoint write (optimus_core.train.checkpoint.training_tensors: views, no
    copies) and its manifest (the sha256 of its part), each timed, with the device's peak."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from .train import checkpoint as ckpt

    dev = mesh.device
    if gpu is not None:
        gpu.synchronize(dev)
        before = gpu.memory_allocated(dev)
        gpu.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(ckpt.training_tensors(model, optimizer, mesh), storage_writer=dcp.FileSystemWriter(save_dir),
                 no_dist=True)  # the loopback world has no planning collectives: this rank's part alone
    t1 = time.perf_counter()
    ckpt.write_rank_manifest(Path(save_dir), 0, "rehearsal", 0)  # no_dist named this rank's files __0_*
    out = {"save_s": t1 - t0, "manifest_s": time.perf_counter() - t1,
           "part_gib": sum(f.stat().st_size for f in Path(save_dir).glob("__0_*.distcp")) / GIB}
    if gpu is not None:
        out.update(save_peak_allocated_gib=gpu.max_memory_allocated(dev) / GIB, before_save_allocated_gib=before / GIB)
    return out


def fmt(record: dict) -> str:
    """One line of a rehearsal record."""
    chunks = record.get("pp_chunks", 1)
    stage = (f", stage {record['stage']} of {record['pp']}" + (f" (x {chunks} interleaved)" if chunks > 1 else "")
             if record.get("pp", 1) > 1 else "")
    gathers = f", gathered {record['weight_gathers'].replace('_', ' ')}" if record.get("weight_gathers") else ""
    head = (f"{record['preset']} on {record['world']} ranks (ep {record['ep']}, {record['checkpointing']}{gathers}, "
            f"rank {record['rank']}{stage}):")
    if "peak_allocated_gib" not in record:
        shares = ", ".join(f"{k} {v:.3f}" for k, v in record["shares_gib"].items())
        ran = f"; {record['steps']} steps, loss {record['loss']:.3f}" if "steps" in record else ""
        return f"{head} shares {shares} GiB; model {record['model_gib']:.1f} GiB{ran}"
    save = f"; save peak {record['save_peak_allocated_gib']:.2f} GiB" if "save_peak_allocated_gib" in record else ""
    return (f"{head} allocated {record['peak_allocated_gib']:.2f} GiB, reserved {record['peak_reserved_gib']:.2f}, "
            f"model {record['model_gib']:.2f} ({record['model_error']:+.1%}){save}")

