"""AdamW over flat float32 buffers in one streaming pass, and the squared L2 norm of a buffer.

    adamw_step_(param_N, grad_N, exp_avg_N, exp_avg_sq_N, *, lr, beta1, beta2, eps, weight_decay,
                step, grad_scale=None, param_bf16_N=None)             # Triton, in place
    adamw_step_reference_(...same...)                                 # plain torch, in place
    squared_norm(x_N) -> 0-d float64       squared_norm_reference(x_N) -> 0-d float64

Suffix N: one flat 1-D contiguous buffer (a parameter, or its local share, viewed flat). param and the two
moments are float32, grad float32 or bfloat16 (the experts' gradients kept in bf16,
train.expert_grad_dtype), all of equal length (any length); the update is torch.optim.AdamW's
(decoupled weight decay, maximize=False, amsgrad=False) on float32(grad), per element:

    g  = float32(grad) / grad_scale               (grad_scale: a 0-d float32 device tensor, read
                                                   by the kernel: the clip factor, no host sync)
    p *= 1 - lr * weight_decay
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
    param_bf16 = bf16(p)                          (when given: round to nearest even, as .to())

``step`` is the step number after this update's increment (1 on the first update), a host int:
the bias corrections are computed on the host, so nothing waits on the device. ``grad`` is left
untouched (torch's fused kernel writes the unscaled grad back when it has a grad_scale: 4 more
bytes per element). Traffic: 28 bytes per element (read p, g, m, v; write p, m, v), 30 with the
bf16 copy, which saves the forward its own cast of the weight (read 4, write 2); 2 less with a
bf16 gradient.

The kernel uses nothing CUDA-specific (no inline PTX, no tl.extra.cuda: meant for Intel XPU too,
not yet compiled there), 64-bit offsets (buffers past 2^31 elements), IEEE division and square
root, and an integer round-to-nearest-even for the bf16 copy (the interpreter's float cast
truncates; the integer form is exact everywhere).

Tuning: Triton's autotuner times each config on the real arguments, which for an in-place update
applies it many times (or, with ``restore_value``, clones three buffers of the bucket's size,
14 GB each for the whole 8-layer mula-7b-a1b, on every run). Instead each (device, variant, size
bucket) is timed once on scratch buffers of at most 2^24 elements (470 MB moved per call, well
past any GPU's L2 cache) and the fastest config kept: a streaming kernel's best block does not
change with the length past that. Below 2^16 elements the launch dominates and the first config
is used untimed. The first call per variant on a device pays that tuning (compiles included).
"""

from __future__ import annotations

import functools
import numbers

import torch
from torch import Tensor

from ._triton import INTERPRET, check_launchable, config_source, device_guard, jit, tl, triton

TUNE_MAX = 1 << 24  # elements of the scratch buffers a config is timed on
TUNE_MIN = 1 << 16  # below this, no timing: the first config
GRAD_DTYPES = (torch.float32, torch.bfloat16)  # what adamw_step_ takes as the gradient


# ---------------------------------------------------------------- argument checks
def _check_hyper(lr, beta1, beta2, eps, weight_decay, step) -> None:
    for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                        ("weight_decay", weight_decay)):
        if isinstance(value, Tensor) or not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"adamw_step_: {name} must be a host float, got {type(value).__name__} "
                            "(a tensor would cost a device sync per step)")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"adamw_step_: betas must lie in [0, 1), got beta1={beta1}, beta2={beta2}")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"adamw_step_: lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, "
                         f"weight_decay={weight_decay}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"adamw_step_: step must be a host int >= 1 (the count after this update), "
                         f"got {step!r}")


def _check_buffers(param_N, grad_N, exp_avg_N, exp_avg_sq_N, grad_scale, param_bf16_N) -> None:
    named = {"param_N": param_N, "grad_N": grad_N, "exp_avg_N": exp_avg_N, "exp_avg_sq_N": exp_avg_sq_N}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"adamw_step_: {name} must be a tensor, got {type(t).__name__}")
        dtypes = GRAD_DTYPES if name == "grad_N" else (torch.float32,)
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"adamw_step_: {name} must be a 1-D contiguous {names} "
                             f"tensor, got {t.dtype} of shape {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (strided)'}")
    if param_bf16_N is not None:
        if param_bf16_N.dtype != torch.bfloat16 or param_bf16_N.dim() != 1 or not param_bf16_N.is_contiguous():
            raise ValueError(f"adamw_step_: param_bf16_N must be a 1-D contiguous bfloat16 tensor, got "
                             f"{param_bf16_N.dtype} of shape {tuple(param_bf16_N.shape)}")
        named["param_bf16_N"] = param_bf16_N
    lengths = {name: t.numel() for name, t in named.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"adamw_step_: the buffers must have equal lengths, got {lengths}")
    if grad_scale is not None:
        if not isinstance(grad_scale, Tensor) or grad_scale.dim() != 0 or grad_scale.dtype != torch.float32:
            raise ValueError("adamw_step_: grad_scale must be a 0-d float32 tensor on the buffers' device, got "
                             f"{getattr(grad_scale, 'dtype', type(grad_scale).__name__)} of shape "
                             f"{tuple(getattr(grad_scale, 'shape', ()))}")
        named["grad_scale"] = grad_scale
    devices = {name: str(t.device) for name, t in named.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"adamw_step_: all tensors must be on one device, got {devices}")
    if param_N.data_ptr() == grad_N.data_ptr() and param_N.numel():
        raise ValueError("adamw_step_: param_N and grad_N share memory")


# ---------------------------------------------------------------- reference
@torch.no_grad()
def adamw_step_reference_(param_N: Tensor, grad_N: Tensor, exp_avg_N: Tensor, exp_avg_sq_N: Tensor, *,
                          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                          grad_scale: Tensor | None = None, param_bf16_N: Tensor | None = None) -> None:
    """The update of the module docstring with torch ops, on any device: the arithmetic of
    torch.optim.AdamW's single-tensor path (foreach=False, fused=False), which it equals."""
    _check_hyper(lr, beta1, beta2, eps, weight_decay, step)
    _check_buffers(param_N, grad_N, exp_avg_N, exp_avg_sq_N, grad_scale, param_bf16_N)
    grad = grad_N.float() if grad_scale is None else grad_N.float() / grad_scale
    param_N.mul_(1 - lr * weight_decay)
    exp_avg_N.lerp_(grad, 1 - beta1)
    exp_avg_sq_N.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq_N.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    param_N.addcdiv_(exp_avg_N, denom, value=-lr / (1 - beta1 ** step))
    if param_bf16_N is not None:
        param_bf16_N.copy_(param_N)


def squared_norm_reference(x_N: Tensor) -> Tensor:
    """sum(x^2) as a 0-d float64 tensor: torch's float32 norm, squared in float64 (what the
    optimizers sum over their tensors)."""
    return torch.linalg.vector_norm(x_N).double().square()


# ---------------------------------------------------------------- kernels
@jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, p16_ptr, scale_ptr, start, N,
                  decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                  HAS_SCALE: tl.constexpr, HAS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)  # a bf16 gradient: exactly
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(scale_ptr))
    p = p * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_BF16:
        # round to nearest even on the bits (torch's .to(bfloat16)); NaN stays a NaN
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(p16_ptr + offs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


@jit
def _sq_norm_kernel(x_ptr, partial_ptr, start, N, BLOCK: tl.constexpr):
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(x * x, axis=0))


# ---------------------------------------------------------------- configs and tuning
@config_source
def stream_configs(device_type: str) -> list[tuple[int, int]]:
    """(BLOCK, num_warps) candidates for a flat streaming kernel: 4-32 float32 per thread and
    tensor, i.e. one to eight 16-byte accesses in flight per thread and buffer."""
    if INTERPRET:
        return [(128, 1)]  # several programs and a ragged tail on the tests' lengths
    if device_type == "xpu":  # Intel GPUs: 16 or 32 warps of 16-wide SIMD per work-group
        return [(2048, 16), (4096, 16), (4096, 32), (8192, 32)]
    return [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]


def _tune_size(n: int) -> int:
    """The scratch length a config is timed at: n's power-of-two ceiling, capped at TUNE_MAX
    (0 = too small to time)."""
    return 0 if n < TUNE_MIN or INTERPRET else min(triton.next_power_of_2(n), TUNE_MAX)


@functools.cache
def _best_config(kernel: str, device: str, variant: tuple, size: int) -> tuple[int, int]:
    """The fastest (BLOCK, num_warps) of `kernel` on `device` for buffers of `size` elements,
    timed once on scratch buffers (see the module docstring)."""
    configs = stream_configs(torch.device(device).type)
    if size == 0 or len(configs) == 1:
        return configs[0]
    dev = torch.device(device)
    if kernel == "adamw":
        has_scale, has_bf16, grad_dtype = variant
        bufs = [torch.rand(size, device=dev) for _ in range(4)]
        bufs[1] = bufs[1].to(grad_dtype)
        scale = torch.ones((), device=dev) if has_scale else None
        p16 = torch.empty(size, dtype=torch.bfloat16, device=dev) if has_bf16 else None

        def run(cfg):
            _launch_adamw(*bufs, scale, p16, (0.999, 0.9, 0.1, 0.95, 0.05, 1e-4, 0.5, 1e-8), cfg)
    else:
        x = torch.rand(size, device=dev)

        def run(cfg):
            _launch_sq_norm(x, cfg)
    from triton.testing import do_bench

    with device_guard(bufs[0] if kernel == "adamw" else x):
        times = {cfg: do_bench(lambda cfg=cfg: run(cfg), warmup=10, rep=50) for cfg in configs}
    return min(times, key=times.get)


# ---------------------------------------------------------------- launchers
# Triton vectorizes a masked access (16-byte loads and stores) only where it knows the bound is a
# multiple of 16, which it learns from an int argument's value at launch. So a length off that
# grid runs as two launches: elements [0, n16) with bound n16 = n rounded down to a multiple of
# 16, vectorized, then the < 16 left over from start = n16 (one program, scalar accesses).
def _ranges(n: int, block: int):
    """(start, bound, programs) of each launch over n elements."""
    n16 = n - n % 16
    return [(lo, hi, triton.cdiv(hi - lo, block)) for lo, hi in ((0, n16), (n16, n)) if hi > lo]


def _launch_adamw(param_N, grad_N, exp_avg_N, exp_avg_sq_N, grad_scale, param_bf16_N, scalars, cfg) -> None:
    block, warps = cfg
    for start, bound, programs in _ranges(param_N.numel(), block):
        _adamw_kernel[(programs,)](
            param_N, grad_N, exp_avg_N, exp_avg_sq_N,
            param_N if param_bf16_N is None else param_bf16_N,  # never read without HAS_BF16
            param_N if grad_scale is None else grad_scale, start, bound, *scalars,
            HAS_SCALE=grad_scale is not None, HAS_BF16=param_bf16_N is not None, BLOCK=block, num_warps=warps)


def _launch_sq_norm(x_N: Tensor, cfg) -> Tensor:
    block, warps = cfg
    ranges = _ranges(x_N.numel(), block)
    partial_B = torch.empty(sum(r[2] for r in ranges), dtype=torch.float32, device=x_N.device)
    first = 0
    for start, bound, programs in ranges:
        _sq_norm_kernel[(programs,)](x_N, partial_B[first:], start, bound, BLOCK=block, num_warps=warps)
        first += programs
    return partial_B


@torch.no_grad()
def adamw_step_(param_N: Tensor, grad_N: Tensor, exp_avg_N: Tensor, exp_avg_sq_N: Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                grad_scale: Tensor | None = None, param_bf16_N: Tensor | None = None) -> None:
    """One AdamW update of flat float32 buffers in place, in one Triton kernel (module docstring).
    Raises on mismatched lengths, dtypes, layouts or devices, and where Triton cannot launch
    (then use adamw_step_reference_)."""
    _check_hyper(lr, beta1, beta2, eps, weight_decay, step)
    _check_buffers(param_N, grad_N, exp_avg_N, exp_avg_sq_N, grad_scale, param_bf16_N)
    check_launchable("adamw_step_", param_N)
    n = param_N.numel()
    if n == 0:
        return
    # Host float64 arithmetic, passed to the kernel as float32 scalars.
    scalars = (1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
               lr / (1.0 - beta1 ** step), (1.0 - beta2 ** step) ** 0.5, eps)
    cfg = _best_config("adamw", str(param_N.device), (grad_scale is not None, param_bf16_N is not None,
                                                      grad_N.dtype), _tune_size(n))
    with device_guard(param_N):
        _launch_adamw(param_N, grad_N, exp_avg_N, exp_avg_sq_N, grad_scale, param_bf16_N, scalars, cfg)


def squared_norm(x_N: Tensor) -> Tensor:
    """sum(x^2) of a 1-D contiguous float32 buffer as a 0-d float64 tensor on its device: each
    block's squares summed in float32 by one program, the block sums added in float64."""
    if not isinstance(x_N, Tensor) or x_N.dtype != torch.float32 or x_N.dim() != 1 or not x_N.is_contiguous():
        raise ValueError(f"squared_norm: need a 1-D contiguous float32 tensor, got "
                         f"{getattr(x_N, 'dtype', type(x_N).__name__)} of shape {tuple(getattr(x_N, 'shape', ()))}")
    check_launchable("squared_norm", x_N)
    if x_N.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x_N.device)
    cfg = _best_config("sq_norm", str(x_N.device), (), _tune_size(x_N.numel()))
    with device_guard(x_N):
        return _launch_sq_norm(x_N, cfg).sum(dtype=torch.float64)
