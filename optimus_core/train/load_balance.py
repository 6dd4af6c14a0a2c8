"""The load-balancing loss's "global" statistic: assignment counts over the data-parallel world.

    shares = GlobalShares(mesh)                      # one per optimizer step
    share_LE = shares.add(counts_LE)                 # after each micro-batch's forward
    aux = model.aux_loss(share_LE)                   # the load-balancing loss of these shares, P_e local

With ``model.moe.lb_loss_scope = "forward"`` (OLMoE's and the paper's runs) each forward's
load-balancing loss (Transformer.lb_loss, either form) uses its own share of assignments
f_e = c_e / (T k): a statistic of one rank's micro-batch, so the same run on 1 process and on N
ranks optimises slightly different objectives. With "global" f_e is the share counted over
every rank's tokens (one all-reduce of the (layers, experts) counts per micro-batch) and over the
step's micro-batches so far: after micro-batch i, the counts of micro-batches 1..i of every rank
(Megatron's global auxiliary loss, which averages the micro-batches seen). P_e, the mean router
probability through which the gradient flows, stays each forward's own. Since the loss is linear
in P_e, the per-micro-batch terms weighted by their token share and averaged over the ranks (as
the step's gradients are) add up to the loss of the whole batch over all its tokens, whenever
each rank runs one micro-batch a step: the same objective on 1 or N ranks
(tests/optimus_core/parallel). With several
micro-batches, micro-batch i sees the counts of the first i, not the step's, whose last
micro-batch is not routed yet when the first one's backward runs.
"""
from __future__ import annotations

import torch


class GlobalShares:
    """The step's running counts; ``add`` all-reduces one micro-batch's and returns the shares."""

    def __init__(self, mesh=None):
        self.mesh = mesh
        self.counts_LE: torch.Tensor | None = None

    def add(self, counts_LE: torch.Tensor) -> torch.Tensor:
        """(L, E) float32 shares of assignments per expert of each layer, from this micro-batch's
        (L, E) counts on this rank added to those seen before, over the world (a collective)."""
        counts = counts_LE.detach().to(torch.float64)  # exact integers far past any batch's counts
        if self.mesh is not None and self.mesh.distributed:
            counts = self.mesh.all_reduce_sum_(counts.clone())
        self.counts_LE = counts if self.counts_LE is None else self.counts_LE + counts
        total_L1 = self.counts_LE.sum(-1, keepdim=True).clamp_min(1)
        return (self.counts_LE / total_L1).float()
