"""Each Triton kernel checks itself on a device before a run trusts it.

    from optimus_kernels.selfcheck import validated
    if not validated("experts", device):      # the first call on a device: ~a second of small launches
        backend = "loop"                        # it failed to compile or to match: one warning said so

The kernels are tested on the machines we have (CPU interpreter, H200). Aurora's PVC tiles run
them through Intel's Triton backend, which no machine here can reach: a kernel that does not
compile there, or compiles and computes something else, must not train a paper run. So the
first use of each kernel family on a device runs it on small odd shapes (an empty expert, rows
that are not a tile multiple) in bf16 against its plain-torch reference, forward and backward,
and caches the verdict per device name in this process. A failure warns once, naming
the kernel and the error, and the caller takes the reference path instead.

Families: ``experts`` (grouped_mm forward, dx and dW, by the grouped GEMM kernel family that
grouped_mm.family_on names for the device, e.g. the descriptor kernels on an Intel XPU;
permute / unpermute; swiglu; the expert MLP with its SwiGLU in the GEMMs' epilogues), ``adamw``
(the fused step and the squared norm), ``cross_entropy`` (the fused softmax cross-entropy),
``qk_norm_rope`` (the attention's QK-norm and RoPE, forward and both gradients).
Under TRITON_INTERPRET=1 (the tests' harness, on the CPU) nothing is checked: ``validated`` is
True wherever the interpreter can launch, and ``check`` runs a family's check on demand.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from ._triton import INTERPRET, launchable_on

_VERDICTS: dict[tuple[str, str], str | None] = {}  # (kernel, device name) -> why it failed


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Max error relative to the reference's largest magnitude, within ``tol``."""
    got, want = got.float(), want.float()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-6)
    if not (got.shape == want.shape and err <= tol * scale):
        raise AssertionError(f"{name}: max error {err:.3g} vs scale {scale:.3g} (tolerance {tol:g}), "
                             f"shapes {tuple(got.shape)} / {tuple(want.shape)}")


def _dtypes() -> tuple[torch.dtype, ...]:
    """bf16, what the runs train in (float32 Triton paths are for tests); the interpreter
    computes float32 only."""
    return (torch.float32,) if INTERPRET else (torch.bfloat16,)


def _tolerance(dtype: torch.dtype) -> float:
    return 3e-2 if dtype == torch.bfloat16 else 2e-3  # float32 dots may run in tf32


def _check_experts(device: torch.device) -> None:
    """The experts' kernels with the grouped GEMM family family_on names for ``device`` allowed,
    whatever ceiling a plan set before (its shapes pass that family's rules)."""
    from .grouped_mm import ceiling_at_least, family_on

    with ceiling_at_least(family_on(device)[0]):
        _check_experts_kernels(device)


def _check_experts_kernels(device: torch.device) -> None:
    from .expert_mlp import expert_mlp
    from .grouped_mm import grouped_mm, grouped_mm_reference
    from .permute import permute, permute_reference, unpermute, unpermute_reference
    from .swiglu import swiglu, swiglu_reference

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in _dtypes():
        tol = _tolerance(dtype)
        # Odd row counts, and expert 2 gets no token; K and N multiples of 16 as the models' are,
        # so the kernels compiled here are the ones a run's autotuning then finds compiled (and
        # 16-byte bf16 rows, so that the tma and descriptor families take them), and K a multiple
        # of 64, so that on Hopper the forward takes the warp-specialized kernel, as a run's does
        # (hopper.grouped_mm_ws.ws_unsupported).
        T, k, E, K, N = 19, 2, 4, 64, 48
        idx = torch.tensor([[0, 1], [3, 0], [1, 3]] * 6 + [[0, 3]], dtype=torch.long)[:T].to(device)
        x = torch.randn(T, K, generator=g).to(device, dtype)
        xs, offsets, sorted_idx = permute(x, idx, E, backend="triton")
        xs_r, offsets_r, sorted_r = permute_reference(x, idx, E)
        _close("permute rows", xs, xs_r, 0.0)
        if not torch.equal(offsets.long(), offsets_r.long()):
            raise AssertionError(f"permute offsets: {offsets.tolist()} != {offsets_r.tolist()}")
        w = (torch.randn(E, K, N, generator=g) / K ** 0.5).to(device, dtype)
        dy = torch.randn(xs.shape[0], N, generator=g).to(device, dtype)

        def run(mm):
            xa, wa = xs.detach().clone().requires_grad_(), w.clone().requires_grad_()
            y = mm(xa, wa)
            y.backward(dy)
            return y.detach(), xa.grad, wa.grad

        got = run(lambda a, b: grouped_mm(a, b, offsets, backend="triton"))
        want = run(lambda a, b: grouped_mm_reference(a.float(), b.float(), offsets).to(dtype))
        for name, a, b in zip(("forward", "dx", "dw"), got, want):
            _close(f"grouped_mm {name} ({dtype})", a, b, tol)
        h = torch.randn(xs.shape[0], 2 * 16, generator=g).to(device, dtype)
        row_w = torch.rand(xs.shape[0], generator=g).to(device)
        ha, hb = h.clone().requires_grad_(), h.clone().requires_grad_()
        out, ref = swiglu(ha, row_weight=row_w, backend="triton"), swiglu_reference(hb.float(), row_w).to(dtype)
        _close(f"swiglu ({dtype})", out, ref, tol)
        out.float().sum().backward(), ref.float().sum().backward()
        _close(f"swiglu backward ({dtype})", ha.grad, hb.grad, tol)
        topk_w = torch.rand(T, k, generator=g).to(device)
        _close(f"unpermute ({dtype})", unpermute(xs, sorted_idx, topk_w, backend="triton"),
               unpermute_reference(xs_r, sorted_r, topk_w), tol)
        # The MLP as a run calls it: H in whole 128-column tiles, so that on Hopper the SwiGLU
        # runs in both GEMMs' epilogues (kernels/optimus_kernels/expert_mlp.py).
        H = 128
        w_up = (torch.randn(E, K, 2 * H, generator=g) / K ** 0.5).to(device, dtype)
        w_down = (torch.randn(E, H, N, generator=g) / H ** 0.5).to(device, dtype)

        def run_mlp(backend, cast):
            leaves = [t.detach().to(cast).requires_grad_() for t in (xs, w_up, w_down, row_w)]
            y = expert_mlp(*leaves[:3], offsets, row_weight=leaves[3], backend=backend)
            y.backward(dy.to(cast))
            return (y.detach(), *(t.grad for t in leaves))

        for name, a, b in zip(("forward", "dx", "dw_up", "dw_down", "d row_weight"),
                              run_mlp("triton", dtype), run_mlp("loop", torch.float32)):
            _close(f"expert_mlp {name} ({dtype})", a, b, tol)


def _check_adamw(device: torch.device) -> None:
    from .adamw import adamw_step_, adamw_step_reference_, squared_norm, squared_norm_reference

    g = torch.Generator().manual_seed(0)
    n = 3001
    state = [torch.randn(n, generator=g).to(device) for _ in range(2)] + [torch.rand(n, generator=g).to(device)]
    grad = torch.randn(n, generator=g).to(device)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    a, b = [t.clone() for t in state], [t.clone() for t in state]
    adamw_step_(a[0], grad, a[1], a[2], **hyper)
    adamw_step_reference_(b[0], grad, b[1], b[2], **hyper)
    for name, x, y in zip(("param", "exp_avg", "exp_avg_sq"), a, b):
        _close(f"adamw {name}", x, y, 1e-5)
    _close("squared_norm", squared_norm(grad), squared_norm_reference(grad), 1e-5)


def _check_cross_entropy(device: torch.device) -> None:
    from .cross_entropy import softmax_cross_entropy_, softmax_cross_entropy_reference_

    g = torch.Generator().manual_seed(0)
    C, V = 13, 1000
    for dtype in _dtypes():
        logits = (torch.randn(C, V, generator=g) * 3).to(device, dtype)
        targets = torch.randint(0, V, (C,), generator=g).to(device)
        valid = (torch.arange(C) % 5 != 0).to(device)
        a, b = logits.clone(), logits.clone()
        loss_a = softmax_cross_entropy_(a, targets, valid)
        loss_b = softmax_cross_entropy_reference_(b, targets, valid)
        _close(f"cross_entropy loss ({dtype})", loss_a, loss_b, _tolerance(dtype))
        _close(f"cross_entropy gradient ({dtype})", a, b, _tolerance(dtype))


def _check_qk_norm_rope(device: torch.device) -> None:
    from .qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    g = torch.Generator().manual_seed(0)
    # 3 heads of 6 (a tile of 4 x 4 half-heads, masked), 5 positions of a 7-row table, 11 rows
    B, S, H, Dh = 2, 5, 3, 6
    angles = torch.rand(7, Dh // 2, generator=g) * 6
    cos, sin = torch.cat((angles, angles), -1).cos().to(device), torch.cat((angles, angles), -1).sin().to(device)
    for dtype in _dtypes():
        x = (torch.randn(B, S, H * Dh, generator=g) * 3).to(device, dtype)
        w = (torch.rand(H * Dh, generator=g) + 0.5).to(device)
        dy = torch.randn(B, S, H * Dh, generator=g).to(device, dtype)
        got, want = [], []
        for fn, out in ((qk_norm_rope, got), (qk_norm_rope_reference, want)):
            xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(xa if fn is qk_norm_rope else xa.float(), wa, cos, sin, eps=1e-5)
            y.backward(dy.to(y.dtype))
            out.extend((y.detach(), xa.grad, wa.grad))
        for name, a, b in zip(("forward", "dx", "dweight"), got, want):
            _close(f"qk_norm_rope {name} ({dtype})", a, b, _tolerance(dtype))


CHECKS: dict[str, Callable[[torch.device], None]] = {
    "experts": _check_experts, "adamw": _check_adamw, "cross_entropy": _check_cross_entropy,
    "qk_norm_rope": _check_qk_norm_rope,
}


def check(kernel: str, device: torch.device | str) -> str | None:
    """Run ``kernel``'s self-check on ``device`` now: None if it passed, else why not."""
    if kernel not in CHECKS:
        raise ValueError(f"kernel = {kernel!r}: unknown; known: {', '.join(CHECKS)}")
    device = torch.device(device)
    try:
        from ._triton import device_guard

        with device_guard(torch.empty(0, device=device)):
            CHECKS[kernel](device)
    except Exception as e:  # a compile error, an unsupported op, a wrong result: all the same verdict
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def failure(kernel: str, device: torch.device | str) -> str | None:
    """Why ``kernel``'s Triton path may not be used on ``device``, or None if it may (module doc):
    checked on the first call per device name, then cached; a failure warns once."""
    device = torch.device(device)
    if INTERPRET or device.type == "cpu" or not launchable_on(device):
        # the interpreter is the tests' harness: not checked
        return None if launchable_on(device) else f"Triton cannot launch on {device.type}"
    module = getattr(torch, device.type)
    key = (kernel, f"{device.type}:{module.get_device_name(device.index or 0)}")
    if key not in _VERDICTS:
        why = check(kernel, device)
        _VERDICTS[key] = why
        if why is not None:
            warnings.warn(f"kernels: the Triton {kernel} kernels failed their self-check on {key[1]} ({why}); "
                          f"the run takes the next choice for them", RuntimeWarning, stacklevel=2)
    return _VERDICTS[key]


def validated(kernel: str, device: torch.device | str) -> bool:
    """Whether ``kernel``'s Triton path may be used on ``device`` (``failure`` is None)."""
    return failure(kernel, device) is None
