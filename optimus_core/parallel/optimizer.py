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

Gradients are the mean over the world's tokens: the reduced sums are divided by W. That is
right for experts too: an expert's local grad already sums the contributions of the whole EP
group (the all-to-all backward brought them home), so summing over the expert-dp group covers
all W ranks once. The division rides in the update kernel's ``grad_scale`` with the clip factor
(a fused optimizer; others get one in-place scale), not in a pass of its own over every
gradient (3.7 ms of device time per step on an H200 at EP=2, bench/NOTES.md). The global grad
norm sums the squares of the reduced shards over the world, divided by W; a replicated
(ep_unaware) expert bucket counts only on expert-dp rank 0, so every parameter is counted
exactly once. The update itself is torch.optim.AdamW's arithmetic on the shard tensors
(torch's or TritonAdamW, optim.implementation).

Local buckets (an expert-dp group of one rank, as at EP = world size, or any bucket of a
one-rank world) reduce nothing, so they keep no flat gradient buffer: backward hands each
parameter its gradient as a fresh tensor, as on one GPU, and TritonAdamW updates the flat shard
a parameter's range at a time (``grad_pieces``). A flat buffer costs a zero fill and backward's
accumulation into it (r 8, w 4 per element: 7.2 ms of device time per step at EP=2 on an H200,
over every bucket) and its memory for the whole step (6.0 GiB per rank there for the experts).
torch's AdamW, which takes one gradient per tensor, gets them concatenated.

Weight casts (optimus_core.train.optim.weight_casts: the experts' bf16 copies under
train.expert_weight_casts): a bucket whose parameters all have copies of one dtype gets a flat
copy buffer ``cast_N`` in flat_N's layout, the copies becoming views of it. Where a rank's shard
is the whole bucket (an expert-dp group of one rank, as at EP = world size, or ep_unaware) the
update writes it in the same pass; elsewhere it is cast from flat_N after the all-gather.

With ``overlap=True`` the reduction runs under the backward instead of after it
(optimus_core.parallel.grad_sync: chunks of about ``chunk_mb`` MiB, each reduced onto its owners
as soon as the last micro-batch's backward has produced it); ``train_step`` calls
``arm_grad_sync()`` before that backward. The shards, state and results are the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import OptimConfig
from .expert_parallel import expert_parameter_names
from .grad_sync import OverlappedGradSync
from ..timing import phase
from ..model.experts import refresh_casts
from ..train.optim import adamw, clip_coef_as_grad_scale, is_fused, step_with_grad_scale, weight_casts
from .mesh import Mesh


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _chunk(numel: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of piece ``index`` of ``numel`` elements split in ``parts`` the way torch.chunk
    and DTensor's Shard(0) split them (pieces of ceil(numel / parts), the last ones short or empty)."""
    size = -(-numel // parts)
    lo = min(index * size, numel)
    return lo, min(lo + size, numel)


@dataclass
class Bucket:
    """One flat buffer of parameters that share a sync rule and a weight decay."""

    name: str  # dense.decay | dense.no_decay | expert.decay | expert.no_decay
    params: list[nn.Parameter]
    flat_N: torch.Tensor  # padded to a multiple of group_size; the params are views of it
    grad_N: torch.Tensor | None  # same layout, the params' .grad views of it; None for a local bucket
    shard: torch.Tensor  # this rank's slice of flat_N (a view: what AdamW updates in place)
    group: object  # process group (None = the world)
    group_size: int
    group_rank: int
    sharded: bool  # False: all-reduce grads, full replicated state (ep_unaware experts)
    counts_in_norm: bool  # False on replicas whose squares another rank already counts
    cast_N: torch.Tensor | None = None  # the params' low-precision copies, flat_N's layout (or None)

    @property
    def whole_shard(self) -> bool:
        """This rank updates the whole bucket (nothing to gather)."""
        return not (self.sharded and self.group_size > 1)

    @property
    def local(self) -> bool:
        """A group of one rank: nothing to reduce, so no flat gradient buffer (module doc)."""
        return self.group_size == 1

    @classmethod
    def build(cls, name, params, group, group_size, group_rank, sharded, counts_in_norm, casts=None):
        numel = sum(p.numel() for p in params)
        shards = group_size if sharded else 1
        # Shards of whole 16-element (64-byte) blocks: every shard starts aligned for the update
        # kernel's vector loads.
        shard_len = -(-numel // (shards * 16)) * 16
        flat_N = torch.zeros(shard_len * shards, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:  # the model's parameters become views of the flat buffer
            flat_N[offset:offset + p.numel()].copy_(p.detach().flatten())
            p.data = flat_N[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        lo = group_rank * shard_len if sharded else 0
        # A view, not a copy: whatever writes the parameters (a checkpoint load) writes the shard.
        shard = flat_N[lo:lo + shard_len]
        grad_N = None if group_size == 1 else torch.empty_like(flat_N)  # zeroed by zero_grad below
        bucket = cls(name, params, flat_N, grad_N, shard, group, group_size, group_rank, sharded, counts_in_norm)
        bucket.zero_grad()
        copies = [(casts or {}).get(p) for p in params]
        if all(c is not None for c in copies) and len({c.dtype for c in copies}) == 1:
            bucket.cast_N = flat_N.to(copies[0].dtype, copy=True)
            offset = 0
            for p, copy in zip(params, copies):  # the module's copies become views of cast_N
                copy.data = bucket.cast_N[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return bucket

    def attach_grads(self) -> None:
        """Make every parameter's .grad a view of grad_N: backward accumulates straight into the
        flat buffer the collectives send, so no gradient is copied before the reduction."""
        offset = 0
        for p in self.params:
            p.grad = self.grad_N[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def zero_grad(self) -> None:
        if self.local:  # the next backward makes fresh gradients (none is accumulated into)
            for p in self.params:
                p.grad = None
            return
        self.grad_N.zero_()
        base = self.grad_N.untyped_storage().data_ptr()
        if any(p.grad is None or p.grad.untyped_storage().data_ptr() != base for p in self.params):
            self.attach_grads()  # someone replaced a .grad (model.zero_grad()): views again

    def grad_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """A local bucket's gradient as [(offset in the shard, gradient)], one per parameter
        (zeros for a parameter the backward did not reach, as a flat buffer would hold)."""
        pieces, offset = [], 0
        for p in self.params:
            pieces.append((offset, p.grad if p.grad is not None else torch.zeros_like(p)))
            offset += p.numel()
        return pieces

    def reduce_grad(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's reduced gradient shard, the sum over the group, as pieces."""
        if self.local:
            return self.grad_pieces()
        if not self.sharded:
            dist.all_reduce(self.grad_N, group=self.group)
            return [(0, self.grad_N)]
        grad_shard = torch.empty_like(self.shard)
        _reduce_scatter(grad_shard, self.grad_N, self.group)
        return [(0, grad_shard)]

    def reduced_grad(self) -> list[tuple[int, torch.Tensor]]:
        """After an overlapped reduction (grad_sync.py, which reduces onto each owner's range of
        grad_N in place): this rank's reduced shard, as pieces."""
        if self.local:
            return self.grad_pieces()
        if self.sharded:
            lo = self.group_rank * self.shard.numel()
            return [(0, self.grad_N[lo:lo + self.shard.numel()])]
        return [(0, self.grad_N)]

    def publish(self) -> None:
        """Bring every rank's updated shard into the flat buffer (the params see it)."""
        if self.sharded and self.group_size > 1:
            # The input is this rank's slice of the output. NCCL gathers in place when the input
            # sits at output + rank * count (its documented in-place mode); other backends get a
            # copy of the shard, which they may read while writing the output.
            inplace = self.flat_N.device.type == "cuda"
            _all_gather(self.flat_N, self.shard if inplace else self.shard.detach().clone(), self.group)
            if self.cast_N is not None:  # one cast pass (an all-gather of the copies moves more)
                self.cast_N.copy_(self.flat_N)


def bucket_params(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """The non-empty buckets in their fixed order, (dense | expert) x (decay | no_decay): the
    layout of ShardedAdamW's flat buffers and of the optimizer keys in sharded checkpoints."""
    experts = expert_parameter_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = []
    for kind in ("dense", "expert"):
        for decay in (True, False):
            params = [p for n, p in named if (n in experts) == (kind == "expert") and (p.ndim >= 2) == decay]
            if params:
                out.append((f"{kind}.{'decay' if decay else 'no_decay'}", params))
    return out


class ShardedAdamW:
    """AdamW with ZeRO-1 sharding that knows which parameters are experts (see module doc)."""

    syncs_gradients = True  # train_step: call clip_and_step instead of clipping itself

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: OptimConfig, mode: str = "ep_aware", *,
                 overlap: bool = False, chunk_mb: float = 128.0):
        if mode not in ("ep_aware", "ep_unaware"):
            raise ValueError(f"parallel.optimizer = {mode!r}: must be 'ep_aware' or 'ep_unaware'")
        if chunk_mb <= 0:
            raise ValueError(f"parallel.grad_sync_chunk_mb = {chunk_mb}: must be > 0 (MiB)")
        self.mesh, self.mode = mesh, mode
        self.buckets: list[Bucket] = []
        casts = weight_casts(model)
        for name, params in bucket_params(model):
            if name.startswith("dense"):
                args = (None, mesh.world_size, mesh.rank, True, True)
            else:
                aware = mode == "ep_aware"
                args = (mesh.expert_dp_group, mesh.expert_dp_size, mesh.expert_dp_rank, aware,
                        aware or mesh.expert_dp_rank == 0)
            self.buckets.append(Bucket.build(name, params, *args, casts=casts))
        bucketed = {id(casts[p]) for b in self.buckets if b.cast_N is not None for p in b.params}
        # Copies in a bucket of mixed copies (none so far): each refreshed after the all-gather.
        self.loose_casts = {p: c for p, c in casts.items() if id(c) not in bucketed}
        groups = [{"params": [b.shard], "weight_decay": cfg.weight_decay if b.name.endswith(".decay") else 0.0}
                  for b in self.buckets]
        # One flat shard per group, updated in one pass: TritonAdamW or torch's fused kernel on a
        # GPU (optim.implementation); elsewhere torch's single-tensor loop. Same arithmetic.
        # A shard that is its whole bucket has its copy written by the update (TritonAdamW: in
        # the same kernel); the others are cast in publish(), after the all-gather.
        self.inner = adamw(groups, cfg, self.buckets[0].flat_N.device,
                           {b.shard: b.cast_N for b in self.buckets if b.cast_N is not None and b.whole_shard})
        self.param_groups = self.inner.param_groups  # the loop sets "lr" here each step
        self.grad_sync = None
        if overlap and not all(b.local for b in self.buckets):
            order_of = {id(p): i for i, p in enumerate(model.parameters())}
            world = tuple(range(mesh.world_size))
            ranks = {id(b): world if b.group is None else mesh.expert_dp_ranks for b in self.buckets}
            self.grad_sync = OverlappedGradSync(self.buckets, order_of, int(chunk_mb * 2**20), ranks)

    def arm_grad_sync(self) -> None:
        """The next backward is the step's last: with overlap, reduce gradients as it goes."""
        if self.grad_sync is not None:
            self.grad_sync.arm()

    @torch.no_grad()
    def clip_and_step(self, max_norm: float | None) -> torch.Tensor:
        """Reduce grads, clip by the global norm (returned, before clipping), update, all-gather."""
        world = self.mesh.world_size
        with phase("grad_sync"):
            if self.grad_sync is not None:  # mostly done under the backward: wait for the rest
                self.grad_sync.finish()
                grads = [b.reduced_grad() for b in self.buckets]
            else:
                grads = [b.reduce_grad() for b in self.buckets]
        with phase("optimizer"):
            # Sums over the ranks: the mean gradient is grads / world (module doc).
            counted = [g for b, pieces in zip(self.buckets, grads) if b.counts_in_norm for _, g in pieces]
            sq = torch.zeros((), dtype=torch.float64, device=self.buckets[0].flat_N.device)
            if counted:  # a float32 norm per tensor, squared and summed in float64
                sq += torch.stack(torch._foreach_norm(counted)).double().square().sum()
            norm = (self.mesh.all_reduce_sum_(sq).sqrt() / world).float()
            for b, pieces in zip(self.buckets, grads):
                if len(pieces) == 1 and pieces[0][1].numel() == b.shard.numel():
                    b.shard.grad = pieces[0][1].reshape(-1)
                elif hasattr(self.inner, "grad_pieces"):  # TritonAdamW: a parameter's range at a time
                    self.inner.grad_pieces[b.shard] = pieces
                else:  # torch's AdamW, one gradient per tensor: concatenated, the padding zero
                    end = pieces[-1][0] + pieces[-1][1].numel()
                    b.shard.grad = torch.cat([g.reshape(-1) for _, g in pieces] + [b.shard.new_zeros(b.shard.numel() - end)])
            if is_fused(self.inner):  # the mean and the clip factor ride into the update kernel
                divisor = clip_coef_as_grad_scale(norm, max_norm) if max_norm is not None else None
                if world > 1:
                    divisor = (norm.new_ones(()) if divisor is None else divisor) * world
                if divisor is None:
                    self.inner.step()
                else:
                    step_with_grad_scale(self.inner, divisor)
            else:  # torch's single-tensor AdamW (no GPU): every shard has its .grad, scaled in place
                coef = norm.new_ones(()) / world
                if max_norm is not None:  # as torch.nn.utils.clip_grad_norm_
                    coef = coef * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
                if world > 1 or max_norm is not None:
                    torch._foreach_mul_([b.shard.grad for b in self.buckets], coef)
                self.inner.step()
            for b in self.buckets:
                b.shard.grad = None
            getattr(self.inner, "grad_pieces", {}).clear()
        with phase("grad_sync"):
            for b in self.buckets:
                b.publish()
        refresh_casts(self.loose_casts)
        return norm

    def step(self) -> None:
        """torch.optim-style step without clipping."""
        self.clip_and_step(None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers and drop the local buckets' gradients (``set_to_none``
        is accepted and ignored: the parameters' .grad stay views of the buffers the next
        reduction reads, and local buckets always drop theirs)."""
        if self.grad_sync is not None:  # a skipped step: reductions may be in flight on the buffers
            self.grad_sync.settle()
        for b in self.buckets:
            b.zero_grad()

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

    def state_dict(self, sharded: bool = False) -> dict:
        """Collective. Default: every rank's shard state, gathered (the one-file format, for this
        exact layout). ``sharded=True``: this rank's part as a torch.distributed.checkpoint state
        dict whose keys do not depend on the layout, so another world size, ep or mode loads it:

            optim/<bucket>/step                  the AdamW step (replicated)
            optim/dense.<decay>/<moment>         the bucket's unpadded flat moments: a DTensor
                                                 sharded over the world as the flat shards are
            optim/expert.<decay>/<i>/<moment>    per expert parameter i of the bucket, its full
                                                 (n_experts, ...) shape: split over EP,
                                                 replicated over expert-dp
        """
        if not sharded:
            local = self.inner.state_dict()
            if self.mesh.distributed:
                shards = [None] * self.mesh.world_size
                dist.all_gather_object(shards, local)
            else:
                shards = [local]
            return {"layout": self.layout(), "shards": shards}
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from ..train.checkpoint import OPTIM, dcp_meshes

        world, grid = dcp_meshes(self.mesh)
        out = {}
        for b in self.buckets:
            state = self.inner.state.get(b.shard, {})
            step = state.get("step", torch.zeros(()))
            out[f"{OPTIM}{b.name}/step"] = torch.as_tensor(step, dtype=torch.float32).detach().cpu().clone().reshape(())
            numel = sum(p.numel() for p in b.params)
            for moment in ("exp_avg", "exp_avg_sq"):
                local = state.get(moment, torch.zeros_like(b.shard)).detach()
                if b.name.startswith("dense"):  # sharded over the world in torch.chunk's way, whose
                    # pieces are not the flat shards (whole 16-element blocks): cut from the gathered moment
                    full = local
                    if b.group_size > 1:
                        full = torch.empty_like(b.flat_N)
                        _all_gather(full, local.contiguous(), b.group)
                    lo, hi = _chunk(numel, b.group_size, b.group_rank)
                    out[f"{OPTIM}{b.name}/{moment}"] = DTensor.from_local(
                        full[lo:hi].clone(), world, [Shard(0)], run_check=False, shape=torch.Size((numel,)),
                        stride=(1,))
                    continue
                full = local
                if b.sharded and b.group_size > 1:  # this EP rank's experts, whole
                    full = torch.empty_like(b.flat_N)
                    _all_gather(full, local.contiguous(), b.group)
                offset = 0
                for i, p in enumerate(b.params):
                    piece = full[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                    shape = (p.shape[0] * self.mesh.ep, *p.shape[1:])
                    out[f"{OPTIM}{b.name}/{i}/{moment}"] = DTensor.from_local(
                        piece, grid, [Replicate(), Shard(0)], run_check=False, shape=torch.Size(shape),
                        stride=torch.empty(shape, device="meta").stride())
        return out

    def load_state_dict(self, state: dict) -> None:
        """The gathered format (same layout only), or a filled ``state_dict(sharded=True)``."""
        def load_sharded() -> None:
            """Back from the layout-free keys to this rank's flat shards (see state_dict)."""
            def local(t):
                return t.to_local() if hasattr(t, "to_local") else t

            fused_or_capturable = any(g.get("fused") or g.get("capturable") for g in self.inner.param_groups)
            for b in self.buckets:
                prefix = f"optim/{b.name}"
                if f"{prefix}/step" not in state:
                    raise ValueError(f"the checkpoint has no optimizer state for bucket {b.name}: another model?")
                mine = {}
                numel = sum(p.numel() for p in b.params)
                for moment in ("exp_avg", "exp_avg_sq"):
                    if b.name.startswith("dense"):  # every rank's torch.chunk piece, then this flat shard
                        piece = local(state[f"{prefix}/{moment}"]).reshape(-1).to(b.shard.device, b.shard.dtype)
                        if b.group_size > 1:
                            lo, hi = _chunk(numel, b.group_size, 0)
                            padded = piece.new_zeros(hi - lo)
                            padded[:piece.numel()] = piece
                            piece = padded.new_empty(padded.numel() * b.group_size)
                            _all_gather(piece, padded, b.group)
                        lo = b.group_rank * b.shard.numel()
                        piece = piece[lo:min(lo + b.shard.numel(), numel)]
                    else:
                        piece = torch.cat([local(state[f"{prefix}/{i}/{moment}"]).reshape(-1) for i in range(len(b.params))])
                        lo = b.group_rank * b.shard.numel() if b.sharded else 0
                        piece = piece[lo:lo + b.shard.numel()]
                    shard = torch.zeros_like(b.shard)
                    shard[:piece.numel()] = piece.to(shard.device, shard.dtype)
                    mine[moment] = shard
                step = local(state[f"{prefix}/step"]).detach().to(torch.float32).reshape(())
                mine["step"] = step.to(b.shard.device) if fused_or_capturable else step.cpu()
                self.inner.state[b.shard] = mine

        if "layout" not in state and any(k.startswith("optim/") for k in state):
            load_sharded()
        else:
            if state.get("layout") != self.layout():
                raise ValueError(f"optimizer state was saved with layout {state.get('layout')}, this run has "
                                 f"{self.layout()}: resume with the same number of ranks, ep and optimizer")
            self.inner.load_state_dict(state["shards"][self.mesh.rank])
        # torch replaces the inner param_groups on load: alias them again, or the loop's per-step
        # lr would go to the stale list and the run would train on with the saved lr.
        self.param_groups = self.inner.param_groups
