#!/usr/bin/env python3
"""Training-step speed on one GPU: tokens/s, step time by phase, peak memory, MFU (not a test).

    python bench/train_step.py [--variants ...] [--batch 2 4 8] [--repeat N] [--olmo-core-jsonl FILE] [--quick]
    python bench/train_step.py --ingest bench/results/train-step-nvidia-h200.jsonl   # into the store

Model: ``mula-7b-a1b`` with its full width and 8 of its 16 layers (OLMoE-1B-7B shapes: d_model
2048, 64 experts, top-8, expert hidden 1024, vocabulary 50,304), sequence ``--seq`` (default
2048, the paper's context), one micro-batch of ``--batch`` sequences per step (several values
make the micro-batch a variant axis: every variant at each, OLMo-core's harness run at the same
ones with ``--micro-batch N --seq S``), bf16 autocast with float32 master weights and AdamW
state: the configuration OLMo-core is measured at by ../shared/peers/olmo_core_step.py.
``mula-1b`` (dense, all 16 layers) for reference, and the layers of the paper's two largest
shapes that fit one card: ``100b<N>l`` (Mula-100B-A7B: d_model 3072, 144 experts of hidden
1536) and ``220b<N>l`` (Mula-220B-A10B: 240 experts), N of their layers, with the
full vocabulary. Each variant is one training step of the trainer core (optimus_core.train.measure:
warm-up, then the median of timed steps, phases from device events):

    default                 no execution choice set: what `optimus pretrain` gets (the plan's
                            "auto" everywhere: optimus_core.execution)
    loop / torch / triton   execution.experts: Python loop, torch._grouped_mm, ours
    +compile / (none)       execution.compile on / off (torch.compile of each block)
    +recast                 execution.recast_expert_weights: the float32 expert weights cast inside
                            each GEMM, no bf16 copies kept (less memory, a little more time)
    -xent                   execution.lm_loss = torch: the fused LM loss's softmax by torch ops
    -torch-qk-norm          execution.qk_norm_rope = torch: the QK-norm and RoPE by torch ops
    -fp32-residual          execution.fp32_residual: the residual stream in float32, not bf16
    +torch-adamw            execution.adamw = torch: torch's fused AdamW (and so no update beside
                            the forward and no bf16 expert gradients: the plan's rules)

Step time: ``step_s`` is the median of steps each followed by a host sync (phases come from
these); ``step_back_to_back_s`` the median between step boundaries with the steps queued back to
back, OLMo-core's own method (events at the boundaries, no sync): only it shows the update that
runs under the next forward. Tokens/s, MFU and the ratio to OLMo-core use the back-to-back
step where it was measured (``*_synced`` fields keep the synced one).

MFU = flops_per_token (the core's analytic count, optimus_core.flops) x tokens/s / peak, with
peak = 989 TFLOP/s (H100/H200 dense bf16 datasheet, the convention) and, beside it, the dense
bf16 matmul rate measured in the same run. OLMo-core's lines (its JSON, produced in the same GPU
call, one or more per micro-batch) give ``ratio_vs_olmo_core`` = our best tokens/s / its tokens/s
at the same micro-batch.

``--repeat N`` runs the variants N times in turns (A B A B ...): a step's time moves between GPU
calls, so a claim should not rest on one run. Each variant is summarized by its median pass, the
slower middle one for even N; every pass's tokens/s is kept in the summary.

Beside each variant, where nvidia-smi reads the GPU (bench/gpu_telemetry.py), its SM clock,
power against the enforced limit and the share of samples the driver reported a power cap or
thermal slowdown in, over the steps its tokens/s comes from (``gpu_*`` fields).

Output: a table, bench/results/train-step-<device>.jsonl (one line per variant, micro-batch and
pass, written as each finishes, + a summary line with ``ratio_vs_olmo_core`` and
``ablation_speedup`` = best over the loop-experts baseline on one GPU, for the first micro-batch at
top level and for each under ``by_micro_batch``) and, where the results store imports, run
``bench-train-step-<device>``, one table per ``series`` = variant@mb<micro-batch> (``--ingest``
writes it from the file later, on a machine that has the store).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, ingest, publish, read_jsonl, write_jsonl  # noqa: E402
from bench.gpu_telemetry import GpuSampler, clock_note  # noqa: E402

PEAK_FLOPS = 989e12  # H100 / H200 dense bf16, datasheet: the MFU convention
MODEL_7B = dict(preset="mula-7b-a1b", overrides={"model.n_layers": 8})
MODEL_7B_WHOLE = dict(preset="mula-7b-a1b", overrides={})  # all 16 layers: OLMoE-1B-7B itself
MODEL_1B = dict(preset="mula-1b", overrides={})
RECAST = {"execution.recast_expert_weights": True}
TORCH_XENT = {"execution.lm_loss": "torch"}
TORCH_ADAMW = {"execution.adamw": "torch"}


def _run(experts: str, compiled: bool, **extra) -> dict:
    return {"execution.experts": experts, "execution.compile": compiled, **extra}


VARIANTS = {  # name -> (model, execution overrides)
    "7b8l-default": (MODEL_7B, {}),
    "7b8l-default-torch-qk-norm": (MODEL_7B, {"execution.qk_norm_rope": "torch"}),
    "7b8l-default-fp32-residual": (MODEL_7B, {"execution.fp32_residual": True}),
    "7b8l-loop": (MODEL_7B, _run("loop", False)),
    "7b8l-torch": (MODEL_7B, _run("torch", False)),
    "7b8l-triton": (MODEL_7B, _run("triton", False)),
    "7b8l-torch+compile": (MODEL_7B, _run("torch", True)),
    "7b8l-triton+compile": (MODEL_7B, _run("triton", True)),
    "7b8l-triton+compile-xent": (MODEL_7B, _run("triton", True, **TORCH_XENT)),
    "7b8l-triton+compile+torch-adamw": (MODEL_7B, _run("triton", True, **TORCH_ADAMW)),
    "7b8l-triton+recast": (MODEL_7B, _run("triton", False, **RECAST)),
    "7b8l-torch+compile+recast": (MODEL_7B, _run("torch", True, **RECAST)),
    "7b8l-triton+compile+recast": (MODEL_7B, _run("triton", True, **RECAST)),
    "7b16l-triton+compile": (MODEL_7B_WHOLE, _run("triton", True)),
    "1b-dense+compile": (MODEL_1B, {"execution.compile": True}),
    "100b1l-default": (dict(preset="mula-100b-a7b", overrides={"model.n_layers": 1}), {}),
    "100b2l-default": (dict(preset="mula-100b-a7b", overrides={"model.n_layers": 2}), {}),
    "220b1l-default": (dict(preset="mula-220b-a10b", overrides={"model.n_layers": 1}), {}),
}


DEFAULT_VARIANT = "7b8l-default"  # what a run gets without overrides


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="names of VARIANTS")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: the paper's context)")
    p.add_argument("--batch", type=int, nargs="+", default=[2],
                   help="sequences per step, one micro-batch; several: each variant at each (the micro-batch axis)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1,
                   help="passes over the variants, in turns; each variant is summarized by its slower-median pass")
    p.add_argument("--olmo-core-jsonl", default=None, help="OLMo-core's JSON line(s) from the same GPU call")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke check, timings meaningless")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"))
    p.add_argument("--ingest", default=None, help="write an existing JSONL file to the store and exit")
    p.add_argument("--summarize-only", action="store_true",
                   help="measure nothing: rewrite the summary of the existing results file (with --olmo-core-jsonl)")
    p.add_argument("--results", default=None,
                   help="with --summarize-only: this results file (any machine) instead of this device's")
    return p.parse_args(argv)


def matmul_tflops(device, n: int = 8192, reps: int = 20) -> float:
    """Dense bf16 matmul rate of this device, measured now (the realistic ceiling)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def series(variant: str, batch: int) -> str:
    """A record's table in the store: its variant at its micro-batch."""
    return f"{variant}@mb{batch}"


def run_variant(name: str, args, device, batch: int, sampler=None) -> dict:
    import torch

    from optimus_core import presets
    from optimus_core.parallel import Mesh
    from optimus_core.train.measure import measure_steps

    model, extra = VARIANTS[name]
    overrides = {**model["overrides"], "data.seq_len": args.seq, "train.global_batch": batch,
                 "train.micro_batch": batch, "train.device": device.type, **extra}
    preset = model["preset"]
    if args.quick:
        preset += "@laptop"
        overrides.update({"data.seq_len": 64, "model.n_layers": 2})
        overrides.pop("execution.compile", None)
        if overrides.get("execution.experts") == "torch":  # no torch._grouped_mm on a CPU
            overrides["execution.experts"] = "loop"
    cfg = presets.get(preset).run_config(**overrides)
    # Compiled code of an earlier variant holds on to its model and buffers: drop it, so each
    # variant's peak memory is its own.
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    point = measure_steps(cfg, Mesh.single(device), steps=args.steps, warmup=args.warmup)
    plan = point["plan"]
    # The GPU's clocks and power over the steps tokens/s comes from (back to back where measured)
    synced, back_to_back = point.pop("synced_window_unix_s"), point.pop("back_to_back_window_unix_s")
    telemetry = sampler.window(*(back_to_back if "step_back_to_back_s" in point else synced)) if sampler else {}
    flops = cfg.model.flops_per_token(cfg.data.seq_len)
    return {"bench": "train_step", "variant": name, "series": series(name, batch), "preset": preset,
            "overrides": model["overrides"],
            "experts_backend": plan["experts"], "compile": plan["compile"], "dtype": plan["dtype"],
            "recast_expert_weights": plan["recast_expert_weights"], "adamw": plan["adamw"],
            "lm_loss": plan["lm_loss"], "seq_len": cfg.data.seq_len, "batch": batch,
            "params": cfg.model.num_params(), "active_params": cfg.model.num_active_params(),
            "flops_per_token": flops, "mfu": flops * _tokens_per_s(point) / PEAK_FLOPS,
            "mfu_synced": flops * point["tokens_per_s"] / PEAK_FLOPS,
            "wall_s": time.perf_counter() - t0, **point, **telemetry}


def _tokens_per_s(record: dict) -> float:
    """Back to back where measured (OLMo-core's method), else between synced steps."""
    return record.get("tokens_per_s_back_to_back") or record["tokens_per_s"]


def _ratio(record: dict | None, key: str, olmo_gib: float | None) -> float | None:
    """Our peak (bytes) over OLMo-core's (GiB), where both were measured."""
    ours = record and record.get(key)
    return ours / 2**30 / olmo_gib if ours and olmo_gib and ours == ours else None


def _median_passes(records: list[dict]) -> list[dict]:
    """One record per variant: with several passes (--repeat), the pass of median tokens/s, the
    slower of the two middle ones for an even count (the claim least favourable to us), with
    every pass's tokens/s beside it (``tokens_per_s_passes``)."""
    by_variant: dict[str, list[dict]] = {}
    for r in records:
        by_variant.setdefault(r["variant"], []).append(r)
    out = []
    for runs in by_variant.values():
        ranked = sorted(runs, key=_tokens_per_s)
        pick = ranked[(len(ranked) - 1) // 2]
        out.append({**pick, "tokens_per_s_passes": [_tokens_per_s(r) for r in runs]} if len(runs) > 1 else pick)
    return out


def summarize(records: list[dict], olmo: list[dict], dense_tflops: float | None, device: str) -> dict:
    """The summary line: for each micro-batch measured (a record without ``batch`` is of the
    default 2), the 8-layer 7B variants' best, the default, the ablation and the ratios to
    OLMo-core's line of the same micro-batch (``olmo``: its best line per micro-batch, from
    _olmo_lines). The first micro-batch's fields are also at top level."""
    by_batch: dict[int, list[dict]] = {}
    for r in records:
        by_batch.setdefault(r.get("batch", 2), []).append(r)
    peers = {_olmo_micro_batch(line): line for line in olmo}
    blocks = {b: _summarize_batch(rs, peers.get(b), dense_tflops) for b, rs in sorted(by_batch.items())}
    first = next(iter(blocks.values()), _summarize_batch([], None, dense_tflops))
    out = {"bench": "train_step_summary", "device": device, "peak_flops": PEAK_FLOPS,
           "dense_matmul_tflops": dense_tflops, **first}
    if len(blocks) > 1:
        out["by_micro_batch"] = {str(b): block for b, block in blocks.items()}
    return out


def _summarize_batch(records: list[dict], olmo: dict | None, dense_tflops: float | None) -> dict:
    measured = _median_passes([r for r in records if r["variant"].startswith("7b8l") and "error" not in r])  # 8-layer 7B
    moe = measured
    best = max(moe, key=_tokens_per_s) if moe else None
    base = next((r for r in moe if r["variant"] == "7b8l-loop"), None)
    out = {"best_variant": best and best["variant"],
           "best_tokens_per_s": best and _tokens_per_s(best), "best_mfu": best and best["mfu"],
           "best_mfu_vs_measured_matmul": best and dense_tflops and
           best["flops_per_token"] * _tokens_per_s(best) / (dense_tflops * 1e12),
           "ablation_speedup": best and base and _tokens_per_s(best) / _tokens_per_s(base),
           "ablation_note": "one GPU: kernels only (the EP-aware optimizer needs >1 rank; bench/distributed.py)",
           "tokens_per_s_passes": {r["variant"]: r["tokens_per_s_passes"] for r in measured if "tokens_per_s_passes" in r}}
    if olmo and best:
        olmo_tps = _olmo_tokens_per_s(olmo)
        default = next((r for r in moe if r["variant"] == DEFAULT_VARIANT), None)
        out.update(olmo_core_tokens_per_s=olmo_tps, olmo_core_tokens_per_s_mean=olmo["tokens_per_s"],
                   olmo_core_peak_memory_gib=olmo.get("peak_mem_gib"),
                   ratio_vs_olmo_core=_tokens_per_s(best) / olmo_tps,
                   ratio_default_vs_olmo_core=default and _tokens_per_s(default) / olmo_tps,
                   ratio_default_synced_vs_olmo_core=default and default["tokens_per_s"] / olmo_tps,
                   # the default variant's memory (a CUDA-graph variant's allocated peak leaves out
                   # its graphs' pool: the reserved peak counts it)
                   memory_vs_olmo_core=_ratio(default, "peak_memory_bytes", olmo.get("peak_mem_gib")),
                   memory_reserved_vs_olmo_core=_ratio(default, "peak_reserved_bytes", olmo.get("peak_reserved_gib")))
    else:
        out["ratio_vs_olmo_core"] = None
    return out


def _olmo_micro_batch(line: dict) -> int:
    """The micro-batch of OLMo-core's line (its config's, else its tokens per step over the sequence)."""
    config = line.get("config") or {}
    if config.get("micro_batch"):
        return int(config["micro_batch"])
    if line.get("tokens_per_step") and config.get("seq_len"):
        return int(line["tokens_per_step"]) // int(config["seq_len"])
    return 2  # the harness's default, as lines without a config were measured


def _olmo_tokens_per_s(olmo: dict) -> float:
    """OLMo-core's tokens/s by its median step: median against median, both back to back (its
    ``tokens_per_s`` is a mean over its timed steps; older lines lack the median and use it)."""
    if olmo.get("step_ms_median") and olmo.get("tokens_per_step"):
        return olmo["tokens_per_step"] / (olmo["step_ms_median"] / 1e3)
    return olmo["tokens_per_s"]


def _olmo_lines(path: str | None) -> list[dict]:
    """OLMo-core's result lines from ../shared/peers/olmo_core_step.py's output, one per
    micro-batch: with several runs of one micro-batch in the file (bench/gpu_suite.sh runs it
    before and after ours on one GPU), the fastest by median step, the ratio least favourable to
    us; ``olmo_core_runs_step_ms_median`` lists them all."""
    if not path or not Path(path).is_file():
        return []
    runs: dict[int, list[dict]] = {}
    for line in read_jsonl(path):
        if "tokens_per_s" in line:
            runs.setdefault(_olmo_micro_batch(line), []).append(line)
    return [{**max(lines, key=_olmo_tokens_per_s),
             "olmo_core_runs_step_ms_median": [line.get("step_ms_median") for line in lines]}
            for _, lines in sorted(runs.items())]


def summarize_file(path: Path, olmo: list[dict], name: str) -> None:
    """Rewrite the summary of an existing results file, with OLMo-core's lines when given (or
    those already in the file)."""
    lines = read_jsonl(path)
    records = [line for line in lines if line.get("bench") == "train_step"]
    olmo = olmo or [line for line in lines if str(line.get("bench", "")).startswith("olmo_core")]
    old = next((line for line in lines if line.get("bench") == "train_step_summary"), {})
    summary = summarize(records, olmo, old.get("dense_matmul_tflops"), name)
    write_jsonl(path, records + [{"bench": "olmo_core", **line} for line in olmo] + [summary])
    print(json.dumps(summary, indent=1))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ingest:
        print(ingest(args.ingest, args.store, key="series", fallback="variant"))
        return
    import torch

    if args.summarize_only and args.results:  # any machine: the file names its device
        path = Path(args.results)
        summarize_file(path, _olmo_lines(args.olmo_core_jsonl), path.stem.removeprefix("train-step-"))
        return
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("bench/train_step.py measures a GPU training step and found no CUDA device; "
                 "`--quick` runs a CPU smoke check of the script")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_slug(device)
    path = Path(args.out) / f"train-step-{name}.jsonl"
    olmo = _olmo_lines(args.olmo_core_jsonl)
    if args.summarize_only:  # OLMo-core finished after us, in the same call: add its line
        summarize_file(path, olmo, name)
        return
    dense = matmul_tflops(device) if device.type == "cuda" else None
    if dense:
        print(f"dense bf16 matmul 8192^3: {dense:.0f} TFLOP/s")
    if args.repeat < 1:
        sys.exit(f"--repeat {args.repeat}: must be >= 1")
    if min(args.batch) < 1:
        sys.exit(f"--batch {args.batch}: every micro-batch must be >= 1")
    records = []
    sampler = GpuSampler.start(device)  # clocks and power beside each variant (None without nvidia-smi)
    print(f"{'variant':>38} {'tokens/s':>10} {'b2b ms':>7} {'step ms':>8} {'compute':>8} {'optim':>7} "
          f"{'idle':>6} {'MFU':>6} {'peak GiB':>8}")
    runs = [(batch, variant) for batch in args.batch for variant in args.variants]
    for i, (batch, variant) in enumerate(runs * args.repeat):
        passed = {"pass": i // len(runs)} if args.repeat > 1 else {}
        label = series(variant, batch) if len(args.batch) > 1 else variant
        try:
            r = {**run_variant(variant, args, device, batch, sampler), **passed}
        except Exception as e:  # one variant failing (OOM, a compile error) must not lose the others
            r = {"bench": "train_step", "variant": variant, "series": series(variant, batch), "batch": batch,
                 **passed, "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{label:>38} failed: {r['error']}", flush=True)
            records.append(r)
            write_jsonl(path, records)
            continue
        records.append(r)
        write_jsonl(path, records)  # nothing measured is lost if the call is cut short
        b2b = r.get("step_back_to_back_s", float("nan"))
        print(f"{label:>38} {_tokens_per_s(r):>10,.0f} {b2b * 1e3:>7.1f} {r['step_s'] * 1e3:>8.1f} "
              f"{r['compute_s'] * 1e3:>8.1f} "
              f"{r['optimizer_s'] * 1e3:>7.1f} {r['idle_s'] * 1e3:>6.1f} {r['mfu']:>6.1%} "
              f"{r['peak_memory_bytes'] / 2**30:>8.1f}{clock_note(r)}", flush=True)
    if sampler:
        sampler.stop()
    publish(path, records, summarize(records, olmo, dense, name), args.store, key="series",
            extra=[{"bench": "olmo_core", **line} for line in olmo])


if __name__ == "__main__":
    main()
