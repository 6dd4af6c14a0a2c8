#!/usr/bin/env python3
"""Benchmark of the expert kernels on the OLMoE expert shapes (not a test).

    python bench/kernels.py [--quick] [--tokens 8192,16384,32768] [--only up,down,permute]
                            [--backends triton,triton-pointer,...] [--dw-configs] [--tma-configs] [--ws]
                            [--store results/store.zarr]

Shapes (OLMoE-1B-7B / Mula-7B-A1B): 64 experts, top-8, d_model 2048, expert hidden 1024, bf16.
  up    grouped_mm (T*8, 2048) x (64, 2048, 2048) -> gate+up   (K=2048, N=2*1024)
  down  grouped_mm (T*8, 1024) x (64, 1024, 2048)              (K=1024, N=2048)
for T tokens per GPU, routing balanced (every expert gets T*8/64 rows) or Zipf-skewed (expert
e chosen with weight 1/(e+1)^1.2, top-8 without replacement, Gumbel top-k). Each backend of
optimus_kernels.grouped_mm (loop, torch, triton: those that run here) is timed forward and backward
(dx and dw) separately, beside torch._grouped_mm called bare ("torch_raw": the "torch" backend
also zeroes the rows past offsets[-1], one extra pass) and a dense torch.mm of the same FLOPs
(the ceiling). "triton" is optimus_kernels.grouped_mm as the training calls it: the TMA kernels
(kernels/optimus_kernels/hopper/grouped_mm_tma.py) where they can run, else the pointer kernels, chosen per call.
Beside it, rows that run the pointer kernels where TMA could run, through the private
launchers' keyword (tma=False). The pointer kernels are the path on pre-sm90 GPUs and unaligned
shapes (Intel XPU runs the TMA kernels' tensor-descriptor form); these rows time them on the same GPU. They call the launchers directly,
without autograd and the custom ops' dispatch: less host time per call, which favours them
where the host bounds an eager call (small GEMMs, e.g. --quick's 2048 tokens); compare them
with "triton" at 8k+ tokens. Each row records the kernels that really ran ("kernels": "ws",
"tma" or "pointer" per pass; "fallback" names the reason where the TMA kernels could not):
  triton-pointer    forward, dx (w^T read through strides) and dw by the pointer kernels
  triton-dw-pointer dw by the pointer kernel, dx by the TMA kernel (bwd and dw)
  triton-dense      grouped_mm's triton kernels on one group (G = 1): a dense GEMM, beside cuBLAS
  TFLOP/s = 2*M*K*N (fwd) or 4*M*K*N (bwd) / median time,  M = T*8.
The "dw" pass (triton and the pointer rows) times the dW op alone, 2*M*K*N, written in
float32 as for the training's float32 master weights (the bwd pass's dw is in w's bf16). The
"bwd-dx" and "bwd-dw" passes split the backward, 2*M*K*N each, so that each half is compared
with torch._grouped_mm's: torch_raw and dense rows ask autograd for one gradient; triton and
triton-dense call each custom op alone (a custom op computes every gradient autograd could ask
of it), the pointer rows each launcher.
permute+unpermute (forward pair, backward pair) is reported in GB/s of minimal traffic (each
input read once, each output written once) beside a plain copy (clone) of the (T*8, 2048)
sorted activations: fwd 2*(T + T*8)*D*2 bytes, bwd (3*T*8 + 2*T)*D*2 bytes, copy 2*T*8*D*2.
The "expert sort" rows time optimus_kernels.permute.expert_sort alone (ids to sorted_idx and offsets),
in GB/s of ids read + sorted_idx written, and "expert sort E+1" the same with one more (empty)
group, as capacity dropping and expert parallelism sort (65 groups: the counting sort's wider
tiles): for "triton" the sort permute runs (the counting sort where it applies), for
"triton-sort-torch" torch.sort + searchsorted (expert_sort's private counting=False; the
sort rows only, since permute itself takes no choice of sort).
--ws (Hopper): each config of the warp-specialized Gluon kernel (kernels/optimus_kernels/hopper/grouped_mm_ws.py, what
"triton" runs there for the forward and dx), forward and dx, checked against a float32
reference, then timed in turns with the TMA kernel ("triton-tma") and torch._grouped_mm
("torch_raw"); the summary's ws_over_* hold the ratios.

Timing: device events around each call, warm-up (which also runs Triton's autotuning) then
the median of --reps repeats; the GEMM rows of one pass are timed in turns (Timer.interleaved),
so that clock and power drift, which moved one dense GEMM by 30 % between back-to-back series,
hits every row alike. Output: a table on stdout, bench/results/kernels-<device>.jsonl
(one line per measurement and a summary line, written atomically) and, where the project's
results store imports (optimus_core.store), run "bench-kernels-<device>" with one table per
series, step = tokens. Without a GPU: exits with a message; `--quick` with TRITON_INTERPRET=1
runs a tiny float32 smoke check on the CPU instead (timings meaningless).
One file past 600 lines: every row of the table goes through the same timing harness (turns,
warm-up, telemetry), which its passes share.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import write_jsonl  # noqa: E402
from bench.gpu_telemetry import GpuSampler, clock_note  # noqa: E402
from optimus_kernels import available_backends, grouped_mm, permute, unpermute  # noqa: E402
from optimus_kernels.grouped_mm import _launch_grouped_mm, _launch_grouped_mm_dw, _launch_grouped_mm_dx  # noqa: E402
from optimus_kernels.hopper.grouped_mm_tma import tma_unsupported  # noqa: E402
from optimus_kernels.hopper.grouped_mm_ws import ws_unsupported  # noqa: E402
from optimus_kernels.permute import counting_sort_applies, expert_sort  # noqa: E402

OLMOE = dict(experts=64, top_k=8, d_model=2048, hidden=1024)
TINY = dict(experts=4, top_k=2, d_model=32, hidden=16)  # the interpreter smoke check
# name: (the private launchers' tma keyword for the forward, dx and dw; passes timed). "triton"
# (grouped_mm itself: TMA where it runs) and "triton-dense" are timed for every pass.
TRITON_VARIANTS = {
    "triton-pointer": (dict(forward=False, dx=False, dw=False), ("fwd", "bwd", "bwd-dx", "bwd-dw", "dw")),
    "triton-dw-pointer": (dict(forward=True, dx=True, dw=False), ("bwd", "dw")),
}
# Passes: fwd; bwd = dx and dw; bwd-dx / bwd-dw = that one gradient only (in the backward's
# own dtype, so every backend computes the same thing); dw = the triton dW op alone with a
# float32 output, as the training's float32 master weights get it.
SPLIT_PASSES = ("bwd-dx", "bwd-dw")
# Rows on one group (a dense GEMM of the same M, K, N): "dense" is cuBLAS (torch.mm), the
# ceiling; "triton-dense" our default triton kernels given G = 1, offsets = [M]: what their
# code generation reaches without any grouping, beside cuBLAS in the same run.
DENSE_ROWS = ("dense", "triton-dense")
OPS = ("up", "down", "permute")
# name: expert_sort's private keywords, for the "expert sort" rows alone; "triton" is what permute runs
PERMUTE_VARIANTS = {"triton-sort-torch": dict(counting=False)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one small token count, balanced routing, few repeats")
    p.add_argument("--tokens", default="8192,16384,32768", help="comma list of tokens per GPU")
    p.add_argument("--only", default=",".join(OPS), help=f"comma list of ops among {','.join(OPS)}")
    p.add_argument("--backends", default="",
                   help="comma list of GEMM rows to time (default all that run here): loop, torch, "
                        f"torch_raw, triton, {', '.join(TRITON_VARIANTS)}, dense; and of permute rows: "
                        f"loop, triton, {', '.join(PERMUTE_VARIANTS)}")
    p.add_argument("--dw-configs", action="store_true",
                   help="also time each config of the TMA dW kernel alone (float32 and bf16 out)")
    p.add_argument("--tma-configs", action="store_true",
                   help="also time each config of the forward / dx TMA kernel alone")
    p.add_argument("--ws", action="store_true",
                   help="also time the warp-specialized Gluon forward / dx kernel, each config, "
                        "beside the TMA kernel and torch._grouped_mm (Hopper)")
    p.add_argument("--reps", type=int, default=50, help="timed repeats per measurement (median taken)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the JSON lines file")
    p.add_argument("--store", default=str(ROOT / "results" / "store.zarr"), help="results store ('' to skip)")
    return p.parse_args(argv)


def pick_device(quick: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    if quick and os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    sys.exit("bench/kernels.py measures GPU kernels and found no CUDA or XPU device. For a smoke "
             "check of the script on the CPU: TRITON_INTERPRET=1 python bench/kernels.py --quick")


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu-interpreter"
    name = getattr(torch, device.type).get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class Timer:
    """Median milliseconds of fn() with device events (host clock on the CPU)."""

    def __init__(self, device: torch.device, reps: int, warmup: int, sampler=None):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.mod = getattr(torch, device.type) if device.type != "cpu" else None
        # The GPU's clocks and power over the last timing (bench/gpu_telemetry.py; {} without a
        # sampler): every row of a pass timed in turns shares it.
        self.sampler, self.telemetry = sampler, {}

    def _timed_window(self, t0: float) -> None:
        self.telemetry = self.sampler.window(t0, time.time()) if self.sampler else {}

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if self.mod is None:
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        events = [(self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True))
                  for _ in range(self.reps)]
        self.mod.synchronize()
        t0 = time.time()
        for start, end in events:
            start.record()
            fn()
            end.record()
        self.mod.synchronize()
        self._timed_window(t0)
        return statistics.median(s.elapsed_time(e) for s, e in events)

    def interleaved(self, fns: dict) -> dict[str, float]:
        """Median milliseconds of each fn, timed in turns: repeat i runs every fn once, starting
        from a different one each time. Back-to-back repeats of one kernel and then of the next
        drift with the GPU's clocks and power (the same dense GEMM measured 568 to 798 TFLOP/s
        within one run, timed that way); in turns, every fn sees the same conditions."""
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        names = list(fns)
        if not names:  # e.g. the float32-output "dw" pass of a run that asked for torch only
            return {}
        times = {name: [] for name in names}
        if self.mod is None:
            for i in range(self.reps):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    t0 = time.perf_counter()
                    fns[name]()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            return {name: statistics.median(t) for name, t in times.items()}
        events = {name: [(self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True))
                         for _ in range(self.reps)] for name in names}
        self.mod.synchronize()
        t0 = time.time()
        for i in range(self.reps):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start, end = events[name][i]
                start.record()
                fns[name]()
                end.record()
        self.mod.synchronize()
        self._timed_window(t0)
        return {name: statistics.median(s.elapsed_time(e) for s, e in ev) for name, ev in events.items()}

    def graphed(self, fn) -> float | None:
        """Median milliseconds of fn() replayed from a CUDA graph: the device's time alone. A
        few small kernels behind Python launchers take longer to launch than to run, so events
        around an eager call time the host; the graph removes the launches (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (autotuning, first allocations)
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as e:  # an op that cannot be captured: the eager time stands alone
            print(f"  (no CUDA graph: {str(e)[:200]})", flush=True)
            return None
        return self(graph.replay)


def route(T: int, E: int, k: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """topk_idx (T, k), k distinct experts per token."""
    if routing == "balanced":  # token t takes experts t*k .. t*k+k-1 (mod E): equal loads
        return (torch.arange(T)[:, None] * k + torch.arange(k)) % E
    logits = -1.2 * torch.log(torch.arange(1, E + 1, dtype=torch.float64))
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=gen, dtype=torch.float64)))
    return (logits + gumbel).topk(k, dim=1).indices  # = sampling k without replacement


def bench_gemms(rec, timer, device, dtype, T, routing, topk_idx, shape, backends, ops=("up", "down")):
    """Each pass of every row timed interleaved (Timer.interleaved): the rows share the GPU's
    clock and power state, so that their ratios hold even where the absolute numbers drift."""
    E, k, D, H = shape["experts"], shape["top_k"], shape["d_model"], shape["hidden"]
    M = T * k
    offsets = permute(torch.empty(T, 0, device=device), topk_idx, E, backend="loop")[1]
    load = offsets.diff(prepend=offsets.new_zeros(1)).float()
    whole = torch.tensor([M], dtype=torch.int32, device=device)  # one group: triton-dense
    gen = torch.Generator(device=device).manual_seed(0)
    for gemm, K, N in (("up", D, 2 * H), ("down", H, D)):
        if gemm not in ops:
            continue
        x = torch.randn(M, K, device=device, dtype=dtype, generator=gen).requires_grad_()
        w = (torch.randn(E, K, N, device=device, dtype=dtype, generator=gen) * 0.02).requires_grad_()
        dy = torch.randn(M, N, device=device, dtype=dtype, generator=gen)
        w2d = w[0].detach().clone().requires_grad_()
        w_one = w2d.detach()[None].clone().requires_grad_()
        flop = 2 * M * K * N
        fields = dict(op=gemm, tokens=T, routing=routing, M=M, K=K, N=N, experts=E,
                      max_over_mean_load=(load.max() / load.mean()).item())
        rows = {}  # name -> ({pass: (fn, flop)}, record extras)
        for name in backends:
            if name not in ("loop", "torch", "torch_raw", "triton", *DENSE_ROWS, *TRITON_VARIANTS):
                continue
            ours = name.startswith("triton")
            weight, offs = {"dense": (w2d, None), "triton-dense": (w_one, whole)}.get(name, (w, offsets))
            if name == "torch_raw":  # without the backend's zeroing of rows past offsets[-1]
                fwd = lambda: torch._grouped_mm(x, w, offs=offsets)  # noqa: E731
            elif name == "dense":
                fwd = lambda: x @ w2d  # noqa: E731
            else:
                fwd = (lambda b, wt, o: lambda: grouped_mm(x, wt, o, backend=b))(
                    "triton" if ours else name, weight, offs)
            default_passes = ("fwd", "bwd")
            if name in ("torch_raw", "dense") or name in ("triton", "triton-dense"):
                default_passes += SPLIT_PASSES  # ("torch" is an autograd.Function: both grads always)
            default_passes += ("dw",) if name == "triton" else ()
            tma, timed = TRITON_VARIANTS.get(name, (dict(forward=True, dx=True, dw=True), default_passes))
            extra = {}
            if ours:  # the kernels that really run: TMA where asked for and it can run here, the
                # warp-specialized one for the forward and dx where that can (Hopper)
                reason = tma_unsupported(x, weight, dy)  # dy stands in for y: same shape, dtype, strides
                ws = {"forward": ws_unsupported(x, weight, dy) is None,
                      "dx": ws_unsupported(dy, weight, x, trans_w=True) is None}
                extra["kernels"] = {p: "pointer" if not on or reason is not None else "ws" if ws.get(p) else "tma"
                                    for p, on in tma.items()}
                extra.update({"fallback": reason} if reason and any(tma.values()) else {})
            try:
                if name in TRITON_VARIANTS:  # through the launchers with their tma keyword
                    passes = _launcher_passes(x.detach(), weight.detach(), offs, dy, tma, flop)
                    for p in timed:  # compiles and autotunes each kernel: a failure costs this row only
                        passes[p][0]()
                    rows[name] = ({p: passes[p] for p in timed}, extra)
                    continue
                y = fwd()  # also compiles and autotunes the forward
                params = (x, weight)

                def grads(of, y=y):
                    return lambda: torch.autograd.grad(y, of, dy, retain_graph=True)
                passes = {"fwd": (fwd, flop), "bwd": (grads(params), 2 * flop)}
                if ours:  # a custom op computes every gradient autograd could ask for: call each alone
                    passes["bwd-dx"] = ((lambda wt, o: lambda: torch.ops.optimus.grouped_mm_dx(dy, wt, o))(weight, offs), flop)
                    passes["bwd-dw"] = ((lambda o: lambda: torch.ops.optimus.grouped_mm_dw(x.detach(), dy, o, False))(offs), flop)
                    passes["dw"] = (lambda: torch.ops.optimus.grouped_mm_dw(x.detach(), dy, offsets, True), flop)
                else:
                    passes["bwd-dx"], passes["bwd-dw"] = (grads(params[:1]), flop), (grads(params[1:]), flop)
                rows[name] = ({p: passes[p] for p in timed}, extra)
            except Exception as e:  # a variant row that fails (e.g. to compile) costs its row only
                if name not in TRITON_VARIANTS:
                    raise
                rec(op=gemm, pass_="-", backend=name, tokens=T, routing=routing,
                    error=f"{type(e).__name__}: {e}"[:2000], **extra)
        for pass_ in ("fwd", "bwd", *SPLIT_PASSES, "dw"):
            fns = {name: passes[pass_][0] for name, (passes, _) in rows.items() if pass_ in passes}
            for name, ms in timer.interleaved(fns).items():
                f = rows[name][0][pass_][1]
                rec(pass_=pass_, backend=name, ms=ms, tflops=f / ms / 1e9, flop=f, **fields, **rows[name][1])
        del rows  # free the rows' graphs before the next GEMM's


def _launcher_passes(x, w, offsets, dy, tma: dict, flop: int) -> dict:
    """{pass: (fn, flop)} of a TRITON_VARIANTS row: each product through its private launcher
    with the row's tma keyword (bwd: dx then dw, in the backward's dtype; dw: float32 out)."""
    def dx():
        return _launch_grouped_mm_dx(dy, w, offsets, tma=tma["dx"])

    def dw(float32_out):
        return lambda: _launch_grouped_mm_dw(x, dy, offsets, float32_out, tma=tma["dw"])

    return {"fwd": (lambda: _launch_grouped_mm(x, w, offsets, tma=tma["forward"]), flop),
            "bwd": (lambda: (dx(), dw(False)()), 2 * flop), "bwd-dx": (dx, flop),
            "bwd-dw": (dw(False), flop), "dw": (dw(True), flop)}


def tma_configs_chosen(device, dtype) -> dict[str, str]:
    """What the autotuner chose for the forward / dx TMA kernel, per autotune key (N, K, the row
    bucket, forward or dx, transposed w, and the argument dtypes); empty where it never ran."""
    from optimus_kernels._triton import triton
    from optimus_kernels.hopper.grouped_mm_tma import _grouped_mm_tma_tuned

    if triton is None:
        return {}
    return {str(key): str(config) for key, config in _grouped_mm_tma_tuned(device.type, dtype).cache.items()}


def named_configs(configs) -> dict[str, dict]:
    """{"BLOCK_M=128,...,num_stages=3": launch keywords} of an autotuning list's triton.Configs."""
    out = {}
    for cfg in configs:
        config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        out[",".join(f"{k}={v}" for k, v in config.items())] = config
    return out


def bench_dw_configs(rec, timer, device, dtype, T, routing, topk_idx, shape):
    """Each config of the TMA dW kernel's autotuning list timed alone, in turns (--dw-configs):
    float32 out, as the training's float32 master weights take it, and the input's dtype, as
    the experts' gradients on their bf16 copies (the step's default) do: what the autotuner
    chose among, and by how much. torch._grouped_mm ("torch_raw", its dw in the inputs' dtype:
    ``out_dtype``) runs in the same turns; ``turns_out_dtype`` names the TMA kernel's beside it."""
    from optimus_kernels.hopper.grouped_mm_tma import _dw_tma_configs, launch_grouped_mm_dw_tma
    configs = named_configs(_dw_tma_configs(device.type, dtype))
    for out_dtype in dict.fromkeys((torch.float32, dtype)):  # once where the input is float32
        for gemm, x, dy, offsets, dw in _dw_operands(device, dtype, T, topk_idx, shape):
            (M, K), (E, _, N) = x.shape, dw.shape
            dw = dw.to(out_dtype)
            fns = {name: (lambda c=c, dw=dw: launch_grouped_mm_dw_tma(x, dy, offsets, dw, config=c))
                   for name, c in configs.items()}
            fns["torch_raw"] = lambda: torch._grouped_mm(x.t(), dy, offs=offsets)
            for name, ms in timer.interleaved(fns).items():
                written = dtype if name == "torch_raw" else out_dtype  # torch._grouped_mm has no float32 out
                rec(op=gemm, pass_="dw", backend="torch_raw" if name == "torch_raw" else "triton-dw-config",
                    config=configs.get(name, {}), tokens=T, routing=routing,
                    out_dtype=str(written).removeprefix("torch."), turns_out_dtype=str(out_dtype).removeprefix("torch."),
                    ms=ms, tflops=2 * M * K * N / ms / 1e9, flop=2 * M * K * N, M=M, K=K, N=N, experts=E)


def _dw_operands(device, dtype, T, topk_idx, shape):
    """(gemm, x, dy, offsets, dw) of the up and down projections' dW: x (M, K), dy (M, N) in
    ``dtype``, dw (E, K, N) float32 as the training's master weights take it."""
    E, k, D, H = shape["experts"], shape["top_k"], shape["d_model"], shape["hidden"]
    M = T * k
    offsets = permute(torch.empty(T, 0, device=device), topk_idx, E, backend="loop")[1]
    gen = torch.Generator(device=device).manual_seed(0)
    for gemm, K, N in (("up", D, 2 * H), ("down", H, D)):
        x = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
        dy = torch.randn(M, N, device=device, dtype=dtype, generator=gen) / N**0.5
        yield gemm, x, dy, offsets, torch.empty(E, K, N, device=device, dtype=torch.float32)


def _fwd_dx_operands(device, dtype, T, topk_idx, shape):
    """(gemm, pass, trans_w, x, w, offsets, y, flop) of the up and down projections' forward
    and dx (w read transposed): what the forward / dx kernels' config rows time."""
    E, k, D, H = shape["experts"], shape["top_k"], shape["d_model"], shape["hidden"]
    M = T * k
    offsets = permute(torch.empty(T, 0, device=device), topk_idx, E, backend="loop")[1]
    gen = torch.Generator(device=device).manual_seed(0)
    for gemm, K, N in (("up", D, 2 * H), ("down", H, D)):
        w = torch.randn(E, K, N, device=device, dtype=dtype, generator=gen) / K**0.5
        for pass_, trans_w in (("fwd", False), ("bwd-dx", True)):
            rows_in, cols_out = (K, N) if not trans_w else (N, K)
            x = torch.randn(M, rows_in, device=device, dtype=dtype, generator=gen)
            y = torch.empty(M, cols_out, device=device, dtype=dtype)
            yield gemm, pass_, trans_w, x, w, offsets, y, 2 * M * K * N


def bench_tma_configs(rec, timer, device, dtype, T, routing, topk_idx, shape):
    """Each config of the forward / dx TMA kernel's autotuning list timed alone, in turns
    (--tma-configs): the up and down projections' forward and dx."""
    from optimus_kernels.hopper.grouped_mm_tma import _tma_configs, launch_grouped_mm_tma
    configs = named_configs(_tma_configs(device.type, dtype))
    for gemm, pass_, trans_w, x, w, offsets, y, flop in _fwd_dx_operands(device, dtype, T, topk_idx, shape):
        M, K, N = x.shape[0], *w.shape[1:]
        want = launch_grouped_mm_tma(x, w, offsets, torch.empty_like(y), trans_w=trans_w, dx=trans_w)

        def run(c):
            return launch_grouped_mm_tma(x, w, offsets, y, trans_w=trans_w, dx=trans_w, config=c)
        fields = dict(op=gemm, pass_=pass_, backend="triton-tma-config", tokens=T, routing=routing)
        fns = checked_configs(rec, fields, configs, lambda c: torch.testing.assert_close(run(c), want, rtol=2e-2,
                                                                                         atol=2e-2), run)
        for name, ms in timer.interleaved(fns).items():
            rec(op=gemm, pass_=pass_, backend="triton-tma-config", config=configs[name], tokens=T,
                routing=routing, ms=ms, tflops=flop / ms / 1e9, flop=flop, M=M, K=K, N=N, experts=w.shape[0])


def bench_ws(rec, timer, device, dtype, T, routing, topk_idx, shape):
    """The warp-specialized Gluon kernel (--ws; kernels/optimus_kernels/hopper/grouped_mm_ws.py), each config checked
    against a float32 reference and then timed, in turns with the TMA kernel ("triton-tma",
    autotuned) and torch._grouped_mm ("torch_raw"): the forward and dx of the up and down
    projections."""
    from optimus_kernels import grouped_mm_reference
    from optimus_kernels.hopper.grouped_mm_tma import launch_grouped_mm_tma
    from optimus_kernels.hopper.grouped_mm_ws import CONFIGS, config_dict, config_name, launch_grouped_mm_ws, ws_unsupported
    configs = {config_name(c): config_dict(*c) for c in CONFIGS}
    for gemm, pass_, trans_w, x, w, offsets, y, flop in _fwd_dx_operands(device, dtype, T, topk_idx, shape):
        M, K, N = x.shape[0], *w.shape[1:]
        b = w.transpose(1, 2) if trans_w else w
        fields = dict(op=gemm, pass_=pass_, tokens=T, routing=routing)
        fns = {"triton-tma": lambda: launch_grouped_mm_tma(x, w, offsets, y, trans_w=trans_w, dx=trans_w),
               "torch_raw": lambda: torch._grouped_mm(x, b, offs=offsets)}
        if (reason := ws_unsupported(x, w, y, trans_w)) is not None:
            rec(backend="triton-ws", error=reason, **fields)
            continue
        want = grouped_mm_reference(x.float(), b.float(), offsets).double()

        def run(c, out=y):
            return launch_grouped_mm_ws(x, w, offsets, out, trans_w=trans_w, config=c)

        def check(c):
            err = ((run(c, torch.full_like(y, float("nan"))).double() - want).norm() / want.norm()).item()
            if not err < 5e-3:  # NaN too: a row left unwritten
                raise AssertionError(f"relative error {err:.3g} against the float32 reference")
        fns.update(checked_configs(rec, {**fields, "backend": "triton-ws"}, configs, check, run))
        _time_ws_rows(rec, timer, fns, configs, fields, flop, M=M, K=K, N=N, experts=w.shape[0])


def checked_configs(rec, fields: dict, configs: dict[str, dict], check, run) -> dict:
    """{name: () -> run(config)} of the ``configs`` that pass ``check(config)``: one that raises
    (it does not compile here, or does not match) is recorded as an error row of ``fields`` and
    not timed."""
    fns = {}
    for name, c in configs.items():
        try:
            check(c)
        except Exception as e:  # noqa: BLE001  (recorded, not fatal)
            rec(config=c, error=f"{type(e).__name__}: {str(e)[:300]}", **fields)
            continue
        fns[name] = lambda c=c: run(c)
    return fns


def _time_ws_rows(rec, timer, fns, configs, fields, flop, **shape):
    """Time the --ws rows in turns: the ``configs`` (by name) as "triton-ws" rows, the baselines
    under their own names."""
    for name, ms in timer.interleaved(fns).items():
        rec(backend="triton-ws" if name in configs else name, config=configs.get(name, {}),
            ms=ms, tflops=flop / ms / 1e9, flop=flop, turns="ws", **shape, **fields)


def bench_permute(rec, timer, device, dtype, T, routing, topk_idx, shape, backends):
    E, k, D = shape["experts"], shape["top_k"], shape["d_model"]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, D, device=device, dtype=dtype, generator=gen).requires_grad_()
    weights = torch.rand(T, k, device=device, generator=gen).requires_grad_()
    dout = torch.randn(T, D, device=device, dtype=dtype, generator=gen)
    b = torch.finfo(dtype).bits // 8
    fwd_bytes, bwd_bytes = 2 * (T + T * k) * D * b, (3 * T * k + 2 * T) * D * b
    ids = topk_idx.reshape(-1)
    for name in backends:
        timed = []  # (op, pass, fn, bytes, fn replayed from a CUDA graph or None, record extras)
        if name not in PERMUTE_VARIANTS:  # the pair, as permute runs it (no choice of sort)
            extra = {"kernels": {"sort": "counting" if counting_sort_applies(ids, E) else "torch"}} \
                if name == "triton" else {}

            def pair(backend=name):
                x_sorted, _, sorted_idx = permute(x, topk_idx, E, backend=backend)
                return unpermute(x_sorted, sorted_idx, weights, backend=backend)

            def pair_no_grad(backend=name):  # what a CUDA graph can capture: no autograd graph
                with torch.no_grad():
                    return pair(backend)
            out = pair()
            back = (lambda out: lambda: torch.autograd.grad(out, (x, weights), dout, retain_graph=True))(out)
            timed += [("permute+unpermute", "fwd", pair, fwd_bytes, pair_no_grad if name == "triton" else None, extra),
                      ("permute+unpermute", "bwd", back, bwd_bytes, None, extra)]  # autograd.grad: not captured
        if name == "triton" or name in PERMUTE_VARIANTS:  # the sort alone; ids read, sorted_idx and offsets written
            counting = PERMUTE_VARIANTS.get(name, {}).get("counting", True)
            # also with a phantom group (capacity dropping, expert parallelism): E + 1 groups
            for op, groups in (("expert sort", E), ("expert sort E+1", E + 1)):
                sort = (lambda g: lambda: expert_sort(ids, g, counting=counting))(groups)
                runs = "counting" if counting and counting_sort_applies(ids, groups) else "torch"
                timed.append((op, "fwd", sort, 2 * ids.numel() * 8 + groups * 4, sort, {"kernels": {"sort": runs}}))
        for op, pass_, fn, nbytes, capture, extra in timed:
            ms = timer(fn)
            device_ms = timer.graphed(capture) if capture is not None else None
            rec(op=op, pass_=pass_, backend=name, tokens=T, routing=routing, ms=ms,
                gbps=nbytes / ms / 1e6, bytes=nbytes, D=D, top_k=k, **extra,
                **({"device_ms": device_ms, "device_gbps": nbytes / device_ms / 1e6} if device_ms else {}))
    sorted_rows = torch.randn(T * k, D, device=device, dtype=dtype, generator=gen)
    nbytes = 2 * sorted_rows.numel() * b
    ms = timer(sorted_rows.clone)
    device_ms = timer.graphed(sorted_rows.clone)
    rec(op="copy", pass_="fwd", backend="clone", tokens=T, routing=routing, ms=ms,
        gbps=nbytes / ms / 1e6, bytes=nbytes, D=D, top_k=k,
        **({"device_ms": device_ms, "device_gbps": nbytes / device_ms / 1e6} if device_ms else {}))


def write_store(store_path: str, run_id: str, records: list[dict], summary: dict) -> bool:
    """One table per series (op, pass, backend, routing), step = tokens. Skipped silently where
    the results store cannot be imported (e.g. zarr missing on a GPU box)."""
    try:
        from optimus_core.store import open_store
    except ImportError:
        return False
    attrs = {k: v for k, v in summary.items() if k != "results"}
    with open_store(store_path).run_writer(run_id, attrs={**attrs, "experiment": "bench-kernels"}) as w:
        for r in sorted((r for r in records if "error" not in r and "config" not in r), key=lambda r: r["tokens"]):
            table = "_".join((r["op"].replace("+", "_"), r["pass"], r["backend"], r["routing"]))
            rate = {"tflops": r["tflops"]} if "tflops" in r else {"gbps": r["gbps"]}
            w.log(table, {"step": r["tokens"], "ms": r["ms"], **rate})
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.quick)
    interpreted = device.type == "cpu"
    shape, dtype = (TINY, torch.float32) if interpreted else (OLMOE, torch.bfloat16)
    tokens = [64] if interpreted else [2048] if args.quick else [int(t) for t in args.tokens.split(",")]
    routings = ["balanced"] if args.quick else ["balanced", "zipf"]
    reps = 1 if interpreted else 10 if args.quick else args.reps
    sampler, started = GpuSampler.start(device), time.time()
    timer = Timer(device, reps=reps, warmup=1 if interpreted else 5, sampler=sampler)
    backends = available_backends()
    gemm_rows = [*backends, *(["torch_raw"] if "torch" in backends else []),
                 *(TRITON_VARIANTS if "triton" in backends else []), "dense",
                 *(["triton-dense"] if "triton" in backends else [])]
    permute_rows = [b for b in backends if b != "torch"]  # "torch" is the reference, like "loop"
    permute_rows += list(PERMUTE_VARIANTS) if "triton" in backends else []
    if args.backends:
        wanted = args.backends.split(",")
        unknown = sorted(set(wanted) - {"loop", "torch", "torch_raw", "triton", *DENSE_ROWS, *TRITON_VARIANTS,
                                        *PERMUTE_VARIANTS})
        if unknown:
            sys.exit(f"--backends: unknown {unknown}; rows that run here: {gemm_rows}")
        gemm_rows = [b for b in gemm_rows if b in wanted]
        permute_rows = [b for b in permute_rows if b in wanted]
    ops = args.only.split(",")
    if set(ops) - set(OPS):
        sys.exit(f"--only: unknown ops {sorted(set(ops) - set(OPS))}; choose among {OPS}")
    name = device_name(device)
    records = []

    def rec(pass_, **fields):
        line = {"bench": "kernels", "device": name, "pass": pass_, **fields,
                **(timer.telemetry if "ms" in fields else {})}
        records.append(line)
        if "error" in line:
            print(f"{line['op']:>18} {line['backend']:>19} {line['tokens']:>6} {line['routing']:>8} "
                  f"FAILED: {line['error'][:300]}", flush=True)
            return
        rate = f"{line['tflops']:8.1f} TFLOP/s" if "tflops" in line else f"{line['gbps']:8.1f} GB/s   "
        note = f"  (fell back: {line['fallback']})" if line.get("fallback") else ""
        if line.get("config"):
            note += "  " + " ".join(f"{k}={v}" for k, v in line["config"].items())
        if line.get("out_dtype"):
            note += f"  out {line['out_dtype']}"
        note += clock_note(line)
        if line.get("device_ms"):
            note += f"  device (CUDA graph) {line['device_ms']:.3f} ms {line['device_gbps']:.1f} GB/s"
        print(f"{line['op']:>18} {pass_:>6} {line['backend']:>17} {line['tokens']:>6} "
              f"{line['routing']:>8} {line['ms']:9.3f} ms {rate}{note}", flush=True)

    print(f"{'op':>18} {'pass':>6} {'backend':>17} {'tokens':>6} {'routing':>8} {'median':>12} {'rate':>14}")
    gen = torch.Generator().manual_seed(0)
    for T in tokens:
        for routing in routings:
            topk_idx = route(T, shape["experts"], shape["top_k"], routing, gen).to(device)
            bench_gemms(rec, timer, device, dtype, T, routing, topk_idx, shape, gemm_rows, ops)
            if args.tma_configs and device.type == "cuda":
                bench_tma_configs(rec, timer, device, dtype, T, routing, topk_idx, shape)
            if args.ws and device.type == "cuda":
                bench_ws(rec, timer, device, dtype, T, routing, topk_idx, shape)
            if args.dw_configs and device.type == "cuda":
                bench_dw_configs(rec, timer, device, dtype, T, routing, topk_idx, shape)
            if "permute" in ops:
                bench_permute(rec, timer, device, dtype, T, routing, topk_idx, shape, permute_rows)

    def ratio(r, other):
        """r's rate over the ``other`` row of its op, pass, tokens and routing, timed in the same
        turns (the --ws rows time their own baselines: turns="ws")."""
        base = [o for o in records if all(o.get(f) == r.get(f) for f in ("op", "pass", "tokens", "routing", "turns"))
                and o["backend"] == other and "tflops" in o]
        return r["tflops"] / base[0]["tflops"] if base else None

    summary = {
        "bench": "kernels_summary", "device": name, "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", None), "dtype": str(dtype),
        "shape": shape, "backends": gemm_rows, "reps": reps, "quick": args.quick,
        "triton_variants": {k: v[0] for k, v in TRITON_VARIANTS.items()},
        "tma_configs_chosen": tma_configs_chosen(device, dtype),
        "flops_formula": "fwd 2*M*K*N, bwd 4*M*K*N (dx and dw), M = tokens*top_k; "
                         "tflops = flop / median time",
        "bytes_formula": "minimal traffic: each input read once, each output written once",
        "triton_over_torch": {f"{r['op']}/{r['pass']}/{r['tokens']}/{r['routing']}": ratio(r, "torch")
                              for r in records if r["backend"] == "triton" and "tflops" in r},
        **{f"triton_over_{other}": {f"{r['op']}/{r['pass']}/{r['tokens']}/{r['routing']}": ratio(r, other)
                                    for r in records if r["backend"] == "triton" and "tflops" in r}
           for other in ("torch_raw", "dense")},
        # our code generation without grouping against cuBLAS: the ceiling the kernels can reach
        "triton_dense_over_dense": {f"{r['op']}/{r['pass']}/{r['tokens']}/{r['routing']}": ratio(r, "dense")
                                    for r in records if r["backend"] == "triton-dense" and "tflops" in r},
        # the A/B: each variant beside the default kernels and beside the bare torch._grouped_mm
        **{f"variants_over_{other}": {f"{r['backend']}/{r['op']}/{r['pass']}/{r['tokens']}/{r['routing']}":
                                      ratio(r, other) for r in records
                                      if r["backend"] in TRITON_VARIANTS and "tflops" in r}
           for other in ("triton", "torch_raw")},
        # the warp-specialized kernel's configs over the TMA kernel and torch._grouped_mm (--ws)
        **{f"ws_over_{other}": {
            f"{','.join(map(str, r['config'].values()))}/{r['op']}/{r['pass']}/{r['tokens']}/{r['routing']}":
            ratio(r, other) for r in records if r["backend"] == "triton-ws" and "tflops" in r}
           for other in ("triton-tma", "torch_raw")},
        # the permute A/B: time with torch.sort over time with the default (counting) sort
        "permute_variants": PERMUTE_VARIANTS,
        "triton_sort_torch_ms_over_triton": {
            f"{r['op']}/{r['pass']}/{r['tokens']}/{r['routing']}": r["ms"] / base[0]["ms"]
            for r in records if r["backend"] == "triton-sort-torch"
            for base in [[o for o in records if o["backend"] == "triton" and "gbps" in o
                          and all(o[f] == r[f] for f in ("op", "pass", "tokens", "routing"))]] if base},
    }
    if sampler:  # the whole run's readings beside each row's
        summary["gpu_run"] = sampler.window(started, time.time())
        sampler.stop()
    path = Path(args.out) / f"kernels-{name}.jsonl"
    write_jsonl(path, records + [summary])
    print(f"wrote {path}")
    if args.store and write_store(args.store, f"bench-kernels-{name}", records, summary):
        print(f"wrote run bench-kernels-{name} to {args.store}")


if __name__ == "__main__":
    main()
