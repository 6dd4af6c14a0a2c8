#!/usr/bin/env python3
"""The optimizer's memory traffic on one GPU: torch's fused AdamW against ours (not a test).

    python bench/optimizer.py [--numel N] [--reps 20] [--warmup 3]
    python bench/optimizer.py --ingest bench/results/optimizer-nvidia-h200.jsonl   # into the store
    TRITON_INTERPRET=1 python bench/optimizer.py --numel 4097 --reps 1 --warmup 1  # CPU smoke check

N defaults to the parameter count of ``mula-7b-a1b`` with 8 of its 16 layers (3.56B, the model of
bench/train_step.py), all float32 master weights, gradients and AdamW moments. Cases, each one
call of the optimizer's pass over all N parameters (``/s`` = with grad_scale, the clip factor as
the training step passes it; lr 4e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1):

    copy                     dst.copy_(src) of one float32 buffer: the bandwidth a stream reaches
    norm-torch               torch.linalg.vector_norm of the flat gradient
    norm-triton              optimus_kernels.squared_norm of it (float32 per block, float64 sum)
    adamw-torch-flat[/s]     torch.optim.AdamW(fused=True) on one flat tensor (the ZeRO-1 optimizer's layout)
    adamw-torch-list/s       the same on the model's 91 parameter tensors (1-D, in proportion,
                             when --numel shrinks N)
    adamw-triton[/s]         optimus_kernels.adamw_step_ on the flat buffers
    adamw-triton+bf16/s      the same, also writing the bf16 copy of the parameters

GB/s counts the minimal traffic: 8 bytes per element for the copy, 4 for a norm, 28 for AdamW
(read p, g, m, v; write p, m, v) and 30 with the bf16 copy. torch's fused kernel also writes
the unscaled gradient back when it has a grad_scale (32 bytes moved); that is not counted.

Timing: device events around each call after the warm-up (which includes Triton's tuning),
the median of --reps; on the CPU the host clock (a smoke check: the Triton cases run in the
interpreter under TRITON_INTERPRET=1 and are skipped otherwise; timings meaningless). Output:
a table, bench/results/optimizer-<device>.jsonl (one line per case and a summary line, written
atomically) and, where the results store imports, run ``bench-optimizer-<device>``.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

import torch  # noqa: E402

from bench.common import device_slug, ingest, publish  # noqa: E402
from bench.kernels import Timer  # noqa: E402
from bench.train_step import MODEL_7B  # noqa: E402

HYPER = dict(lr=4e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)  # OLMoE's AdamW
CPU_MAX = 1 << 20  # the CPU run is a smoke check (the interpreter is slow)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=None, help="parameters (default: the 8-layer mula-7b-a1b's)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per case (median taken)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the JSON lines file")
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"), help="results store ('' to skip)")
    p.add_argument("--ingest", default=None, help="write an existing JSONL file to the store and exit")
    return p.parse_args(argv)


def model_shapes() -> list[tuple[int, ...]]:
    """The benchmark model's parameter shapes, in order (a meta-device build)."""
    from optimus_core import presets
    from optimus_core.model.transformer import Transformer

    cfg = presets.get(MODEL_7B["preset"]).run_config(**MODEL_7B["overrides"])
    with torch.device("meta"):
        return [tuple(p.shape) for p in Transformer(cfg.model).parameters()]


def model_sizes() -> list[int]:
    return [math.prod(shape) for shape in model_shapes()]


def scaled(sizes: list[int], numel: int) -> list[int]:
    """The same number of tensors in the same proportions, summing to numel (each >= 1 where
    numel allows)."""
    total = sum(sizes)
    if numel == total:
        return list(sizes)
    out = [max(1, s * numel // total) for s in sizes][:numel]
    out[out.index(max(out))] += numel - sum(out)
    return out


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    return torch.device("cpu")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type != "cpu":
        getattr(torch, device.type).empty_cache()


def torch_adamw(params, grads, device, exp_avgs=None, exp_avg_sqs=None):
    """torch's fused AdamW over params (their .grad = grads); moments shared with ours when given,
    so the flat case holds one set of state."""
    from optimus_core.train.optim import step_with_grad_scale

    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=True)
    if exp_avgs is not None:
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=device), "exp_avg": m, "exp_avg_sq": v}

    def step(scale=None):
        if scale is None:
            opt.step()
        else:
            step_with_grad_scale(opt, scale)
    return opt, step


def flat_cases(numel: int, device: torch.device, triton_ok: bool, measure) -> None:
    """The one-flat-buffer cases (the ZeRO-1 optimizer's layout): measure(case, tensors, bytes per
    element, fn) for each. The buffers live until this returns."""
    from optimus_kernels import adamw_step_, squared_norm

    scale = torch.tensor(1.5, device=device)  # a clip factor: grads divided by 1.5
    p, g, m, v = (torch.empty(numel, device=device) for _ in range(4))
    p.normal_(0, 0.02)
    g.normal_(0, 1e-3)
    m.zero_()
    v.zero_()
    copy_case(p, measure)
    measure("norm-torch", 1, 4, lambda: torch.linalg.vector_norm(g))
    if triton_ok:
        measure("norm-triton", 1, 4, lambda: squared_norm(g))
    _, step = torch_adamw([torch.nn.Parameter(p)], [g], device, [m], [v])  # the Parameter shares p
    measure("adamw-torch-flat", 1, 28, lambda: step())
    measure("adamw-torch-flat/s", 1, 28, lambda: step(scale))
    if triton_ok:
        count = [0]

        def ours(**kw):
            count[0] += 1
            adamw_step_(p, g, m, v, **HYPER, step=count[0], **kw)

        p16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
        measure("adamw-triton", 1, 28, lambda: ours())
        measure("adamw-triton/s", 1, 28, lambda: ours(grad_scale=scale))
        measure("adamw-triton+bf16/s", 1, 30, lambda: ours(grad_scale=scale, param_bf16_N=p16))


def copy_case(src: torch.Tensor, measure) -> None:
    dst = torch.empty_like(src)  # freed on return, before the AdamW cases
    measure("copy", 1, 8, lambda: dst.copy_(src))


def list_case(numel: int, device: torch.device, measure) -> None:
    """torch's fused AdamW over the model's parameter tensors (its multi-tensor kernel)."""
    scale = torch.tensor(1.5, device=device)
    shapes = model_shapes()  # the model's own at its size, else 1-D tensors in its proportions
    if numel != sum(math.prod(shape) for shape in shapes):
        shapes = [(n,) for n in scaled([math.prod(shape) for shape in shapes], numel)]
    params = [torch.nn.Parameter(torch.empty(shape, device=device).normal_(0, 0.02)) for shape in shapes]
    grads = [torch.empty(shape, device=device).normal_(0, 1e-3) for shape in shapes]
    _, step = torch_adamw(params, grads, device)
    measure("adamw-torch-list/s", len(shapes), 28, lambda: step(scale))


def summarize(records: list[dict], device: str, numel: int, args) -> dict:
    ms = {r["case"]: r["ms"] for r in records if "ms" in r}
    gbps = {r["case"]: r["gbps"] for r in records if "gbps" in r}

    def ratio(a, b):
        return ms[b] / ms[a] if a in ms and b in ms else None

    def saved(a, b):
        return ms[b] - ms[a] if a in ms and b in ms else None

    return {
        "bench": "optimizer_summary", "device": device, "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "numel": numel,
        "model": f"{MODEL_7B['preset']} {MODEL_7B['overrides']}", "hyper": HYPER, "reps": args.reps,
        "bytes_formula": "minimal traffic per element: copy 8, norm 4, adamw 28 (read p g m v, write p m v), "
                         "+2 with the bf16 copy; gbps = bytes / median time",
        "speedup_triton_over_torch_flat": ratio("adamw-triton/s", "adamw-torch-flat/s"),
        "speedup_triton_over_torch_list": ratio("adamw-triton/s", "adamw-torch-list/s"),
        "ms_saved_triton_vs_torch_flat": saved("adamw-triton/s", "adamw-torch-flat/s"),
        "ms_bf16_copy_costs": saved("adamw-triton/s", "adamw-triton+bf16/s"),
        "speedup_norm_triton_over_torch": ratio("norm-triton", "norm-torch"),
        "adamw_triton_fraction_of_copy_gbps": gbps.get("adamw-triton/s") and gbps.get("copy") and
        gbps["adamw-triton/s"] / gbps["copy"],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ingest:
        print(ingest(args.ingest, args.store, key="case"))
        return
    device = pick_device()
    numel = args.numel or sum(model_sizes())
    if device.type == "cpu" and numel > CPU_MAX:
        sys.exit(f"bench/optimizer.py measures GPU memory bandwidth and found no CUDA or XPU device; on the CPU "
                 f"it is a smoke check for --numel <= {CPU_MAX} (with TRITON_INTERPRET=1 for the Triton cases)")
    from optimus_kernels._triton import INTERPRET, triton

    triton_ok = triton is not None and (device.type != "cpu" or INTERPRET)
    name = device_slug(device)
    timer = Timer(device, reps=args.reps, warmup=args.warmup)
    records = []
    print(f"{numel:,} float32 parameters on {name}")
    print(f"{'case':>22} {'tensors':>7} {'B/param':>7} {'median ms':>10} {'GB/s':>8}")

    def measure(case, tensors, per, fn):
        line = {"bench": "optimizer", "case": case, "device": name, "numel": numel, "tensors": tensors,
                "bytes_per_param": per, "bytes": per * numel}
        try:
            ms = timer(fn)
        except Exception as e:  # one case failing (no fused AdamW on this device) must not lose the others
            line["error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{case:>22} failed: {line['error']}", flush=True)
        else:
            line.update(ms=ms, gbps=per * numel / ms / 1e6)
            print(f"{case:>22} {tensors:>7} {per:>7} {ms:>10.3f} {line['gbps']:>8.1f}", flush=True)
        records.append(line)

    flat_cases(numel, device, triton_ok, measure)
    free(device)  # the flat buffers, before the list's own
    try:
        list_case(numel, device, measure)
    except torch.OutOfMemoryError as e:  # its own allocations: keep the flat cases' results
        records.append({"bench": "optimizer", "case": "adamw-torch-list/s", "device": name, "numel": numel,
                        "error": f"OutOfMemoryError: {e}"[:500]})
    publish(Path(args.out) / f"optimizer-{name}.jsonl", records, summarize(records, name, numel, args), args.store,
            key="case")


if __name__ == "__main__":
    main()
