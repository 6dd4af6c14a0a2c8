"""What every Triton launcher here shares: the optional import, interpreter detection,
per-device autotuning, and the checks that turn Triton's launch errors into clear ones.

Triton is optional (it ships for Linux only): without it the package still imports and the
`loop` / `torch` backends work; the `triton` backend raises saying why.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # e.g. macOS laptops
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # kernel signatures still parse; never launched

# Triton reads TRITON_INTERPRET when a kernel is decorated (at import), so this is fixed per
# process. The interpreter runs kernels on the CPU with numpy: float32 only, and slowly, so it
# gets one small config instead of an autotuning sweep.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def jit(fn=None, **options):
    """triton.jit, or the bare function when Triton is missing (then it is never launched).
    Options go to triton.jit: `@jit(do_not_specialize=["DX"])` for an int argument that is only
    an autotune key, so that its values do not compile separate copies of the kernel."""
    if fn is None:
        return lambda fn: jit(fn, **options)
    return triton.jit(fn, **options) if triton is not None else fn


# The grf_mode values (registers per hardware thread) that Intel's Triton compiles, each a string:
# what intel-xpu-backend-for-triton v3.6.0 (225cdbde3ea155d5ed4c0aad1f2aa4bd2b3c4a3d) accepts in
# XPUBackend.make_spv, third_party/intel/backend/compiler.py. That is the pytorch-triton-xpu
# 3.6.0+git225cdbde of torch 2.10 and of ALCF Aurora's frameworks/2025.3.1 module
# (argonne-lcf/user-guides 7d04a3f9, docs/aurora/system-updates.md). Any other value raises
# "Unknown grf_mode" there (since a9362d254498cd069a9a037ede3d3cfe5ee5022a, which renamed 'small'
# / 'large' to '128' / '256'); '256' also raises with num_warps > 32. '512' came in v3.7.2.
XPU_GRF_MODES = ("128", "256", "auto", "default")
XPU_LARGE_GRF = "256"  # the big-tile configs' mode, as in Intel's PVC GEMM configs (v3.6.0,
# benchmarks/triton_kernels_benchmark/gemm_benchmark.py, get_matmul_autotune_configs)
XPU_LARGE_GRF_MAX_WARPS = 32

# Every function that gives a kernel here its configs per device type, by "module.name":
# configs_for(device_type) or configs_for(device_type, dtype). `autotuned` registers its own;
# config_source registers one that a launcher calls itself. tests/kernels/test_xpu_configs.py
# reads every one for "xpu".
CONFIG_SOURCES: dict = {}


def config_source(configs_for):
    """Register ``configs_for`` in CONFIG_SOURCES (a decorator; returns it unchanged)."""
    CONFIG_SOURCES[f"{configs_for.__module__}.{configs_for.__qualname__}"] = configs_for
    return configs_for


def grf_mode_unsupported(grf_mode, num_warps: int | None = None) -> str | None:
    """Why Intel's Triton (XPU_GRF_MODES) would refuse ``grf_mode`` with ``num_warps``, or None."""
    if grf_mode not in XPU_GRF_MODES:
        return f"grf_mode = {grf_mode!r}: Intel's Triton 3.6 accepts only {', '.join(map(repr, XPU_GRF_MODES))}"
    if grf_mode == XPU_LARGE_GRF and num_warps is not None and num_warps > XPU_LARGE_GRF_MAX_WARPS:
        return f"grf_mode = {grf_mode!r} with num_warps = {num_warps}: at most {XPU_LARGE_GRF_MAX_WARPS} warps"
    return None


def config_grf_unsupported(config) -> str | None:
    """Why Intel's Triton would refuse the grf_mode of ``config`` (a triton.Config, a dict of
    launch options, or a tuple of numbers, which sets none), or None (also where it sets none)."""
    if isinstance(config, dict):
        options, warps = config, config.get("num_warps")
    elif hasattr(config, "kwargs"):
        options, warps = config.kwargs, config.num_warps
    else:
        return None
    return grf_mode_unsupported(options["grf_mode"], warps) if "grf_mode" in options else None


def autotuned(configs_for, key, **options):
    """Decorate a jitted kernel so that `kernel(*variant)` is its autotuner over the configs
    `configs_for(*variant)`, e.g. variant = (device type,): CUDA and Intel XPU want different
    config lists. One autotuner per variant, each caching its choice per `key`; options go to
    triton.autotune (e.g. reset_to_zero for a buffer that each timed launch consumes)."""
    config_source(configs_for)

    def wrap(kernel):
        @functools.cache
        def for_variant(*variant):
            return triton.autotune(configs=configs_for(*variant), key=key, **options)(kernel)

        return for_variant

    return wrap


def tile_configs(shapes, **options):
    """GEMM configs from (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tuples; options (e.g. Intel's
    grf_mode, checked against XPU_GRF_MODES) go to every config."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, **options}, num_warps=w, num_stages=s)
               for m, n, k, w, s in shapes]
    for config in configs:
        problem = config_grf_unsupported(config)
        if problem is not None:
            raise ValueError(f"tile_configs: {problem}")
    return configs


def row_configs(device_type: str):
    """Configs for the memory-bound row kernels (permute, unpermute, swiglu): BLOCK_R rows by
    BLOCK_D columns per program. Wide contiguous column blocks give 16-byte accesses; the row
    count sets how much independent work each program keeps in flight."""
    if INTERPRET:
        return [triton.Config({"BLOCK_R": 4, "BLOCK_D": 32}, num_warps=1)]
    if device_type == "xpu":  # Intel GPUs: 16 or 32 warps of 16-wide SIMD per work-group
        shapes = [(8, 512, 16), (16, 512, 32), (4, 1024, 16)]
    else:
        shapes = [(4, 512, 4), (8, 256, 4), (2, 1024, 4), (8, 512, 8), (16, 256, 8)]
    return [triton.Config({"BLOCK_R": r, "BLOCK_D": d}, num_warps=w) for r, d, w in shapes]


def launchable_on(device: torch.device) -> bool:
    """True where Triton kernels run on ``device``'s tensors: a CUDA or XPU device with Triton,
    or any device under TRITON_INTERPRET=1 (which the CPU tests use)."""
    return triton is not None and (INTERPRET or torch.device(device).type in ("cuda", "xpu"))


def check_launchable(op: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error where the triton backend cannot run `tensors`."""
    if triton is None:
        raise RuntimeError(f"{op}: backend='triton' needs the triton package (Linux); "
                           "use backend='loop' here")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if devices.pop().type == "cpu" and not INTERPRET:
        raise RuntimeError(f"{op}: backend='triton' on CPU tensors runs only in the Triton "
                           "interpreter; set TRITON_INTERPRET=1 before Python starts")


def device_guard(t: torch.Tensor):
    """Make t's device current: Triton launches on the current device, not the tensor's."""
    if t.device.type in ("cuda", "xpu"):
        return getattr(torch, t.device.type).device(t.device)
    return contextlib.nullcontext()


def bucket(n: int) -> int:
    """Autotune key for a row count: its power-of-two ceiling, so that a changing token count
    retunes at most once per doubling."""
    return triton.next_power_of_2(max(n, 1))


def ptxas_report(compiled) -> str:
    """ptxas's verbose report on the PTX of a kernel compiled for sm90 on this machine (the
    ptxas Triton itself uses for sm90), the lines that matter, each without ptxas's prefix: its
    registers and spills, its errors, and its performance warnings, e.g. C7514 (wgmmas
    serialized because other instructions read their accumulator mid-pipeline). The CPU tests
    read it for every config of the Hopper kernels."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx.name, "-o", "/dev/null"],
                             capture_output=True, text=True)
    lines = (run.stdout + run.stderr).splitlines()
    return "\n".join(re.sub(r"^ptxas\S*\s+\w+\s*:\s*", "", line.strip()) for line in lines
                     if any(word in line for word in ("Used", "spill", "C75", "rror", "arning")))
