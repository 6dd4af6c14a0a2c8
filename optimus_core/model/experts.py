"""The experts' computation: the one seam where the expert kernels enter the model.

Tokens arrive expert-sorted (``permute``), every expert applies its SwiGLU MLP to its own
contiguous rows (``expert_mlp``: ``grouped_mm`` -> ``swiglu`` -> ``grouped_mm``, the SwiGLU
fused into the GEMMs where it can be), and the outputs go back to token order with the top-k
combine (``unpermute``). All ops come from kernels/, with the backend chosen by name:

    loop    plain torch, a Python loop over experts: the reference, runs anywhere
    torch   torch._grouped_mm (bf16 on sm90+ CUDA GPUs)
    triton  our Triton kernels (CUDA, XPU, or the CPU under TRITON_INTERPRET=1)

Weights are stored as matrices of rows, expert after expert: ``w_up`` is (E * D, 2F), expert
e's rows [e * D, (e + 1) * D) holding [gate | up] along the last axis, ``w_down`` is (E * F, D).
The forward views them as the grouped GEMM's (E, D, 2F) and (E, F, D) (x @ w), which costs
nothing. Rows, not a leading expert axis, so that any share of a parameter a rank holds is a
range of whole rows, however few experts and however many ranks: expert parallelism gives a
rank whole experts, sharding a range of rows within them (optimus_core.parallel.layout), and the
seeded init draws rows (optimus_core.model.init).

Routing weights: each row's routing weight scales its SwiGLU output, before the down
projection, and the combine is a plain sum. The down projection is linear, so the output is the
same as weighting the combine, up to rounding; the backward needs less memory: a weighted
combine must keep the experts' output rows (R x D) to differentiate its weights, the weighted
SwiGLU gets that gradient from what it keeps anyway (kernels/optimus_kernels/swiglu.py). ``combine_sorted`` does
it for this module's ``apply_routed`` and expert parallelism's.

How the experts execute is set from outside, by the execution plan (optimus_core.execution):
``backend``, ``recast_weights`` and ``checkpoint_compute`` below, the bf16 weight copies the
optimizer keeps (non-persistent buffers ``w_up_cast`` / ``w_down_cast``, which the forward reads
when their dtype is autocast's: optimus_core.execution.weight_copies) and ``dw_squares`` (the
clip's sums of squares from the dW kernel: optimus_core.train.optim).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import optimus_kernels


class Experts(nn.Module):
    # How the grouped GEMMs, permute and unpermute compute: "loop" | "torch" | "triton" (kernels/)
    backend: str = "loop"
    # Under autocast: cast the float32 weights inside each grouped GEMM instead of once per
    # forward (execution.recast_expert_weights): less memory, a little more time.
    recast_weights: bool = False
    # The backward recomputes the GEMMs and SwiGLU from the sorted rows instead of keeping their
    # intermediates (execution.activation_checkpointing = "moe"); the dispatch is not repeated.
    checkpoint_compute: bool = False
    EXECUTION = ("backend", "recast_weights", "checkpoint_compute")  # the three above: how they execute
    WEIGHTS = ("w_up", "w_down")

    def __init__(self, n_experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.n_experts = n_experts
        self.w_up = nn.Parameter(torch.empty(n_experts * d_model, 2 * d_expert))  # module doc: rows (e, D)
        self.w_down = nn.Parameter(torch.empty(n_experts * d_expert, d_model))  # rows (e, F)
        # weight name -> a 0-d tensor whose gradient the dW kernel sets to the sum of the squares
        # of the weight's gradient (optimus_kernels.grouped_mm's dw_square; optimus_core.train.optim)
        self.dw_squares: dict[str, torch.Tensor] = {}

    @property
    def n_held(self) -> int:
        """Experts whose weights this module holds (all of them here; expert parallelism: its share)."""
        return self.n_experts

    def permute(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, n_groups: int, n_rows: int | None = None):
        """(x_sorted_MD, offsets (n_groups,) int32, sorted_idx (T * K,)); M = n_rows or T * K."""
        return optimus_kernels.permute(x_TD, topk_idx_TK, n_groups, backend=self.backend, n_rows=n_rows)

    def unpermute(self, y_MD: torch.Tensor, sorted_idx: torch.Tensor, topk_weight_TK: torch.Tensor | None,
                  top_k: int | None = None):
        """The top-k combine, weighted, or a plain sum over top_k rows with topk_weight_TK None."""
        return optimus_kernels.unpermute(y_MD, sorted_idx, topk_weight_TK, top_k=top_k, backend=self.backend)

    def apply_routed(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                     n_groups: int) -> torch.Tensor:
        """Each token through its top-k experts, the outputs summed with its routing weights:
        permute, the experts, unpermute. Assignments to group ``n_experts`` (dropped over
        capacity) get no expert and must carry weight 0. Expert parallelism replaces this one
        method (optimus_core.parallel.expert_parallel): the seam where tokens may leave the rank.
        Under autocast the tokens are cast before they are copied top-k times (as expert
        parallelism sends them), not after: the (T * K, D) copies are made and kept in bf16
        instead of float32 then cast, and their gradients come back through one bf16 combine.
        The forward is the same bit for bit; the tokens' gradient is summed over the top-k copies
        in float32 and rounded to bf16 once, as every bf16 activation's gradient is."""
        if torch.is_autocast_enabled(x_TD.device.type):
            x_TD = x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
        x_sorted_MD, offsets, sorted_idx = self.permute(x_TD, topk_idx_TK, n_groups)
        return self.combine_sorted(x_sorted_MD, offsets[:self.n_experts], sorted_idx, topk_weight_TK)

    def combine_sorted(self, x_sorted_MD: torch.Tensor, offsets_E: torch.Tensor, sorted_idx: torch.Tensor,
                       topk_weight_TK: torch.Tensor) -> torch.Tensor:
        """out_TD: the experts on permute's sorted rows (M <= T * K of them; offsets_E one per
        expert), each row weighted by its routing weight (on its SwiGLU output: module docstring)
        and summed per token."""
        # the routing weight of each sorted row (assignment sorted_idx[i]); rows not made get none
        row_weight_M = topk_weight_TK.reshape(-1).index_select(0, sorted_idx[:x_sorted_MD.shape[0]])
        if self.checkpoint_compute and torch.is_grad_enabled():
            y_sorted_MD = checkpoint(self, x_sorted_MD, offsets_E, row_weight_M, use_reentrant=False)
        else:
            y_sorted_MD = self(x_sorted_MD, offsets_E, row_weight_M)
        return self.unpermute(y_sorted_MD, sorted_idx, None, top_k=topk_weight_TK.shape[1])

    def forward(self, x_MD: torch.Tensor, offsets_E: torch.Tensor, row_weight_M: torch.Tensor | None = None) -> torch.Tensor:
        """x_MD expert-sorted rows, offsets_E int32 cumulative group ends (one per expert);
        rows past offsets_E[-1] (tokens dropped over capacity) come out zero. row_weight_M: a
        weight per row, applied to its SwiGLU output (the routing weights, combine_sorted)."""
        w_up, w_down = self.w_up, self.w_down
        keep_cast = False
        up_cast = down_cast = None
        if torch.is_autocast_enabled(x_MD.device.type):  # the kernels compute in one dtype
            dtype = torch.get_autocast_dtype(x_MD.device.type)
            x_MD = x_MD.to(dtype)
            up_copy, down_copy = getattr(self, "w_up_cast", None), getattr(self, "w_down_cast", None)
            copies = up_copy is not None and up_copy.dtype == dtype
            if copies and up_copy.requires_grad:  # the copies are the weights (their gradients: bf16, on them)
                w_up, w_down = up_copy, down_copy
            elif copies:  # the copies the optimizer keeps: no cast at all
                up_cast, down_cast = up_copy, down_copy
            elif self.backend == "triton":
                # The float32 weights go in as they are: the op casts them, and writes their
                # gradient in float32 itself (no cast pass over it); it keeps its cast copy for
                # the backward, or with recast_weights casts again there (6 GiB less for 8
                # OLMoE layers, one more pass) (kernels/optimus_kernels/grouped_mm.py).
                keep_cast = not self.recast_weights
            elif not self.recast_weights:  # cast once here; autograd keeps the copies for backward
                w_up, w_down = w_up.to(dtype), w_down.to(dtype)
        squares, E = self.dw_squares, self.n_held
        w_up_EDF2, w_down_EFD, up_cast, down_cast = (None if w is None else w.view(E, -1, w.shape[-1])
                                                     for w in (w_up, w_down, up_cast, down_cast))
        return optimus_kernels.expert_mlp(x_MD, w_up_EDF2, w_down_EFD, offsets_E, row_weight=row_weight_M,
                                  backend=self.backend, keep_cast=keep_cast, up_cast=up_cast, down_cast=down_cast,
                                  up_square=squares.get("w_up"), down_square=squares.get("w_down"))

