"""AdamW on each rank's shares of a fully sharded model (optimus_core.parallel.sharding), with the
clip's global norm.

    model = shard_model(expert_parallel(meta_model, mesh), mesh, optimizer=mode)
    opt = ShardedAdamW(model, mesh, cfg.optim, mode="ep_aware", kernel="triton",  # or "dp_sharded" (the ablation)
                       weight_gathers="per_micro_batch")                           # or "per_step" (the plan's)
    loss.backward()                                 # FSDP2 reduce-scatters the gradients as it goes
    grad_norm = opt.clip_and_step(max_norm=1.0)     # norm, clip, update the local shares
    opt.zero_grad()

Each rank updates what it holds, so the AdamW state is sharded exactly as the weights are:

    dense, ep_aware        1/W of every dense parameter (the gradient is FSDP2's reduce-scatter)
    dense, dp_sharded      1/(W/ep) of every dense parameter, the same share on each rank of the
                           EP group (the paper's baseline: dense state replicated ep times)
    expert, both           1/(W/ep) of the rank's experts (FSDP2 on the expert-dp mesh)

The global gradient norm: every element of every parameter lies on exactly one rank of each
block of parallel.dp_shard ranks (the blocks are replicas: only the first block's ranks count;
under dp_sharded a dense share counts on EP rank 0 only), so it is the square root of one
all-reduce of each rank's sum of squares (with pipeline stages, a second one over the pipeline:
the stages hold disjoint parameters). The clip factor rides into the update kernel (TritonAdamW's grad_scale)
or scales the local gradients once (torch's AdamW). The update is torch.optim.AdamW's arithmetic
(``kernel``, the execution plan's adamw: TritonAdamW on a GPU, on each share's local tensor).
"""
from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from ..config import OptimConfig
from ..parallel.expert_parallel import expert_parameter_names
from ..parallel.layout import local_tensor
from ..parallel.mesh import Mesh
from ..parallel.sharding import OPTIMIZERS
from ..timing import phase
from .optim import clip_coef_as_grad_scale, param_groups


class ShardedAdamW:
    """AdamW over the local shares of a sharded model (module doc)."""

    syncs_gradients = True  # train_step: call clip_and_step instead of clipping itself

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: OptimConfig, mode: str = "ep_aware", kernel: str = "torch",
                 weight_gathers: str = "per_micro_batch"):
        if mode not in OPTIMIZERS:  # the sharding's layouts: each lays out where the state lives
            raise ValueError(f"parallel.optimizer = {mode!r}: must be one of {', '.join(map(repr, OPTIMIZERS))}")
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        self.mesh, self.mode, self.model, self.per_step = mesh, mode, model, weight_gathers == "per_step"
        # the units below the root (whose weights stay gathered through the backward anyway)
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        # every unit, the root included, with the layer it serves (a pipeline stage's backward
        # settles its own layers' units): a block and its experts their layer, the embedding the
        # first, the root (final norm, LM head) the last
        n_layers = model.cfg.n_layers
        self.unit_layers = [(unit, 0 if unit is getattr(model, "embed", None) else
                             n_layers - 1 if unit is model else int(name.split(".")[1]))
                            for name, unit in model.named_modules() if isinstance(unit, FSDPModule)]

        params = [p for p in model.parameters() if p.requires_grad]
        # experts at ep > 1: FSDP2's mean over the expert-dp group is ep x the world mean
        # (optimus_core.parallel.sharding), set right before the norm
        experts = expert_parameter_names(model)
        self.ep_scaled = [p for n, p in model.named_parameters()
                          if n in experts and isinstance(p, DTensor) and mesh.ep > 1]
        # Each element counts once in the norm: a share on the ranks of the first block only
        # (parallel.dp_shard: the blocks are replicas), a dp_sharded dense share on EP rank 0 only
        first_block = mesh.rank < mesh.shard_size
        self.counts_in_norm = {id(p): first_block for p in params}
        dense_replicated = mode == "dp_sharded" and mesh.ep > 1
        self.counts_in_norm.update({id(p): mesh.ep_rank == 0 for n, p in model.named_parameters()
                                    if dense_replicated and p.requires_grad and n not in experts})
        # HSDP: the gradients are all-reduced over the replicas in the last micro-batch only
        self.hsdp = mesh.replicas > 1 or dense_replicated
        groups = param_groups(model, cfg.weight_decay, cfg.decay_norms)
        if kernel == "triton":
            from .adamw import TritonAdamW

            self.inner = TritonAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        else:  # one tensor at a time: the shares of one step live on several meshes
            self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
        self.param_groups = self.inner.param_groups  # the loop sets "lr" here each step

    @property
    def state(self):
        return self.inner.state

    def before_micro_batch(self, last: bool, layers: Collection[int] | None = None) -> None:
        """Set how the coming backward synchronises, ``last``: the step's last micro-batch. With
        replicas (parallel.dp_shard, or dp_sharded's dense units over the EP group), the gradients
        are all-reduced over them in the last micro-batch's backward only: the earlier ones
        reduce-scatter within the shard group and add up. Gathered once a step (the plan's
        weight_gathers per_step), the units stay gathered and their gradients accumulate whole
        until the last micro-batch, whose backward reduces them and frees the gathered weights
        (the update then writes the shards, which the next step's first forward gathers).
        ``layers``: only the units serving these layers (a pipeline stage's, before its backward
        of a micro-batch: optimus_core.parallel.pipeline.Pipeline.step); default every unit."""
        for unit, layer in self.unit_layers:
            if layers is not None and layer not in layers:
                continue
            if self.per_step:
                if unit is not self.model:  # (the root stays gathered from its forward anyway)
                    unit.set_reshard_after_forward(False, recurse=False)
                unit.set_requires_gradient_sync(last, recurse=False)
                unit.set_reshard_after_backward(last, recurse=False)
            elif self.hsdp:
                unit.set_requires_all_reduce(last, recurse=False)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float | None) -> torch.Tensor:
        """Take the global norm (returned, before clipping), clip and update."""
        with phase("grad_sync"):
            scaled = [local_tensor(p.grad) for p in self.ep_scaled if p.grad is not None]
            if scaled:
                torch._foreach_mul_(scaled, 1.0 / self.mesh.ep)
        with phase("optimizer"):
            grads, counted = [], []
            for group in self.inner.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    g = local_tensor(p.grad)
                    grads.append(g)
                    if self.counts_in_norm.get(id(p), True) and g.numel():
                        counted.append(g)
            sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
            if counted:  # a float32 norm per tensor, squared and summed in float64
                sq += torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float32)).double().square().sum()
            norm = self.mesh.all_reduce_pipeline_sum_(self.mesh.all_reduce_sum_(sq)).sqrt().float()
            if getattr(self.inner, "takes_grad_scale", False) and max_norm is not None:
                self.inner.grad_scale = clip_coef_as_grad_scale(norm, max_norm)
                try:
                    self.inner.step()
                finally:
                    del self.inner.grad_scale
            else:
                if max_norm is not None and grads:  # as torch.nn.utils.clip_grad_norm_
                    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
                self.inner.step()
        if self.per_step:  # a forward outside the steps (an evaluation) gathers and frees as usual
            for unit in self.units:
                unit.set_reshard_after_forward(True, recurse=False)
        return norm

    def step(self) -> None:
        """torch.optim-style step without clipping."""
        self.clip_and_step(None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.inner.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_numel(self) -> dict[str, int]:
        """Elements of AdamW state (exp_avg) this rank holds, per kind (dense / expert)."""
        experts = {id(p) for n, p in self.model.named_parameters() if n in expert_parameter_names(self.model)}
        out = {"dense": 0, "expert": 0}
        for p, state in self.inner.state.items():
            if "exp_avg" in state:
                out["expert" if id(p) in experts else "dense"] += local_tensor(state["exp_avg"]).numel()
        return out
