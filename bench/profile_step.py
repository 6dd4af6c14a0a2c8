#!/usr/bin/env python3
"""Where a training step's GPU time goes, kernel by kernel (not a test).

    python bench/profile_step.py [--variant 7b8l-triton+compile] [--steps 3] [--trace DIR]

The same step as bench/train_step.py (its VARIANTS: model and execution overrides),
warmed up, then ``--steps`` steps under torch.profiler. Device kernels are put in categories by
name (expert GEMMs, dense GEMMs, attention, permute / SwiGLU, AdamW, norms, compiled fusions,
copies and casts, ...) and reported as ms per step, with the 25 most expensive kernels. Output: a
table, and one JSON line (categories + top kernels, and the GPU's clocks and power over the
profiled steps where nvidia-smi reads them: bench/gpu_telemetry.py) in
bench/results/profile-<device>.jsonl.
With ``--trace DIR`` the host is profiled too and the timeline is written to
DIR/trace-<variant>.json.gz, for bench/trace_gaps.py (where the device idles, and why).
With ``--sources N`` the host is profiled with Python stacks, and for the N most expensive
kernels that are not GEMMs, attention or the optimizer's, the table says what launched them:
the ATen op, its callers (autograd's backward nodes among them) and the project's Python frames
(kernels launched from Python, Triton's, have no op and are not listed).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, write_jsonl  # noqa: E402
from bench.gpu_telemetry import GpuSampler, clock_note  # noqa: E402
from bench.train_step import VARIANTS  # noqa: E402

CATEGORIES = [  # (category, regular expression on the kernel name), first match wins
    ("expert GEMM (ours)", r"_grouped_mm|grouped_mm_tma|_gmm"),
    ("expert GEMM (CUTLASS)", r"grouped|GroupedGemm|cutlass.*group"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("dense GEMM", r"gemm|nvjet|sm90_xmma|cutlass|cublas|matmul"),
    ("permute / unpermute", r"permute|combine"),
    ("SwiGLU", r"swiglu"),
    ("AdamW", r"adamw|adam"),
    ("LM-loss softmax", r"xent|SoftMax"),  # ours (optimus_kernels.cross_entropy) or torch's log-softmax
    ("norms", r"norm"),
    ("compiled fusions", r"^triton_"),
    ("copy / cast / fill", r"copy|cast|fill|elementwise|vectorized|unrolled"),
    ("reduce / sort / index", r"reduce|sort|scan|index|scatter|gather|radix"),
    ("collectives", r"nccl"),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def build_variant_step(variant: str, seq: int, batch: int, device):
    """(model, optimizer, step) of bench/train_step.py's ``variant`` on ``device``: ``step()`` runs
    one training step on fixed random tokens (``batch`` sequences of ``seq``, one micro-batch)
    and waits for its gradient norm."""
    import torch

    from optimus_core import presets
    from optimus_core.parallel import Mesh
    from optimus_core.execution import plan_execution
    from optimus_core.train.build import build_model, build_run_optimizer
    from optimus_core.train.step import train_step

    model_spec, extra = VARIANTS[variant]
    overrides = {**model_spec["overrides"], "data.seq_len": seq, "train.global_batch": batch,
                 "train.micro_batch": batch, "train.device": device.type, **extra}
    cfg = presets.get(model_spec["preset"]).run_config(**overrides)
    mesh = Mesh.single(device)
    plan = plan_execution(cfg, device)
    model = build_model(cfg, mesh, plan=plan)
    optimizer = build_run_optimizer(model, cfg, mesh, plan)
    batch_BS1 = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), device=device)

    def step():
        stats = train_step(model, optimizer, batch_BS1, micro_batch=batch, grad_clip=cfg.optim.grad_clip,
                           lr=cfg.optim.lr, dtype=plan.dtype)
        float(stats.grad_norm)

    return model, optimizer, step


def variant_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments of a tool that looks into one warmed-up step of a bench/train_step.py variant."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--variant", default="7b8l-default", choices=list(VARIANTS),
                   help="a bench/train_step.py variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p


def warmed_up_step(args, tool: str):
    """(model, optimizer, step) of ``args.variant`` on the GPU, after ``args.warmup`` steps (the
    autotuning and compilation done); exits with a message where there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"{tool} needs a CUDA device and found none")
    model, optimizer, step = build_variant_step(args.variant, args.seq, args.batch, torch.device("cuda"))
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    return model, optimizer, step


NOT_SOURCED = ("expert GEMM (ours)", "expert GEMM (CUTLASS)", "dense GEMM", "attention", "AdamW")


def kernel_sources(prof, kernels: dict[str, float], n: int, steps: int) -> list[dict]:
    """For the ``n`` most expensive kernels outside NOT_SOURCED: ms per step by launcher, a
    launcher being the op that launched the kernel, its callers (innermost first, up to 5) and
    the project's Python frames of the launch (innermost first, up to 4). Printed and returned."""
    wanted = [name for name, _ in sorted(kernels.items(), key=lambda kv: -kv[1]) if category(name) not in NOT_SOURCED][:n]
    by_source: dict[tuple, float] = {}
    for event in prof.events():
        for kernel in getattr(event, "kernels", []):
            if kernel.name not in wanted:
                continue
            callers, parent = [], event.cpu_parent
            while parent is not None and len(callers) < 5:
                callers.append(parent.name)
                parent = parent.cpu_parent
            frames = [f for f in (event.stack or []) if any(part in f for part in ("optimus_core", "kernels/", "bench/"))][:4]
            key = (kernel.name, event.name, tuple(callers), tuple(frames))
            by_source[key] = by_source.get(key, 0.0) + kernel.duration / 1e3 / steps
    rows = [{"kernel": k[0][:200], "op": k[1], "callers": list(k[2]), "frames": list(k[3]), "ms": ms}
            for k, ms in sorted(by_source.items(), key=lambda kv: (wanted.index(kv[0][0]), -kv[1]))]
    for row in rows:
        if row["ms"] >= 0.05:
            print(f"  {row['ms']:7.2f} ms  {row['kernel'][:70]}\n      op {row['op']}  <- {' <- '.join(row['callers'])}"
                  f"\n      {' | '.join(row['frames'])}")
    return rows


def main(argv=None) -> None:
    p = variant_arguments(__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", default=None, help="also profile the host and write the timeline to this folder")
    p.add_argument("--sources", type=int, default=0,
                   help="name what launched the N most expensive kernels outside GEMMs, attention and AdamW")
    args = p.parse_args(argv)

    import torch

    from optimus_core.train.measure import write_timeline

    _, _, step = warmed_up_step(args, "bench/profile_step.py")
    device = torch.device("cuda")
    sampler = GpuSampler.start(device)  # the clocks and power the kernels' times were taken at
    started = time.time()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if args.trace or args.sources:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, with_stack=bool(args.sources)) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("optimus.step"):
                step()
        torch.cuda.synchronize()
    telemetry = sampler.window(started, time.time()) if sampler else {}
    if sampler:
        sampler.stop()
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        trace = Path(args.trace) / f"trace-{args.variant.replace('+', '-')}.json"
        print(f"wrote {write_timeline(prof, trace)}")
    kernels: dict[str, float] = {}
    for event in prof.events():
        # (record_function ranges show up on the device too: not kernels)
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False) \
                and event.name != "optimus.step" and not event.name.startswith("Optimizer.step"):
            ms = event.time_range.elapsed_us() / 1e3 / args.steps  # per step
            kernels[event.name] = kernels.get(event.name, 0.0) + ms
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + ms
    total = sum(kernels.values())
    print(f"{args.variant}: {total:.1f} ms of kernels per step{clock_note(telemetry)}")
    for label, ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        print(f"  {label:>24} {ms:8.2f} ms  {ms / total:6.1%}")
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    for name, ms in top:
        print(f"  {ms:8.2f} ms  {category(name):>24}  {name[:110]}")
    record = {"bench": "profile_step", "variant": args.variant, "batch": args.batch, "device": device_slug(device),
              "kernel_ms_per_step": total, "categories_ms": by_category,
              "top_kernels_ms": [{"name": n[:300], "ms": ms, "category": category(n)} for n, ms in top],
              **telemetry}
    if args.sources:
        record["sources"] = kernel_sources(prof, kernels, args.sources, args.steps)
    path = Path(args.out) / f"profile-{device_slug(device)}.jsonl"
    write_jsonl(path, [record])
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in record.items() if k != "top_kernels_ms"})[:2000])


if __name__ == "__main__":
    main()
