"""EP-aware sharded AdamW (ZeRO-1, flat buffers) and its EP-unaware baseline.

    model = parallelize(build_model(cfg), mesh)
    opt = ShardedAdamW(model, mesh, cfg.optim, mode="ep_aware")      # or "ep_unaware"
    loss.backward()
    grad_norm = opt.clip_and_step(max_norm=1.0)     # sync, clip, update, all-gather
    opt.zero_grad()

Parameters go into up to four buckets, (dense | expert) x (decay | no decay), each one flat
buffer that the model's parameters are views of. Per bucket and step:

    dense, both modes      grads reduce-scattered over the world; AdamW state and update on
                           this rank's 1/W shard; updated shards all-gathered back.
    expert, ep_aware       the same over the expert-dp group (the W/ep ranks holding these
                           experts): state 1/(W/ep) per rank.
    expert, ep_unaware     grads all-reduced over the expert-dp group; full state replicated on
                           each of its ranks, every rank updates everything (the ablation).

Gradients are the mean over the world's tokens: every rank's local grads are divided by W
before the sum. That is right for experts too: an expert's local grad already sums the
contributions of the whole EP group (the all-to-all backward brought them home), so summing
over the expert-dp group covers all W ranks once. The global grad norm sums the squares of the
reduced shards over the world; a replicated (ep_unaware) expert bucket counts only on
expert-dp rank 0, so every parameter is counted exactly once. The update itself is
torch.optim.AdamW on the shard tensors, so the arithmetic is torch's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import OptimConfig
from .expert_parallel import expert_parameter_names
from .mesh import Mesh


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


@dataclass
class Bucket:
    """One flat buffer of parameters that share a sync rule and a weight decay."""

    name: str  # dense.decay | dense.no_decay | expert.decay | expert.no_decay
    params: list[nn.Parameter]
    flat_N: torch.Tensor  # padded to a multiple of group_size; the params are views of it
    shard: torch.Tensor  # this rank's slice of flat_N (a view: what AdamW updates in place)
    group: object  # process group (None = the world)
    group_size: int
    group_rank: int
    sharded: bool  # False: all-reduce grads, full replicated state (ep_unaware experts)
    counts_in_norm: bool  # False on replicas whose squares another rank already counts

    @classmethod
    def build(cls, name, params, group, group_size, group_rank, sharded, counts_in_norm):
        numel = sum(p.numel() for p in params)
        shards = group_size if sharded else 1
        shard_len = -(-numel // shards)
        flat_N = torch.zeros(shard_len * shards, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:  # the model's parameters become views of the flat buffer
            flat_N[offset:offset + p.numel()].copy_(p.detach().flatten())
            p.data = flat_N[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        lo = group_rank * shard_len if sharded else 0
        # A view, not a copy: whatever writes the parameters (a checkpoint load) writes the shard.
        shard = flat_N[lo:lo + shard_len]
        return cls(name, params, flat_N, shard, group, group_size, group_rank, sharded, counts_in_norm)

    def flat_grad(self, scale: float) -> torch.Tensor:
        grad_N = torch.zeros_like(self.flat_N)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                grad_N[offset:offset + p.numel()] = p.grad.flatten()
            offset += p.numel()
        return grad_N.mul_(scale)

    def reduce_grad(self, scale: float) -> torch.Tensor:
        """This rank's reduced gradient shard (sum over the group of grad * scale)."""
        grad_N = self.flat_grad(scale)
        if self.group_size == 1:
            return grad_N
        if not self.sharded:
            dist.all_reduce(grad_N, group=self.group)
            return grad_N
        grad_shard = torch.empty_like(self.shard)
        _reduce_scatter(grad_shard, grad_N, self.group)
        return grad_shard

    def publish(self) -> None:
        """Bring every rank's updated shard into the flat buffer (the params see it)."""
        if self.sharded and self.group_size > 1:
            # The input is a slice of the output: hand the collective its own copy.
            _all_gather(self.flat_N, self.shard.detach().clone(), self.group)


class ShardedAdamW:
    """AdamW with ZeRO-1 sharding that knows which parameters are experts (see module doc)."""

    syncs_gradients = True  # train_step: call clip_and_step instead of clipping itself

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: OptimConfig, mode: str = "ep_aware"):
        if mode not in ("ep_aware", "ep_unaware"):
            raise ValueError(f"parallel.optimizer = {mode!r}: must be 'ep_aware' or 'ep_unaware'")
        self.mesh, self.mode = mesh, mode
        experts = expert_parameter_names(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        for kind in ("dense", "expert"):
            for decay in (True, False):
                params = [p for n, p in named if (n in experts) == (kind == "expert") and (p.ndim >= 2) == decay]
                if not params:
                    continue
                name = f"{kind}.{'decay' if decay else 'no_decay'}"
                if kind == "dense":
                    args = (None, mesh.world_size, mesh.rank, True, True)
                else:
                    aware = mode == "ep_aware"
                    args = (mesh.expert_dp_group, mesh.expert_dp_size, mesh.expert_dp_rank, aware,
                            aware or mesh.expert_dp_rank == 0)
                self.buckets.append(Bucket.build(name, params, *args))
        groups = [{"params": [b.shard], "weight_decay": cfg.weight_decay if b.name.endswith(".decay") else 0.0}
                  for b in self.buckets]
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
        self.param_groups = self.inner.param_groups  # the loop sets "lr" here each step

    @torch.no_grad()
    def clip_and_step(self, max_norm: float | None) -> torch.Tensor:
        """Reduce grads, clip by the global norm (returned, before clipping), update, all-gather."""
        scale = 1.0 / self.mesh.world_size
        grads = [b.reduce_grad(scale) for b in self.buckets]
        sq = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        for b, g in zip(self.buckets, grads):
            if b.counts_in_norm:
                sq += g.double().pow(2).sum()
        norm = self.mesh.all_reduce_sum_(sq).sqrt().float()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
            for g in grads:
                g.mul_(coef)
        for b, g in zip(self.buckets, grads):
            b.shard.grad = g
        self.inner.step()
        for b in self.buckets:
            b.shard.grad = None
            b.publish()
        return norm

    def step(self) -> None:
        """torch.optim-style step without clipping."""
        self.clip_and_step(None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    def state_numel(self) -> dict[str, int]:
        """Elements of AdamW state (exp_avg) this rank holds, per bucket kind (dense / expert)."""
        out = {"dense": 0, "expert": 0}
        for b in self.buckets:
            state = self.inner.state.get(b.shard, {})
            out[b.name.split(".")[0]] += state["exp_avg"].numel() if "exp_avg" in state else 0
        return out

    # -------------------------------------------------------------- checkpoints
    def layout(self) -> dict:
        return {"world_size": self.mesh.world_size, "ep": self.mesh.ep, "mode": self.mode,
                "buckets": [b.name for b in self.buckets]}

    def state_dict(self) -> dict:
        """Collective: every rank's shard state, gathered (laptop scale; issue 6 shards it on disk)."""
        local = self.inner.state_dict()
        if self.mesh.distributed:
            shards = [None] * self.mesh.world_size
            dist.all_gather_object(shards, local)
        else:
            shards = [local]
        return {"layout": self.layout(), "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        if state.get("layout") != self.layout():
            raise ValueError(f"optimizer state was saved with layout {state.get('layout')}, this run has "
                             f"{self.layout()}: resume with the same number of ranks, ep and optimizer")
        self.inner.load_state_dict(state["shards"][self.mesh.rank])
