"""Optimus kernels: the experts' compute of an MoE layer, behind one seam (the experts' kernels enter the
model only through the grouped matmul, permute / unpermute and the fused SwiGLU).

    from optimus_kernels import grouped_mm, permute, unpermute, swiglu, available_backends

    permute(x_TD, topk_idx_Tk, E)              -> x_sorted_RD, offsets_E (int32), sorted_idx_R (int64)
    grouped_mm(x_MK, w_GKN, offsets_G)         -> y_MN
    swiglu(h_M2H, row_weight=None)             -> out_MH   (row_weight (M,): each row scaled)
    expert_mlp(x_MD, w_up_GD2H, w_down_GHN, offsets_G, row_weight=None) -> y_MN
                                               (grouped_mm, swiglu, grouped_mm: the SwiGLU fused)
    unpermute(y_sorted_RD, sorted_idx_R, w_Tk) -> out_TD   (w_Tk None, top_k=k: a plain sum)

Every op takes backend="loop" | "torch" | "triton" (default "triton") and has a plain-torch
reference (`*_reference`) in its module; shapes, dtypes and semantics are in each module's
docstring. Suffix legend: T tokens, k top-k, R = T*k rows sorted by expert, D model features,
E = G experts (groups), M rows, K in-features, N out-features, H hidden features.
The triton ops are registered as torch custom ops (namespace `optimus`) so that torch.compile
traces a layer using them. Beside the experts' ops, for the optimizer and the LM loss (Triton
only, each with a plain-torch ``*_reference_``): ``adamw_step_`` (optimus_kernels.adamw) and
``softmax_cross_entropy_`` (optimus_kernels.cross_entropy: a chunk's logits become their gradient); for
the attention (Triton only, reference ``qk_norm_rope_reference``): ``qk_norm_rope``
(optimus_kernels.qk_norm_rope: QK-norm and RoPE in one pass).

The portable Triton kernels are the modules here; kernels/optimus_kernels/hopper/ holds the NVIDIA sm90+ variants of
the grouped GEMM (the TMA kernels, which Intel XPU runs too with its own configs, and the warp-specialized
Gluon kernel for Hopper). Which one runs
is the execution plan's choice (optimus_kernels.grouped_mm.family_on / use_family; `optimus execution` prints it).
This package imports only torch and (optionally) triton.
"""

from __future__ import annotations

import torch

from ._triton import INTERPRET, triton
from .adamw import adamw_step_, adamw_step_reference_, squared_norm, squared_norm_reference
from .cross_entropy import softmax_cross_entropy_, softmax_cross_entropy_reference_
from .grouped_mm import grouped_mm, grouped_mm_reference, torch_grouped_mm_unsupported
from .expert_mlp import expert_mlp
from .permute import permute, permute_reference, unpermute, unpermute_reference
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from .swiglu import swiglu, swiglu_reference

__all__ = [
    "adamw_step_", "adamw_step_reference_", "squared_norm", "squared_norm_reference",
    "available_backends", "expert_mlp", "grouped_mm", "grouped_mm_reference", "permute", "permute_reference",
    "qk_norm_rope", "qk_norm_rope_reference", "softmax_cross_entropy_", "softmax_cross_entropy_reference_",
    "swiglu", "swiglu_reference",
    "torch_grouped_mm_unsupported", "unpermute", "unpermute_reference",
]


def available_backends() -> list[str]:
    """The backends that run here on this machine's default device (an accelerator when there
    is one): "loop" always; "torch" with torch._grouped_mm's fast path (bf16, CUDA sm90+);
    "triton" with Triton and a CUDA/XPU device, or on the CPU under TRITON_INTERPRET=1."""
    backends = ["loop"]
    if torch.cuda.is_available():
        probe = torch.empty(1, 8, dtype=torch.bfloat16, device="cuda")
        if torch_grouped_mm_unsupported(probe, probe.new_empty(1, 8, 8)) is None:
            backends.append("torch")
    has_xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    if triton is not None and (torch.cuda.is_available() or has_xpu or INTERPRET):
        backends.append("triton")
    return backends
