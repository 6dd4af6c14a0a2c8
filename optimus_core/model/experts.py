"""The experts' computation: the one seam where kernels enter the model (house rule 6).

Tokens arrive expert-sorted (``permute``), every expert applies its SwiGLU MLP to its own
contiguous rows (``grouped_mm`` -> ``swiglu`` -> ``grouped_mm``), and the outputs go back to
token order with the top-k combine (``unpermute``). All four ops come from kernels/, with the
backend chosen by name:

    loop    plain torch, a Python loop over experts: the reference, runs anywhere
    torch   torch._grouped_mm (bf16 on sm90+ CUDA GPUs)
    triton  our Triton kernels (CUDA, XPU, or the CPU under TRITON_INTERPRET=1)

Weights are stored in the layout the grouped GEMM consumes (x @ w): w_up_EDF2 holds
[gate | up] along its last axis, w_down_EFD maps back to d_model.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels


class Experts(nn.Module):
    # Under autocast: cast the float32 weights inside each grouped GEMM instead of once per
    # forward (train.recast_expert_weights): less memory, a little more time.
    recast_weights: bool = False

    def __init__(self, n_experts: int, d_model: int, d_expert: int, backend: str = "loop"):
        super().__init__()
        self.n_experts, self.backend = n_experts, backend
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    def permute(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, n_groups: int, n_rows: int | None = None):
        """(x_sorted_MD, offsets (n_groups,) int32, sorted_idx (T * K,)); M = n_rows or T * K."""
        return kernels.permute(x_TD, topk_idx_TK, n_groups, backend=self.backend, n_rows=n_rows)

    def unpermute(self, y_MD: torch.Tensor, sorted_idx: torch.Tensor, topk_weight_TK: torch.Tensor):
        return kernels.unpermute(y_MD, sorted_idx, topk_weight_TK, backend=self.backend)

    def apply_routed(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                     n_groups: int) -> torch.Tensor:
        """Each token through its top-k experts, the outputs summed with its routing weights:
        permute, the experts, unpermute. Assignments to group ``n_experts`` (dropped over
        capacity) get no expert and must carry weight 0. Expert parallelism replaces this one
        method (optimus_core.parallel.expert_parallel): the seam where tokens may leave the rank."""
        x_sorted_MD, offsets, sorted_idx = self.permute(x_TD, topk_idx_TK, n_groups)
        y_sorted_MD = self(x_sorted_MD, offsets[:self.n_experts])
        return self.unpermute(y_sorted_MD, sorted_idx, topk_weight_TK)

    def forward(self, x_MD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """x_MD expert-sorted rows, offsets_E int32 cumulative group ends (one per expert);
        rows past offsets_E[-1] (tokens dropped over capacity) come out zero."""
        w_up, w_down = self.w_up, self.w_down
        keep_cast = False
        if torch.is_autocast_enabled(x_MD.device.type):  # the kernels compute in one dtype
            dtype = torch.get_autocast_dtype(x_MD.device.type)
            x_MD = x_MD.to(dtype)
            if self.backend == "triton":
                # The float32 weights go in as they are: the op casts them, and writes their
                # gradient in float32 itself (no cast pass over it); it keeps its cast copy for
                # the backward, or with recast_weights casts again there (6 GiB less for 8
                # OLMoE layers, one more pass) (kernels/grouped_mm.py).
                keep_cast = not self.recast_weights
            elif not self.recast_weights:  # cast once here; autograd keeps the copies for backward
                w_up, w_down = w_up.to(dtype), w_down.to(dtype)
        h_MF2 = kernels.grouped_mm(x_MD, w_up, offsets_E, backend=self.backend, keep_cast=keep_cast)
        h_MF = kernels.swiglu(h_MF2, backend=self.backend)
        return kernels.grouped_mm(h_MF, w_down, offsets_E, backend=self.backend, keep_cast=keep_cast)
