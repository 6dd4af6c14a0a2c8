"""The experts' computation: the one seam where kernels enter the model (house rule 6).

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
seeded init draws rows (optimus_core.model.init). State dicts of the earlier (E, D, 2F) layout
load as they are (``_load_from_state_dict`` reshapes them).

Routing weights: each row's routing weight scales its SwiGLU output, before the down
projection, and the combine is a plain sum. The down projection is linear, so the output is the
same as weighting the combine, up to rounding; the backward needs less memory: a weighted
combine must keep the experts' output rows (R x D) to differentiate its weights, the weighted
SwiGLU gets that gradient from what it keeps anyway (kernels/swiglu.py). ``combine_sorted`` does
it for this module's ``apply_routed`` and expert parallelism's.

Weight casts (the execution plan's expert copies, optimus_core.execution): under bf16 autocast the float32 master weights would
be cast to bf16 by every forward (3.2B expert parameters: read 4 bytes, write 2 each). Instead

    experts.enable_weight_casts(torch.bfloat16)   # non-persistent buffers w_up_cast, w_down_cast
    experts.weight_casts()                        # {w_up: w_up_cast, w_down: w_down_cast}
    assert_weight_casts_current(model)            # tests: every copy == w.to(its dtype), bit for bit

keeps a copy that every writer of the weights keeps equal to w.to(bf16): the optimizers (they
find the copies through optimus_core.train.optim.weight_casts; TritonAdamW writes them in its
update pass), loading a state dict (here), Transformer.init_weights. State dicts and checkpoints
do not change. The forward reads a copy only when its dtype is autocast's.

Gradients on the copies (the plan's bf16 expert gradients, wherever they apply):

    experts.keep_grads_on_casts(True)             # the copies require grad

makes the copies the weights the forward multiplies by, so the dW kernel stores each weight's
gradient in bf16 as the copy's ``.grad``, and TritonAdamW applies it to the float32 weight
(optimus_core.train.adamw). It is the gradient torch's autocast recipe makes (the bf16 GEMM's dW,
rounded to bf16, then widened into a float32 ``.grad``) without the float32 tensor: 6 GiB less at
the end of the backward for 8 OLMoE layers, where the step's memory peaked (bench/NOTES.md).
Micro-batches would add up in bf16, so one micro-batch per step only (optimus_core.execution).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import kernels


class Experts(nn.Module):
    # Under autocast: cast the float32 weights inside each grouped GEMM instead of once per
    # forward (execution.recast_expert_weights): less memory, a little more time.
    recast_weights: bool = False
    # The backward recomputes the GEMMs and SwiGLU from the sorted rows instead of keeping their
    # intermediates (execution.activation_checkpointing = "moe"); the dispatch is not repeated.
    checkpoint_compute: bool = False
    WEIGHTS = ("w_up", "w_down")

    def __init__(self, n_experts: int, d_model: int, d_expert: int, backend: str = "loop"):
        super().__init__()
        self.n_experts, self.backend = n_experts, backend
        self.w_up = nn.Parameter(torch.empty(n_experts * d_model, 2 * d_expert))  # module doc: rows (e, D)
        self.w_down = nn.Parameter(torch.empty(n_experts * d_expert, d_model))  # rows (e, F)
        self.enable_weight_casts(None)
        self.dw_square_of: dict[str, torch.Tensor] = {}  # weight name -> its dw_square (enable_dw_squares)

    def enable_weight_casts(self, dtype: torch.dtype | None) -> None:
        """Keep a ``dtype`` copy of each weight (non-persistent buffers ``<name>_cast``), made
        now from the weights; None drops them. Build the optimizer after this: it looks them up."""
        for name in self.WEIGHTS:
            copy = None if dtype is None else getattr(self, name).detach().to(dtype, copy=True)
            self.register_buffer(f"{name}_cast", copy, persistent=False)

    def keep_grads_on_casts(self, on: bool) -> None:
        """The weights' gradients on their copies, in the copies' dtype (module docstring), or
        back on the weights (``on`` False). ValueError without copies."""
        casts = self.weight_casts()
        if on and not casts:
            raise ValueError("keep_grads_on_casts: these experts keep no weight copies (enable_weight_casts)")
        for copy in casts.values():
            copy.grad = None
            copy.requires_grad_(on)

    @property
    def grads_on_casts(self) -> bool:
        copy = getattr(self, "w_up_cast", None)
        return copy is not None and copy.requires_grad

    @property
    def weight_cast_dtype(self) -> torch.dtype | None:
        copy = getattr(self, "w_up_cast", None)
        return None if copy is None else copy.dtype

    def weight_casts(self) -> dict[nn.Parameter, torch.Tensor]:
        """{weight: its copy}, empty without copies: what the optimizers keep current."""
        pairs = ((getattr(self, name), getattr(self, f"{name}_cast", None)) for name in self.WEIGHTS)
        return {w: copy for w, copy in pairs if copy is not None}

    def refresh_weight_casts(self) -> None:
        """Copies = weights, cast (after anything but the optimizer wrote the weights)."""
        refresh_casts(self.weight_casts())

    def enable_dw_squares(self) -> dict[nn.Parameter, torch.Tensor]:
        """With the triton backend: give each weight a ``dw_square`` (kernels.grouped_mm), a 0-d
        float32 tensor on the weight's device whose gradient each backward sets to the sum of the
        squares of the weight's gradient, summed by the dW kernel as it stores that gradient.
        Returns {weight: its dw_square} for the clip's norm (optimus_core.train.grad_norm),
        empty for the other backends, where it would cost the pass over the gradient it saves.
        Not parameters: no optimizer, state dict or checkpoint sees them."""
        if self.backend != "triton":
            return {}
        self.dw_square_of = {name: torch.zeros((), device=getattr(self, name).device, requires_grad=True)
                             for name in self.WEIGHTS}
        return {getattr(self, name): square for name, square in self.dw_square_of.items()}

    @property
    def n_held(self) -> int:
        """Experts whose weights this module holds (all of them here; expert parallelism: its share)."""
        return self.n_experts

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self.WEIGHTS:  # the earlier (E, rows, cols) layout: the same values in rows
            value = state_dict.get(prefix + name)
            if value is not None and value.ndim == 3:
                state_dict[prefix + name] = value.reshape(-1, value.shape[-1])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.refresh_weight_casts()  # the loaded weights, cast (the copies are not in state dicts)

    def permute(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, n_groups: int, n_rows: int | None = None):
        """(x_sorted_MD, offsets (n_groups,) int32, sorted_idx (T * K,)); M = n_rows or T * K."""
        return kernels.permute(x_TD, topk_idx_TK, n_groups, backend=self.backend, n_rows=n_rows)

    def unpermute(self, y_MD: torch.Tensor, sorted_idx: torch.Tensor, topk_weight_TK: torch.Tensor | None,
                  top_k: int | None = None):
        """The top-k combine, weighted, or a plain sum over top_k rows with topk_weight_TK None."""
        return kernels.unpermute(y_MD, sorted_idx, topk_weight_TK, top_k=top_k, backend=self.backend)

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
            if self.weight_cast_dtype == dtype and self.grads_on_casts:  # the copies are the weights
                w_up, w_down = self.w_up_cast, self.w_down_cast  # (their gradients: bf16, on them)
            elif self.weight_cast_dtype == dtype:  # the copies the optimizer keeps: no cast at all
                up_cast, down_cast = self.w_up_cast, self.w_down_cast
            elif self.backend == "triton":
                # The float32 weights go in as they are: the op casts them, and writes their
                # gradient in float32 itself (no cast pass over it); it keeps its cast copy for
                # the backward, or with recast_weights casts again there (6 GiB less for 8
                # OLMoE layers, one more pass) (kernels/grouped_mm.py).
                keep_cast = not self.recast_weights
            elif not self.recast_weights:  # cast once here; autograd keeps the copies for backward
                w_up, w_down = w_up.to(dtype), w_down.to(dtype)
        squares, E = self.dw_square_of, self.n_held
        w_up_EDF2, w_down_EFD, up_cast, down_cast = (None if w is None else w.view(E, -1, w.shape[-1])
                                                     for w in (w_up, w_down, up_cast, down_cast))
        return kernels.expert_mlp(x_MD, w_up_EDF2, w_down_EFD, offsets_E, row_weight=row_weight_M,
                                  backend=self.backend, keep_cast=keep_cast, up_cast=up_cast, down_cast=down_cast,
                                  up_square=squares.get("w_up"), down_square=squares.get("w_down"))


def grad_holder(w: torch.Tensor, casts: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The tensor whose ``.grad`` is ``w``'s gradient: its copy in ``casts`` ({weight: copy})
    where the gradients stay on the copies (Experts.keep_grads_on_casts), else ``w``."""
    copy = casts.get(w)
    return copy if copy is not None and copy.requires_grad else w


@torch.no_grad()
def refresh_casts(casts: dict[torch.Tensor, torch.Tensor]) -> None:
    """Every copy = its weight cast to the copy's dtype (round to nearest even): for the weights'
    writers other than the update kernel (loads, init, torch's AdamW, the sharded all-gather)."""
    for w, copy in casts.items():
        copy.copy_(w)


def assert_weight_casts_current(model: nn.Module) -> int:
    """Raise AssertionError unless every expert weight copy in ``model`` equals its weight cast
    to the copy's dtype, bit for bit; returns how many copies were checked (0: none kept)."""
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            for w, copy in module.weight_casts().items():
                want = w.detach().to(copy.dtype)
                if not torch.equal(_bits(copy), _bits(want)):  # bits: NaN copies of NaN count as equal
                    differ = (copy != want).sum().item()
                    raise AssertionError(f"{name or 'experts'}: {differ} of {copy.numel()} elements of a "
                                         f"{copy.dtype} weight copy differ from the weight, cast")
                checked += 1
    return checked


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
