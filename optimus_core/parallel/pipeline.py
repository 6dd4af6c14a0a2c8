"""Pipeline parallelism: the model cut into stages by layers, run under torch's 1F1B schedules.

    layers = cfg.parallel.stage_layers(cfg.model.n_layers)   # [(first, stop), ...] (optimus_core.config)
    keep_stage(model, cfg.parallel.rank_stages(mesh.pp_rank), layers)   # a meta model pruned to this rank's stages
    ...                                           # then parallelized and materialised as a whole model is
    pipe = Pipeline(model, mesh.stage, cfg.parallel, micro_batches=4, act_dtype=torch.bfloat16)
    out = pipe.step(batch_BS1, sync=optimizer.before_micro_batch)  # every micro-batch's forward and
                                                  # backward, 1F1B order; each stage's last reduces

A stage keeps the blocks of its layers under their own names (``blocks.<layer>``), so its
parameters' names, their seeded init and their checkpoint keys are those of the whole model;
the first stage also keeps the embedding, the last the final norm and the LM head (and so the
loss). Between stages travel the residual stream and, for an MoE model, one small vector of
routing sums (``add_routing_sums``): each stage adds its layers' routing shares, mean router
probabilities, per-layer load-balancing terms and z-losses, and the last stage makes the
auxiliary loss of every layer from them, exactly as one process does over all its layers
(Transformer.aux_loss). The gradient of that loss flows back through the same vector to each
stage's routers: the authors pass the router outputs down the pipeline for the same reason.

The schedule is torch's (torch.distributed.pipelining): ``Schedule1F1B`` over the ``pp``
consecutive stages of the pipeline group (the ranks that hold the same data and experts, one
per stage), or ``ScheduleInterleaved1F1B`` where each rank holds ``pp_chunks`` stages (rank r
stages r, r + pp, ...: parallel.pp_schedule "interleaved_1f1b"), each a module of its own over
the rank's one (pruned) model, its layers run by ``Transformer.hidden(layers=...)``. Each
micro-batch's loss is weighted by its token share (the schedule does not scale the gradients
again), so a step's gradients are those of the mean loss over the rank's batch, as without
stages. The stages' shapes are given to the schedule up front: no trial forward runs.

Sharded stages synchronise their gradients as a sharded model without stages does over its
micro-batches (optimus_core.train.sharded_adamw): before each stage's backward of a micro-batch
its units learn whether it is the stage's last, so the replicas' all-reduce and, with the
weights gathered once a step, the reduction and the freeing wait for that last backward.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from ..model.linear_cross_entropy import DEFAULT_CHUNK_ROWS
from ..model.moe import MoEFeedForward
from .mesh import Mesh

def keep_stage(model: nn.Module, stages: list[int], layers: list[tuple[int, int]]) -> nn.Module:
    """Prune a (meta-built) Transformer in place to the ``stages`` of ``layers`` (every stage's
    [first, stop)) a rank holds: their blocks, the embedding with the first stage, the final norm
    and the LM head with the last. Returns it."""
    kept = {i for s in stages for i in range(*layers[s])}
    for key in list(model.blocks.keys()):
        if int(key) not in kept:
            del model.blocks[key]
    if 0 not in stages:
        model.embed = None
    if len(layers) - 1 not in stages:
        model.final_norm = None
        model.lm_head = None
    return model


def routing_sums_size(n_experts: int) -> int:
    """Elements of the routing sums (add_routing_sums) of a model of ``n_experts`` experts."""
    return 2 * n_experts + 2


def add_routing_sums(layers: list[MoEFeedForward], sums: torch.Tensor | None) -> torch.Tensor:
    """``sums`` plus those of ``layers``' last forward, a new float32 tensor (``layers``' own
    where ``sums`` is None), graph-connected through the probabilities. For E experts, the sums
    over the layers of: each layer's share of assignments per expert (E, no gradient), its mean
    router probability per expert (E), its per-layer load-balancing term E sum_e f_e P_e (1)
    and its z-loss (1)."""
    counts_LE = torch.stack([m.last_tokens_per_expert_E for m in layers]).float()
    share_LE = counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1)  # as Transformer.routing_shares
    probs_LE = torch.stack([m.last_mean_probs_E for m in layers]).float()
    E = probs_LE.shape[1]
    per_layer = (E * (share_LE * probs_LE).sum(-1)).sum()
    z = torch.stack([m.last_z_loss for m in layers]).float().sum()
    mine = torch.cat([share_LE.sum(0), probs_LE.sum(0), per_layer.view(1), z.view(1)])
    return mine if sums is None else sums + mine


def aux_from_routing_sums(sums: torch.Tensor, moe_cfg,
                          n_moe_layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux, lb, z) of all ``n_moe_layers`` MoE layers (an MoE model's every layer) from the
    pipeline's routing sums, as Transformer.aux_loss, lb_loss and the z-loss mean make them on
    one process (lb and z unscaled)."""
    E, L = moe_cfg.n_experts, n_moe_layers
    shares, probs, per_layer, z = sums[:E], sums[E:2 * E], sums[2 * E], sums[2 * E + 1]
    if moe_cfg.lb_loss_form == "all_layers":
        lb = E * moe_cfg.top_k * ((shares / L) * (probs / L)).sum()
    else:
        lb = per_layer / L
    z = z / L
    return moe_cfg.lb_loss_coef * lb + moe_cfg.z_loss_coef * z, lb, z


@functools.cache
def _stage_class():
    """torch's PipelineStage that calls ``before_backward(micro_batch)`` before its backward of
    each micro-batch (the schedules run them in micro-batch order), made at first use: torch's
    pipelining is imported only by runs with stages."""
    from torch.distributed.pipelining import PipelineStage

    class SyncedStage(PipelineStage):
        def __init__(self, *args, before_backward: Callable[[int], None], **kwargs):
            super().__init__(*args, **kwargs)
            self.before_backward = before_backward

        def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
            self.before_backward(bwd_chunk_id)
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    return SyncedStage


class StageModule(nn.Module):
    """One stage's forward as the schedule calls it: tokens (first stage) or the previous stage's
    (hidden states, routing sums) in; (hidden states in ``act_dtype``, routing sums) out, or on
    the last stage the micro-batch's weighted objective (cross entropy + auxiliary loss), its
    parts kept in ``parts`` for the step's statistics. ``model``: the rank's Transformer
    (keep_stage), parallelized; its forward methods are FSDP2's where it is sharded; ``layers``:
    this stage's (default: every layer the model holds). ``autocast``: the run's autocast
    context (a no-argument callable)."""

    def __init__(self, model: nn.Module, *, first: bool, last: bool, weight: float, act_dtype: torch.dtype,
                 layers: range | None = None, autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS):
        super().__init__()
        self.model, self.first, self.last, self.weight = model, first, last, weight
        self.act_dtype, self.autocast, self.chunk_rows = act_dtype, autocast, chunk_rows
        held = sorted(int(k) for k in model.blocks.keys())
        self.layers = layers if layers is not None else range(held[0], held[-1] + 1)
        # the index in the whole model of each of this stage's MoE layers, and those layers
        self.layer_ids = [i for i in self.layers if isinstance(model.blocks[str(i)].ffn, MoEFeedForward)]
        self.moe = [model.blocks[str(i)].ffn for i in self.layer_ids]
        self.parts: list[torch.Tensor] = []  # last stage: per micro-batch (ce, aux, lb, z), detached
        self.counts: list[torch.Tensor] = []  # per micro-batch: (this stage's MoE layers, E) counts

    def forward(self, x, sums=None, targets=None):
        with self.autocast():
            return self._forward(x, sums, targets)

    def _forward(self, x, sums, targets):
        moe = self.moe
        if self.last:
            ce = self.model.lm_loss(x, targets, chunk_rows=self.chunk_rows, layers=self.layers)
        else:  # as the next stage expects it (a no-op as planned)
            h = self.model.hidden(x, layers=self.layers).to(self.act_dtype)
        if moe:
            sums = add_routing_sums(moe, sums)
            self.counts.append(torch.stack([m.last_tokens_per_expert_E for m in moe]).detach())
            for layer in moe:  # read: the sums hold what the backward needs
                layer.clear_routing()
        if not self.last:
            return (h, sums) if sums is not None else h
        if sums is not None:
            cfg = self.model.cfg
            aux, lb, z = aux_from_routing_sums(sums, cfg.moe, cfg.n_layers)
            objective = ce + aux
            self.parts.append(torch.stack([ce.detach(), aux.detach(), lb.detach(), z.detach()]))
        else:
            objective = ce
            self.parts.append(torch.stack([ce.detach(), torch.zeros_like(ce), torch.zeros_like(ce),
                                           torch.zeros_like(ce)]))
        return (objective * self.weight).reshape(1)  # (1,): the schedule concatenates the micro-batches' outputs


@dataclass
class PipelineStep:
    """What one rank's pipeline step gives back: the step's (ce, aux, lb, z), means over its
    micro-batches (last stage; zeros elsewhere), and this stage's MoE counts summed over them,
    one row per layer of the whole model (zeros for other stages' layers); None for a dense model."""

    sums_4: torch.Tensor
    counts_LE: torch.Tensor | None


class Pipeline:
    """This rank's stages of the pipeline and their schedule (module doc). ``mesh``: the stage
    mesh (Mesh.stage); ``parallel``: the run's parallel section (the cut, the schedule);
    ``micro_batches`` a step; ``act_dtype``: the residual stream's between stages (the plan's)."""

    def __init__(self, model: nn.Module, mesh: Mesh, parallel, *, micro_batches: int, act_dtype: torch.dtype,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS):
        parallel.check_micro_batches(micro_batches)
        self.mesh, self.model, self.micro_batches, self.act_dtype = mesh, model, micro_batches, act_dtype
        self.n_layers = model.cfg.n_layers
        layers = parallel.stage_layers(self.n_layers)
        self.stage_ids = parallel.rank_stages(mesh.pp_rank)
        self.n_stages = len(layers)
        self.first, self.last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        self.interleaved = parallel.pp_chunks > 1
        self.modules = [StageModule(model, first=s == 0, last=s == self.n_stages - 1, weight=1.0 / micro_batches,
                                    act_dtype=act_dtype, layers=range(*layers[s]), autocast=autocast,
                                    chunk_rows=chunk_rows) for s in self.stage_ids]
        self._schedule, self._shape = None, None
        self._sync = None  # this step's (step)

    @property
    def layer_ids(self) -> list[int]:
        """The index in the whole model of each MoE layer this rank holds, in order."""
        return [i for m in self.modules for i in m.layer_ids]

    def _schedule_for(self, micro_batch: int, seq_len: int):
        """The schedule for micro-batches of (micro_batch, seq_len) tokens, made at the first step
        (and again should the shape change), with every stage's inputs and outputs given as the
        schedule sees them (shapes, dtypes, and that the floating ones carry gradients), so that
        it runs no trial forward to learn them."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

        if self._shape != (micro_batch, seq_len):
            cfg, mesh, meta = self.model.cfg, self.mesh, torch.device("meta")
            tokens = torch.empty(micro_batch, seq_len, dtype=torch.long, device=meta)
            hidden = torch.empty(micro_batch, seq_len, cfg.d_model, dtype=self.act_dtype, device=meta,
                                 requires_grad=True)
            sums = (torch.empty(routing_sums_size(cfg.moe.n_experts), device=meta, requires_grad=True),) \
                if cfg.moe else ()
            stages = []
            for s, module in zip(self.stage_ids, self.modules):
                inputs = (tokens,) if module.first else (hidden, *sums)
                outputs = (torch.empty(1, device=meta, requires_grad=True),) if module.last else (hidden, *sums)
                stages.append(_stage_class()(module, s, self.n_stages, mesh.device, input_args=inputs,
                                             output_args=outputs, group=mesh.pp_group,
                                             before_backward=functools.partial(self._before_backward, module)))
            loss = lambda out, _target: out.sum()  # noqa: E731  (the last stage's output is the weighted objective)
            if self.interleaved:
                self._schedule = ScheduleInterleaved1F1B(stages, self.micro_batches, loss_fn=loss, scale_grads=False)
            else:
                self._schedule = Schedule1F1B(stages[0], self.micro_batches, loss_fn=loss, scale_grads=False)
            self._shape = (micro_batch, seq_len)
        return self._schedule

    def _before_backward(self, module: StageModule, micro_batch: int) -> None:
        """Before ``module``'s backward of ``micro_batch``: the step's gradient synchronisation
        settings for its layers' units (``sync`` of step)."""
        if self._sync is not None:
            self._sync(micro_batch == self.micro_batches - 1, module.layers)

    def step(self, batch_BS1: torch.Tensor,
             sync: Callable[[bool, Collection[int] | None], None] | None = None) -> PipelineStep:
        """Every micro-batch's forward and backward of this rank's share ``batch_BS1`` (B
        sequences of S+1 tokens, B = micro_batches x micro_batch), in the schedule's order; the
        gradients stay on the parameters, the update is the caller's. ``sync(last, layers)``
        (ShardedAdamW.before_micro_batch) sets how the backwards synchronise the gradients: once
        for every layer (not last) before the step, then before each stage's backward of a
        micro-batch for that stage's layers, ``last`` for its last micro-batch: so the replicas'
        all-reduce, and under per-step gathers the reduction and the freeing, wait for each
        stage's last backward."""
        tokens_BS, targets_BS = batch_BS1[:, :-1].contiguous(), batch_BS1[:, 1:].contiguous()
        B, S = tokens_BS.shape
        if B % self.micro_batches:
            raise ValueError(f"pipeline: {B} sequences do not split into {self.micro_batches} micro-batches")
        schedule = self._schedule_for(B // self.micro_batches, S)
        for module in self.modules:
            module.parts.clear()
            module.counts.clear()
        self._sync = sync
        if sync is not None:
            sync(False, None)
        args = (tokens_BS,) if self.first else ()
        kwargs = {"targets": targets_BS} if self.last else {}
        # the targets go to the last stage's forward (its loss is fused with the LM head); the
        # schedule's own target only keys its loss function, which passes the objective on
        schedule.step(*args, target=targets_BS if self.last else None, **kwargs)
        device = batch_BS1.device
        sums_4 = torch.zeros(4, dtype=torch.float64, device=device)
        if self.last:
            sums_4 += torch.stack(self.modules[-1].parts).double().mean(0)
        counts = None
        if self.model.cfg.moe is not None:
            counts = torch.zeros(self.n_layers, self.model.cfg.moe.n_experts, dtype=torch.long, device=device)
            for module in self.modules:
                if module.counts:
                    counts[module.layer_ids] = torch.stack(module.counts).sum(0).to(counts.dtype)
        self.model.clear_routing()  # a recomputed forward sets them again
        return PipelineStep(sums_4, counts)

    @torch.no_grad()
    def loss_sum(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        """The summed next-token cross entropy of ``batch_BS1`` (float64, 0-d, on every rank of the
        pipeline): one forward through the stages in order, without the schedule (an evaluation;
        every rank of the pipeline calls it with the same batch)."""
        import torch.distributed as dist
        import torch.nn.functional as F

        tokens_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
        B, S = tokens_BS.shape
        ranks, pp = self.mesh.pp_ranks, self.mesh.pp
        total = torch.zeros((), dtype=torch.float64, device=batch_BS1.device)
        with self.modules[0].autocast():
            for s, module in zip(self.stage_ids, self.modules):
                if module.first:
                    x = tokens_BS
                else:  # from the rank of the stage before
                    x = torch.empty(B, S, self.model.cfg.d_model, dtype=self.act_dtype, device=batch_BS1.device)
                    dist.recv(x, src=ranks[(s - 1) % pp])
                if module.last:
                    logits = self.model(x, layers=module.layers)
                    total = F.cross_entropy(logits.float().flatten(0, 1), targets_BS.flatten(),
                                            reduction="sum").double()
                else:
                    dist.send(self.model.hidden(x, layers=module.layers).to(self.act_dtype).contiguous(),
                              dst=ranks[(s + 1) % pp])
        self.model.clear_routing()
        return self.mesh.all_reduce_pipeline_sum_(total)
