#!/usr/bin/env python3
"""Where a rehearsed rank's peak memory lies, and what is allocated then (not a test).

    python bench/memory_rehearsal.py --experiment pretrain-mula-7b-a1b --tiles 12288 [--top 25] [--set K=V ...]

The rank of `optimus rehearse` (optimus_core.rehearsal: the fake process group with loopback
collectives) warmed up by one step, then one step recorded by the CUDA caching allocator and
replayed as bench/memory_step.py does: the peak by what made each block (the repository frame
that allocated it, or the model's parameters and moments by name), beside the memory model's
terms (optimus_core.memory). Output: a table, and one JSON line per run appended to
bench/results/memory-rehearsal-<device>.jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, read_jsonl, write_jsonl  # noqa: E402
from bench.memory_step import GIB, record_step  # noqa: E402


def known_blocks(model, optimizer) -> dict[int, tuple[int, str]]:
    """{address: (bytes, name)} of the rank's shares, moments and gradients (local tensors)."""
    from optimus_core.parallel.layout import local_tensor

    named: dict[int, tuple[int, str]] = {}

    def add(t, what: str) -> None:
        t = local_tensor(t) if t is not None else None
        if t is not None and t.is_cuda and t.numel() and t.untyped_storage().data_ptr() not in named:
            named[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), what)

    for name, p in model.named_parameters():
        add(p, "parameter shares (float32, experts)" if ".experts." in name else "parameter shares (float32, dense)")
        if p.grad is not None:
            add(p.grad, "gradient shares")
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            add(state.get(key), "AdamW moments")
    return named


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiment", required=True)
    p.add_argument("--tiles", type=int, default=0, help="default: the run's own")
    p.add_argument("--site", default="aurora")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override the run's config (e.g. execution.expert_exchange=all_gather)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)

    import torch

    import dataclasses

    from optimus_core.execution import resolve_choices
    from optimus_core.memory import estimate
    from optimus_core.rehearsal import loopback_world
    from optimus_core.train.build import build_model, build_run_optimizer
    from optimus_core.train.step import train_step
    from optimus_core.config import apply_overrides
    from workflow.commands import parse_overrides, rehearsal_jobs
    from workflow.sites import load_site

    job, = rehearsal_jobs([args.experiment], [args.tiles] if args.tiles else [], load_site(args.site, account="x"))
    cfg, device = apply_overrides(job.run, parse_overrides(args.set)), torch.device("cuda")
    from optimus_core.memory import MemoryLayout

    plan = dataclasses.replace(resolve_choices(cfg, device, job.world), checkpointing=job.checkpointing)
    layout = MemoryLayout.of_run(cfg, job.world, job.checkpointing, plan, micro_batches=1)
    with loopback_world(cfg, job.world, 0, device) as mesh:
        model = build_model(cfg, mesh, plan=plan)
        optimizer = build_run_optimizer(model, cfg, mesh, plan)
        batch = torch.randint(0, cfg.model.vocab_size, (layout.micro_batch, cfg.data.seq_len + 1), device=device)

        def step():
            stats = train_step(model, optimizer, batch, micro_batch=layout.micro_batch, grad_clip=cfg.optim.grad_clip,
                               lr=cfg.optim.lr, dtype=plan.dtype, mesh=mesh)
            float(stats.grad_norm)

        step()
        torch.cuda.synchronize()
        # Checkpoint's early stop ends a recomputation by raising inside a saved-tensor hook; under
        # the allocator's Python-stack recording that failed on torch 2.11 (SystemError: "apply ...
        # returned NULL without setting an exception", as in pytorch/pytorch#179536). Without the
        # early stop a recomputation runs its block to the end: its extra tensors are transient.
        from torch.utils.checkpoint import set_checkpoint_early_stop

        with set_checkpoint_early_stop(False):
            result, measured = record_step(step, known_blocks(model, optimizer))
    model_terms = {k: v / GIB for k, v in estimate(cfg.model, layout).terms.items()}
    print(f"{job.name} at {job.world} tiles ({job.checkpointing}): peak {result['peak_bytes'] / GIB:.2f} GiB in the "
          f"{result['peak_phase']} (max_memory_allocated {measured / GIB:.2f}); model {sum(model_terms.values()):.2f}: "
          + ", ".join(f"{k} {v:.2f}" for k, v in model_terms.items()))
    for title, key in (("at the peak", "at_peak"), ("at the backward's start", "at_backward_start")):
        print(f"  {title}:")
        for what, size in list(result[key].items())[:args.top]:
            print(f"    {size / GIB:7.3f} GiB  {what[:120]}")
    record = {"bench": "memory_rehearsal", "name": job.name, "world": job.world, "device": device_slug(device),
              "overrides": parse_overrides(args.set),
              "checkpointing": list(job.checkpointing), "checkpoint_early_stop": False,
              "max_memory_allocated_bytes": measured,
              "model_terms_gib": model_terms, **{k: v for k, v in result.items() if k not in ("at_peak", "at_backward_start")},
              "at_peak": dict(list(result["at_peak"].items())[:40]),
              "at_backward_start": dict(list(result["at_backward_start"].items())[:40])}
    path = Path(args.out) / f"memory-rehearsal-{device_slug(device)}.jsonl"
    write_jsonl(path, (read_jsonl(path) if path.exists() else []) + [record])
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in record.items() if k not in ("at_peak", "at_backward_start")})[:800])


if __name__ == "__main__":
    main()
