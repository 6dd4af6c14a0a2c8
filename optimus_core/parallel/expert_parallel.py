"""Expert parallelism without touching the model: ``expert_parallel(model, mesh)``.

    with torch.device("meta"):
        model = Transformer(cfg.model)       # nothing allocated
    model = expert_parallel(model, mesh)         # each EP rank holds n_experts / ep experts' rows

The MoE layer routes its tokens and hands them to ``self.experts.apply_routed(x, topk_idx,
topk_weight)``; ``expert_parallel`` swaps that ``Experts`` for an ``ExpertParallelExperts`` holding
only this rank's experts (their rows of the weights), whose ``apply_routed`` exchanges the
tokens over the EP group in one of two ways (``exchange``, execution.expert_exchange):

    all_to_all  each token goes once to every EP rank holding one of its experts (counts
                exchanged first, then a variable-size all-to-all); that rank runs its experts on
                it with the same kernels, sums their outputs with the routing weights, and sends
                one partial sum per (token, rank) back to be added up
    all_gather  the paper's (GitHub IntelLabs/Optimus-LM): every rank's tokens, routing weights
                and expert ids are all-gathered over the group; each rank runs its experts on
                the gathered tokens routed to them and sums their outputs per token; a
                reduce-scatter adds the group's partial sums and returns each rank its own
                tokens' (backward: the reverse). Equal-size collectives only, no counts: no
                variable all-to-all, which oneCCL's xccl mishandles with empty splits

Both give the single-process layer's results (float32: to rounding), tokens dropped over a
capacity factor included (the run config allows the all-gather only without one: the paper's is
dropless). The all-gather moves every token to every rank (ep x the tokens' bytes each way), the
all-to-all only to the ranks of its experts (at most top_k of them). The model's code does not change;
parameter names stay those of the plain model. A model on the meta device stays there
(nothing is allocated: optimus_core.parallel.layout materialises each rank's rows); a model with
weights gives each rank a copy of its experts' rows.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.experts import Experts
from ..model.moe import MoEFeedForward
from ..timing import phase
from .dispatch import all_gather_rows, all_to_all, exchange_counts, reduce_scatter_rows
from .mesh import Mesh


class ExpertParallelExperts(Experts):
    """This EP rank's experts ``[first, first + n_local)`` of ``n_experts`` plus the token exchange."""

    def __init__(self, full: Experts, mesh: Mesh, exchange: str = "all_to_all"):
        nn.Module.__init__(self)
        self.n_experts = full.n_experts
        for name in Experts.EXECUTION:  # how the experts execute, as the plan set it on the whole module
            setattr(self, name, getattr(full, name))
        self.ep, self.group, self.ep_rank, self.exchange = mesh.ep, mesh.ep_group, mesh.ep_rank, exchange
        self.n_local = full.n_experts // mesh.ep
        self.first = mesh.ep_rank * self.n_local
        for name in self.WEIGHTS:  # rows [first * r, (first + n_local) * r) of (n_experts * r, cols)
            w = getattr(full, name)
            rows = w.shape[0] // self.n_experts
            local = w.detach()[self.first * rows:(self.first + self.n_local) * rows]
            setattr(self, name, nn.Parameter(local if w.is_meta else local.clone()))
        self.dw_squares = {}  # none: the sharded optimizer reduces the gradients before their norm

    @property
    def n_held(self) -> int:
        return self.n_local

    def first_row(self, name: str) -> int:
        """The row of the whole (n_experts * rows, cols) weight ``name`` where this rank's rows begin."""
        return self.first * (getattr(self, name).shape[0] // self.n_local)

    def apply_routed(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                     n_groups: int) -> torch.Tensor:
        """The tokens through their experts across the EP group, by ``self.exchange`` (module
        doc). Activations travel in the autocast dtype; assignments to the phantom group
        ``n_experts`` (dropped over capacity) go nowhere."""
        if torch.is_autocast_enabled(x_TD.device.type):
            x_TD = x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
        if self.exchange == "all_gather":
            return self._gathered(x_TD, topk_idx_TK, topk_weight_TK)
        return self._all_to_all(x_TD, topk_idx_TK, topk_weight_TK)

    def _gathered(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor) -> torch.Tensor:
        """The paper's exchange: all-gather in, this rank's experts on the gathered tokens routed
        to them, reduce-scatter out. The partial sums are added in the activations' dtype by the
        reduce-scatter (the paper's: bf16 under autocast), not in float32 as the all-to-all's."""
        K, n_local = topk_idx_TK.shape[1], self.n_local
        # Weights and ids in one gather: ids ride in float32 next to the weights (exact below
        # 2**24); the weights' gradient comes home through its reduce-scatter, the ids' is zero.
        meta_T2K = torch.cat([topk_weight_TK.float(), topk_idx_TK.float()], dim=1)
        x_GD = all_gather_rows(x_TD, self.group)
        meta_G2K = all_gather_rows(meta_T2K, self.group)
        w_GK, idx_GK = meta_G2K[:, :K], meta_G2K[:, K:].detach().long()
        local_GK = idx_GK - self.first
        mine_GK = (local_GK >= 0) & (local_GK < n_local)
        local_GK = torch.where(mine_GK, local_GK, n_local)  # others' experts: the phantom group, no rows
        with phase("a2a"):  # the rows to make must reach the host: the layer's one wait for the device
            n_assigned = int(mine_GK.sum())
        x_sorted_MD, offsets, sorted_idx = self.permute(x_GD, local_GK, n_local + 1, n_rows=n_assigned)
        del x_GD  # nothing keeps the gathered tokens: freed before the partial sums are made
        partial_GD = self.combine_sorted(x_sorted_MD, offsets[:n_local], sorted_idx, w_GK)
        return reduce_scatter_rows(partial_GD, self.group)

    def _all_to_all(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor) -> torch.Tensor:
        """Send each token once to every EP rank that holds one of its experts (not once per
        expert), with its routing slots; each rank runs its experts on what it received and sums
        their outputs per token with the routing weights (a partial combine); the partials come
        back, one row per (token, rank), and are added up here.

        With top-k = 8 of 64 experts on 2 ranks a token visits ~2 ranks instead of 8 expert
        copies: ~4x fewer rows cross the link each way than dispatching expert-sorted copies.
        """
        T, K = topk_idx_TK.shape
        ep, n_local = self.ep, self.n_local
        device = x_TD.device
        rank_TK = topk_idx_TK // n_local  # the phantom group n_experts lands on "rank" ep: nowhere
        need_TP = torch.zeros(T, ep + 1, dtype=torch.bool, device=device).scatter_(1, rank_TK, True)[:, :ep]
        # Per peer: rows (tokens) and slots (token, expert) sent; the slots let the receiver
        # make only its real assignments' rows below.
        slots_P = torch.zeros(ep + 1, dtype=torch.long, device=device).scatter_add_(
            0, rank_TK.flatten(), torch.ones(T * K, dtype=torch.long, device=device))[:ep]
        send_P2 = torch.stack([need_TP.sum(0), slots_P], 1)
        recv_P2 = exchange_counts(send_P2, self.group)

        # Everything that does not need the counts on the host is queued before the wait below,
        # so that after it the host launches only the exchanges: the device idles
        # from the wait until the next launch. Candidate rows are every (peer, token) pair, the
        # needed ones first in peer-major token order (a stable sort of the not-needed flags: the
        # order nonzero gives, at a size known without the counts); the first sum(send_splits)
        # are sent. Per candidate row, its K slots as seen by the receiving peer: a local expert
        # id, or n_local (a phantom group: not this peer's expert) with weight 0. Ids ride in
        # float32 next to the weights (exact below 2**24), so one differentiable exchange
        # carries both.
        order_N = torch.argsort((~need_TP.T).flatten().to(torch.uint8), stable=True)
        peer_N, token_N = order_N // T, order_N % T
        on_peer_NK = rank_TK[token_N] == peer_N[:, None]
        local_NK = torch.where(on_peer_NK, topk_idx_TK[token_N] - peer_N[:, None] * n_local, n_local)
        w_NK = torch.where(on_peer_NK, topk_weight_TK[token_N].float(), 0.0)
        meta_N2K = torch.cat([w_NK, local_NK.float()], dim=1)

        with phase("a2a"):  # the split sizes must reach the host: the layer's one wait for the device
            counts = torch.cat([send_P2, recv_P2]).tolist()
        send_splits = [c[0] for c in counts[:ep]]
        recv_splits, n_assigned = [c[0] for c in counts[ep:]], sum(c[1] for c in counts[ep:])
        there = lambda x_MD: all_to_all(x_MD, recv_splits, send_splits, self.group)  # noqa: E731
        home = lambda x_MD: all_to_all(x_MD, send_splits, recv_splits, self.group)  # noqa: E731
        S = sum(send_splits)
        token_S, meta_S2K = token_N[:S], meta_N2K[:S]  # views: no launch
        x_RD = there(x_TD.index_select(0, token_S))
        meta_R2K = there(meta_S2K)
        w_RK, local_RK = meta_R2K[:, :K], meta_R2K[:, K:].detach().long()

        # The slots of other ranks' experts sort last (phantom group n_local): no rows for them.
        x_sorted_MD, offsets, sorted_idx = self.permute(x_RD, local_RK, n_local + 1, n_rows=n_assigned)
        partial_RD = self.combine_sorted(x_sorted_MD, offsets[:n_local], sorted_idx, w_RK)
        partial_SD = home(partial_RD)
        # At most ep partials per token: summed in float32, like the single-rank combine.
        return _SumPartials.apply(partial_SD, token_S, T)

    def forward(self, x_MD: torch.Tensor, offsets_E: torch.Tensor, row_weight_M: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's experts on rows already sorted by local expert (the kernels, no exchange)."""
        return Experts.forward(self, x_MD, offsets_E, row_weight_M)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A whole (unsharded) state dict loads onto any EP rank: take this rank's experts' rows.
        for name in self.WEIGHTS:
            value = state_dict.get(prefix + name)
            if value is not None and value.shape[0] != getattr(self, name).shape[0]:
                rows = value.shape[0] // self.n_experts
                value = value[self.first * rows:(self.first + self.n_local) * rows]
            if value is not None:
                state_dict[prefix + name] = value
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)


class _SumPartials(torch.autograd.Function):
    """out_TD[t] = the sum, in float32, of the rows partial_SD[s] with token_S[s] == t, returned
    in the partials' dtype; the backward hands each row its token's gradient. It keeps only the
    index: index_add's own backward keeps its float32 source (for an expand_as), rows x d_model x
    4 bytes per MoE layer from the forward to the backward."""

    @staticmethod
    def forward(ctx, partial_SD: torch.Tensor, token_S: torch.Tensor, T: int) -> torch.Tensor:
        ctx.save_for_backward(token_S)
        out_TD = partial_SD.new_zeros(T, partial_SD.shape[1], dtype=torch.float32)
        return out_TD.index_add_(0, token_S, partial_SD.float()).to(partial_SD.dtype)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        token_S, = ctx.saved_tensors
        return grad_TD.index_select(0, token_S), None, None


EXCHANGES = ("all_to_all", "all_gather")


def expert_parallel(model: nn.Module, mesh: Mesh, exchange: str = "all_to_all") -> nn.Module:
    """Apply expert parallelism in place (a no-op for ep == 1 or a dense model); returns ``model``.
    ``exchange``: how tokens reach the experts, ``all_to_all`` or ``all_gather`` (the paper's;
    module doc; execution.expert_exchange)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"expert exchange {exchange!r}: must be one of {', '.join(EXCHANGES)}")
    if mesh.ep == 1:
        return model
    for module in model.modules():
        if isinstance(module, MoEFeedForward) and not isinstance(module.experts, ExpertParallelExperts):
            module.experts = ExpertParallelExperts(module.experts, mesh, exchange)
    return model


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the experts' weights (sharded by EP; synchronised over the expert-dp group)."""
    return {f"{mod_name}.{p_name}" if mod_name else p_name
            for mod_name, module in model.named_modules() if isinstance(module, Experts)
            for p_name, _ in module.named_parameters(recurse=False)}
