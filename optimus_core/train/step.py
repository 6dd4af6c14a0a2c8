"""One optimizer step: forward, loss, backward over micro-batches, clip, update. Nothing else.

Checkpointing, evaluation and metrics hook in around it (optimus_core.train.loop).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from ..model.linear_cross_entropy import DEFAULT_CHUNK_ROWS
from ..model.transformer import Transformer
from ..timing import phase
from .load_balance import GlobalShares
from .optim import clip_and_step

if TYPE_CHECKING:
    from ..config import RunConfig


@dataclass
class StepStats:
    loss: float  # language-model cross entropy, mean over the step's tokens
    aux_loss: float  # MoE auxiliary losses as added to the objective (0 for dense)
    lb_loss: float  # unscaled load-balancing loss as model.moe.lb_loss_form defines it (nan for dense)
    z_loss: float  # unscaled router z-loss, mean over MoE layers (nan for dense)
    grad_norm: float | torch.Tensor  # a 0-d tensor until read: reading it waits for the backward
    tokens_per_expert_LE: torch.Tensor | None  # routing counts of the step, per MoE layer
    skipped: bool = False  # the loss was rejected: no update was made
    # this rank's own (ce, aux, lb, z) sums before the mean over the ranks, a device tensor read
    # only when the world's loss is not finite: which ranks made it so (optimus_core.train.node_faults)
    local_sums: torch.Tensor | None = None


def autocast_context(device_type: str, dtype: str):
    """bf16 autocast with float32 master weights and optimizer state; float32 runs as is."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def micro_batch_loss(model: Transformer, batch_BS1: torch.Tensor, *, dtype: str,
                     chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """The language-model loss of one micro-batch (float32, 0-d), next-token targets: the LM head
    and the loss in chunks of ``chunk_rows`` tokens, no logits of the whole micro-batch
    (Transformer.lm_loss; the same value as the logits, then ``lm_loss``)."""
    tokens_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with autocast_context(batch_BS1.device.type, dtype):  # the head's matmuls in bf16, as nn.Linear's
        return model.lm_loss(tokens_BS, targets_BS, chunk_rows=chunk_rows)


def clip_at(step: int, cfg: "RunConfig") -> float | None:
    """The clipping norm of optimizer step ``step`` (0-based): ``optim.grad_clip``, or None (no
    clipping) before the end of the warmup where ``optim.clip_after_warmup`` says so."""
    if cfg.optim.clip_after_warmup and step < cfg.schedule.warmup_steps:
        return None
    return cfg.optim.grad_clip


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batch_BS1: torch.Tensor, *,
               micro_batch: int, grad_clip: float | None, lr: float, dtype: str, mesh=None,
               accept: Callable[[float], bool] | None = None,
               lm_loss_chunk_rows: int = DEFAULT_CHUNK_ROWS) -> StepStats:
    """Accumulate gradients over ``batch_BS1`` (B sequences of S+1 tokens) in micro-batches.

    With a distributed ``mesh`` (optimus_core.parallel.Mesh), ``batch_BS1`` is this rank's share
    of the global batch; the returned losses are means over the world and the routing counts
    sums over it, so every rank (and its balance bias) sees the numbers of the global batch.
    An optimizer that ``syncs_gradients`` (ShardedAdamW) reduces, clips and updates itself.
    ``accept(loss)`` (a LossGuard) may reject the step's loss: the gradients are then dropped
    and nothing is updated. It sees the world-mean loss, so every rank decides alike.
    ``dtype``: the execution plan's (optimus_core.execution). The loss is taken without the
    micro-batch's full logits, ``lm_loss_chunk_rows`` tokens at a time (micro_batch_loss).
    With ``model.moe.lb_loss_scope = "global"`` each micro-batch's load-balancing loss counts the
    assignments of every rank and of the step's micro-batches so far (optimus_core.train.load_balance).
    """
    model.train()
    chunks = batch_BS1.split(micro_batch) if micro_batch else (batch_BS1,)
    if len(chunks) > 1 and any(c.requires_grad for c in getattr(optimizer, "casts", {}).values()):
        raise ValueError(f"train_step: {len(chunks)} micro-batches, but the expert gradients are kept in bf16 "
                         "(the execution plan's, for one micro-batch a step), where they would add up in bf16")
    n_tokens = batch_BS1.shape[0] * (batch_BS1.shape[1] - 1)
    moe_layers = model.moe_layers()
    # ce, aux, lb, z: summed as device tensors and read once per step, so the micro-batches
    # queue back to back on a GPU (an .item() each would stall the host until the device drains).
    sums_4 = torch.zeros(4, dtype=torch.float64, device=batch_BS1.device)
    load_LE = None
    shares = GlobalShares(mesh) if moe_layers and model.cfg.moe.lb_loss_scope == "global" else None
    with phase("compute"):
        for i, chunk in enumerate(chunks):
            weight = chunk.shape[0] * (chunk.shape[1] - 1) / n_tokens  # token share of this chunk
            last = i == len(chunks) - 1
            if hasattr(optimizer, "before_micro_batch"):
                optimizer.before_micro_batch(last)  # ShardedAdamW: the replicas' all-reduce on the last only
            if last:  # the last backward: gradients are final as they are done
                if getattr(optimizer, "grad_norms", None) is not None:
                    optimizer.grad_norms.arm()  # their norms for the clip, under the backward
            ce = micro_batch_loss(model, chunk, dtype=dtype, chunk_rows=lm_loss_chunk_rows)
            share_LE = shares.add(torch.stack([m.last_tokens_per_expert_E for m in moe_layers])) if shares else None
            aux = model.aux_loss(share_LE)
            objective = ce + aux if aux is not None else ce
            (objective * weight).backward()
            with torch.no_grad():
                if moe_layers:
                    lb = model.lb_loss(share_LE).detach()
                    z = torch.stack([m.last_z_loss.detach() for m in moe_layers]).mean()
                    sums_4 += torch.stack([ce.detach(), aux.detach(), lb, z]).double() * weight
                    counts = torch.stack([m.last_tokens_per_expert_E for m in moe_layers])
                    load_LE = counts if load_LE is None else load_LE + counts
                else:
                    sums_4[0] += ce.detach().double() * weight
            model.clear_routing()  # read and back-propagated (a recompute set them again): drop the graph

    local_4 = sums_4
    if mesh is not None and mesh.distributed:
        with phase("grad_sync"):  # a few numbers: latency, counted with the gradient traffic
            local_4 = sums_4.clone()
            sums_4 = mesh.all_reduce_sum_(sums_4) / mesh.world_size
            if load_LE is not None:
                mesh.all_reduce_sum_(load_LE)
    return _update(model, optimizer, sums_4, load_LE, list(range(len(moe_layers))), grad_clip=grad_clip, lr=lr,
                   accept=accept, local_4=local_4)


def pipeline_train_step(pipe, optimizer: torch.optim.Optimizer, batch_BS1: torch.Tensor, *,
                        grad_clip: float | None, lr: float, mesh,
                        accept: Callable[[float], bool] | None = None) -> StepStats:
    """``train_step`` for one rank's stage of a pipeline (optimus_core.parallel.pipeline.Pipeline
    ``pipe``): every micro-batch of ``batch_BS1`` (this rank's share of the global batch, read
    alike by every stage of its pipeline) through the schedule, then the same statistics, guard
    and update. ``mesh``: the whole world's (its stage mesh is ``mesh.stage``); the losses are
    the last stages' means over the data-parallel ranks, the routing counts those of every
    layer, on every rank; the clip's norm spans the stages. The stages compute under the run's
    autocast (the Pipeline's)."""
    model = pipe.model
    model.train()
    with phase("compute"):  # ShardedAdamW: when the stages' backwards reduce (Pipeline.step)
        out = pipe.step(batch_BS1, sync=getattr(optimizer, "before_micro_batch", None))
    sums_4, load_LE = out.sums_4, out.counts_LE
    local_4 = sums_4.clone()  # a last stage's losses; zeros on the others
    with phase("grad_sync"):  # every stage's part: the others add zeros
        sums_4 = mesh.all_reduce_sum_(sums_4) / mesh.data_world
        if load_LE is not None:
            mesh.all_reduce_sum_(load_LE)
    return _update(model, optimizer, sums_4, load_LE, pipe.layer_ids, grad_clip=grad_clip, lr=lr,
                   accept=accept, sum_squares=mesh.stage.all_reduce_pipeline_sum_, local_4=local_4)


def _update(model: Transformer, optimizer, sums_4: torch.Tensor, load_LE: torch.Tensor | None,
            layer_ids: list[int], *, grad_clip: float | None, lr: float, accept, sum_squares=None,
            local_4: torch.Tensor | None = None) -> StepStats:
    """The step after its backward: the guard's verdict on the loss, the clip and the update,
    each MoE layer's balance bias from its row ``layer_ids[i]`` of ``load_LE``; the stats
    (``local_4``: this rank's sums before the mean over the ranks)."""
    moe_layers = model.moe_layers()
    moe = load_LE is not None
    nan = float("nan")
    if accept is not None:  # the guard needs the loss before the update: the host waits here
        loss_sum, aux_sum, lb_sum, z_sum = sums_4.tolist()
        if not accept(loss_sum):
            if getattr(optimizer, "grad_norms", None) is not None:
                optimizer.grad_norms.disarm()
            optimizer.zero_grad(set_to_none=True)
            return StepStats(loss_sum, aux_sum, lb_sum if moe else nan, z_sum if moe else nan,
                             nan, load_LE, skipped=True, local_sums=local_4)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if getattr(optimizer, "syncs_gradients", False):
        grad_norm = optimizer.clip_and_step(grad_clip)  # marks its own phases
    else:
        with phase("optimizer"):
            grad_norm = clip_and_step(model, optimizer, grad_clip, sum_squares)
    optimizer.zero_grad(set_to_none=True)
    for layer, row in zip(moe_layers, layer_ids):
        layer.router.update_balance_bias(load_LE[row])
    if accept is None:  # read once the update is queued, so the device does not idle before it
        loss_sum, aux_sum, lb_sum, z_sum = sums_4.tolist()
    return StepStats(loss_sum, aux_sum, lb_sum if moe else nan, z_sum if moe else nan, grad_norm, load_LE,
                     local_sums=local_4)
