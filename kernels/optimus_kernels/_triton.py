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


def autotuned(configs_for, key, **options):
    """Decorate a jitted kernel so that `kernel(*variant)` is its autotuner over the configs
    `configs_for(*variant)`, e.g. variant = (device type,): CUDA and Intel XPU want different
    config lists. One autotuner per variant, each caching its choice per `key`; options go to
    triton.autotune (e.g. reset_to_zero for a buffer that each timed launch consumes)."""

    def wrap(kernel):
        @functools.cache
        def for_variant(*variant):
            return triton.autotune(configs=configs_for(*variant), key=key, **options)(kernel)

        return for_variant

    return wrap


def tile_configs(shapes, **options):
    """GEMM configs from (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tuples; options (e.g. Intel's
    grf_mode) go to every config."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, **options}, num_warps=w, num_stages=s)
            for m, n, k, w, s in shapes]


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
