"""The experts' computation: the one seam where kernels enter the model (house rule 6).

Tokens arrive expert-sorted (``permute``), every expert applies its SwiGLU MLP to its own
contiguous rows (``grouped_mm`` -> ``swiglu`` -> ``grouped_mm``), and the outputs go back to
token order with the top-k combine (``unpermute``). The backend is chosen by name:

    loop    plain torch, a Python loop over experts: the reference, runs anywhere
    torch   torch._grouped_mm (recent CUDA GPUs), through kernels/
    triton  our Triton kernels, through kernels/

Weights are stored in the layout the grouped GEMM consumes (x @ w): w_up_EDF2 holds
[gate | up] along its last axis, w_down_EFD maps back to d_model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def permute_reference(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, n_groups: int):
    """Expert-sorted copy of the tokens: (x_sorted (T*K, D), offsets int32 (n_groups,), sorted_idx)."""
    K = topk_idx_TK.shape[1]
    flat_idx = topk_idx_TK.flatten()
    sorted_idx = torch.argsort(flat_idx, stable=True)
    offsets = torch.cumsum(torch.bincount(flat_idx, minlength=n_groups), 0).to(torch.int32)
    return x_TD[sorted_idx // K], offsets, sorted_idx


def unpermute_reference(y_sorted_MD: torch.Tensor, sorted_idx: torch.Tensor, topk_weight_TK: torch.Tensor):
    """out[t] = sum_k weight[t, k] * y[row of assignment (t, k)] (the top-k combine)."""
    T, K = topk_weight_TK.shape
    y_flat = y_sorted_MD[torch.argsort(sorted_idx)]  # back to assignment order t*K + k
    weight = topk_weight_TK.to(y_flat.dtype).unsqueeze(-1)
    return (y_flat.view(T, K, -1) * weight).sum(1)


def expert_mlp_loop(x_MD: torch.Tensor, offsets: torch.Tensor, w_up_EDF2: torch.Tensor,
                    w_down_EFD: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul pair per expert; rows past offsets[-1] (dropped tokens) give zeros.

    unbind + cat, not per-expert indexing and slice assignment: autograd then builds each
    weight gradient once (one stack) instead of a zero-filled full-size tensor per expert.
    """
    ends = offsets.tolist()  # host sync: fine for the reference, the kernels avoid it
    outs = []
    for x_e, w_up, w_down, end in zip(x_MD[: ends[-1]].split(_sizes(ends)), w_up_EDF2.unbind(0),
                                      w_down_EFD.unbind(0), ends):
        gate, up = (x_e @ w_up).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w_down)
    outs.append(x_MD.new_zeros(x_MD.shape[0] - ends[-1], w_down_EFD.shape[-1]))
    return torch.cat(outs)


def _sizes(ends: list[int]) -> list[int]:
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


class Experts(nn.Module):
    def __init__(self, n_experts: int, d_model: int, d_expert: int, backend: str = "loop"):
        super().__init__()
        self.n_experts, self.backend = n_experts, backend
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    def permute(self, x_TD, topk_idx_TK, n_groups):
        if self.backend == "loop":
            return permute_reference(x_TD, topk_idx_TK, n_groups)
        import kernels
        return kernels.permute(x_TD, topk_idx_TK, n_groups, backend=self.backend)

    def unpermute(self, y_MD, sorted_idx, topk_weight_TK):
        if self.backend == "loop":
            return unpermute_reference(y_MD, sorted_idx, topk_weight_TK)
        import kernels
        return kernels.unpermute(y_MD, sorted_idx, topk_weight_TK, backend=self.backend)

    def forward(self, x_MD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """x_MD expert-sorted rows, offsets_E int32 cumulative group ends (one per expert)."""
        w_up, w_down = self.w_up, self.w_down
        if torch.is_autocast_enabled(x_MD.device.type):
            dtype = torch.get_autocast_dtype(x_MD.device.type)
            x_MD, w_up, w_down = x_MD.to(dtype), w_up.to(dtype), w_down.to(dtype)
        if self.backend == "loop":
            return expert_mlp_loop(x_MD, offsets_E, w_up, w_down)
        import kernels
        h_MF2 = kernels.grouped_mm(x_MD, w_up, offsets_E, backend=self.backend)
        return kernels.grouped_mm(kernels.swiglu(h_MF2, backend=self.backend), w_down, offsets_E,
                                  backend=self.backend)
