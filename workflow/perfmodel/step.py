"""One step's time and its phases (predict), the layouts it runs in, the collectives it prices,
and the model and layout of a measured point (point_model, point_layout, predict_point).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from optimus_core import presets
from optimus_core.config import MOVED, RETIRED, ConfigError, ModelConfig
from optimus_core.flops import RECOMPUTE_LEVELS, checkpointed_blocks, level_bits

from .machine import DTYPES, Machine

OPTIMIZERS = ("ep_aware", "dp_sharded", "local")
PHASES = ("compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")
OVERLAPS = ("none", "chunks", "layers", "grad_sync")
EXCHANGES = ("all_to_all", "all_gather")  # the expert exchange (optimus_core.parallel.expert_parallel)
CHECKPOINTING = ("none", "full", "moe", *RECOMPUTE_LEVELS)
WHATIFS = ("grad_sync",)  # overlaps our step does not do: priced to show what they would buy

# Bytes one parameter element costs torch's (non-fused, foreach) AdamW step in float32: decay
# p *= 1 - lr wd (r/w 8), m.lerp_(g) (r 8, w 4), v.mul_().addcmul_(g, g) (r/w 8 + r 12, w 4),
# denom = v.sqrt() / bc2 + eps (three passes of r/w 8), p.addcdiv_(m, denom) (r 12, w 4): 84;
# plus the grad-norm read (4) and the clip's in-place scale of the grad (r/w 8).
ADAMW_BYTES_PER_ELEMENT = 84 + 4 + 8
# A bucket reduced over more than one rank keeps a flat gradient buffer that the params' .grad
# are views of: zeroed every step (w 4) and accumulated into by backward (r 8, w 4) where a fresh
# gradient would be written once. A bucket of one rank (experts at EP = W) keeps none.
FLAT_GRAD_BYTES_PER_ELEMENT = 16
MASTER_BYTES = 4  # master weights, grads and optimizer state are float32 even under bf16 autocast


# ----------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Layout:
    """How a step is run: ranks, EP degree, batch (sequences), micro-batch per rank, precision."""

    devices: int
    ep: int = 1
    global_batch: int = 1
    micro_batch: int = 0  # sequences per forward/backward per rank; 0 = the whole local batch
    seq_len: int = 4096
    optimizer: str = "ep_aware"  # ep_aware | dp_sharded (the paper's baseline) | local (one rank: plain AdamW)
    dtype: str = "bfloat16"
    # layers: full sharding, what the code does (optimus_core.parallel.sharding); none | chunks: the
    # ZeRO-1 optimizer of earlier measured points, without / with overlapped gradient chunks;
    # grad_sync: a what-if, full sharding with every collective hidden (package doc)
    overlap: str = "none"
    chunk_mb: float = 128.0  # the ZeRO-1 points' parallel.grad_sync_chunk_mb (overlap "chunks")
    reduce_bytes: int = 4  # parallel.reduce_dtype's bytes (overlap "layers")
    dp_shard: int = 0  # parallel.dp_shard: ranks a parameter is sharded over (0 = every rank)
    experts: str = "triton"  # the experts' backend as the run's execution plan resolves it
    # execution.activation_checkpointing as the run resolves it: none | full (every
    # ``checkpointing_every``-th block) | moe; the backward's recomputation is priced as compute
    checkpointing: str = "none"
    checkpointing_every: int = 1
    exchange: str = "all_to_all"  # the expert exchange as the run's plan resolves it (EXCHANGES)
    gathers: str = "per_micro_batch"  # the plan's weight_gathers: per_micro_batch | per_step (overlap "layers")
    pp: int = 1  # pipeline ranks (parallel.pp, 1F1B): devices / pp ranks per stage
    pp_chunks: int = 1  # stages each pipeline rank holds (parallel.pp_chunks: interleaved 1F1B)

    def __post_init__(self):
        def bad(name, allowed):
            raise ConfigError(f"layout.{name} = {getattr(self, name)!r}: {allowed}")

        for name in ("devices", "ep", "global_batch", "seq_len", "pp", "pp_chunks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if self.devices % self.ep:
            bad("ep", f"must divide devices ({self.devices})")
        if self.devices % (self.ep * self.pp):
            bad("pp", f"x ep ({self.ep}) must divide devices ({self.devices})")
        if self.global_batch % self.data_devices:
            bad("global_batch", f"must be a multiple of the data-parallel devices ({self.data_devices})")
        if self.micro_batch < 0 or (self.micro_batch and self.local_batch % self.micro_batch):
            bad("micro_batch", f"must be 0 or divide the local batch ({self.local_batch} sequences)")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.overlap not in OVERLAPS:
            bad("overlap", f"must be one of {', '.join(repr(o) for o in OVERLAPS)}")
        if not self.chunk_mb > 0:
            bad("chunk_mb", "must be > 0 (MiB)")
        if self.checkpointing not in CHECKPOINTING:
            bad("checkpointing", f"must be one of {', '.join(CHECKPOINTING)}")
        if not isinstance(self.checkpointing_every, int) or self.checkpointing_every < 1:
            bad("checkpointing_every", "must be an integer >= 1")
        shard = self.dp_shard or self.devices
        if self.dp_shard < 0 or self.devices % shard or shard % self.ep:
            bad("dp_shard", f"must be 0 or divide devices ({self.devices}) and be a multiple of ep ({self.ep})")
        if self.gathers not in ("per_micro_batch", "per_step"):
            bad("gathers", "must be per_micro_batch or per_step")
        if self.exchange not in EXCHANGES:
            bad("exchange", f"must be one of {', '.join(EXCHANGES)}")
        if self.optimizer == "dp_sharded" and (self.dp_shard or self.overlap in ("none", "chunks")):
            bad("optimizer", "'dp_sharded' is fully sharded over the data-parallel ranks: it needs dp_shard 0 and "
                             "overlap 'layers' or 'grad_sync'")

    @property
    def data_devices(self) -> int:
        """Devices that read distinct sequences: one stage's."""
        return self.devices // self.pp

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.data_devices

    @property
    def micro_batches(self) -> int:
        return self.local_batch // self.micro_batch if self.micro_batch else 1

    @property
    def tokens_per_rank(self) -> int:
        return self.local_batch * self.seq_len


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    a2a_s: float
    grad_sync_s: float
    optimizer_s: float
    idle_s: float
    # overlap "layers": the per-unit all-gathers and reduce-scatters the forward and backward wait
    # for (part of compute_s, where a measurement sees them: the step blocks inside its passes)
    exposed_sync_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ----------------------------------------------------------------------------- groups and collectives

def rank_groups(world: int, ep: int) -> tuple[np.ndarray, np.ndarray]:
    """(ep_groups, expert_dp_groups) as rank arrays, laid out as mesh.group_layout does:
    EP groups are blocks of ``ep`` consecutive ranks, expert-dp group j the ranks j, j+ep, ..."""
    ranks = np.arange(world)
    return ranks.reshape(world // ep, ep), ranks.reshape(world // ep, ep).T.copy()


def _node_counts(groups: np.ndarray, per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """For each rank of each group, how many members of its group share its node (itself
    included); and the number of distinct nodes each group spans."""
    nodes = groups // per_node
    same = np.empty_like(groups)
    spans = np.empty(len(groups), dtype=int)
    for i, row in enumerate(nodes):
        _, inverse, counts = np.unique(row, return_inverse=True, return_counts=True)
        same[i], spans[i] = counts[inverse], len(counts)
    return same, spans


def _collective_s(kind: str, nbytes: float, groups: np.ndarray, m: Machine) -> float:
    """Time of one collective of an ``nbytes`` buffer (nccl-tests' S) run by every group at once."""
    n = groups.shape[1]
    if n == 1 or nbytes <= 0:
        return 0.0
    per_node = m.devices_per_node
    same, spans = _node_counts(groups, per_node)
    intra = m.intra[kind]
    multi_node = bool((spans > 1).any())
    if multi_node and m.inter is None:
        raise ConfigError(f"machine {m.name}: network.inter_node: missing, but a group of {n} ranks spans "
                          f"{int(spans.max())} nodes of {per_node} devices")
    inter = m.inter[kind] if multi_node else None
    k = int(same.max())  # most members of one group on one node
    world_nodes = (int(groups.max()) // per_node) + 1
    if kind == "all_to_all":
        # Pairwise exchange: each rank sends S/n to each of the n-1 others. Same-node peers go over
        # the intra-node link at its bus bandwidth; the rest leave through the node's NICs, which
        # every rank of the node (of every group) shares.
        intra_s = nbytes * (k - 1) / n / intra.bandwidth
        inter_s = 0.0
        if multi_node:
            off_node_B = nbytes * (n - same) / n  # per rank, bytes to peers on other nodes
            node_out_B = np.bincount((groups // per_node).ravel(), weights=off_node_B.ravel(), minlength=world_nodes)
            inter_s = float(node_out_B.max()) / inter.bandwidth
        # One latency per peer; intra and NIC transfers proceed side by side, so the slower one counts.
        lat_s = (k - 1) * intra.latency + ((n - k) * inter.latency if multi_node else 0.0)
        return lat_s + max(intra_s, inter_s)
    # Rings (reduce-scatter, all-gather; all-reduce = both): every rank forwards factor x S bytes
    # along the ring. Ordered by rank, a group's ring leaves a node once per node it spans, so the
    # bottleneck is the node whose NICs carry the most groups' ring edges; inside a node the
    # intra-node link. Latency: a hierarchical ring (k-1 intra steps, nodes-1 inter steps), as
    # NCCL and oneCCL do across nodes, twice for all-reduce.
    passes = 2 if kind == "all_reduce" else 1
    factor = passes * (n - 1) / n
    bandwidth = intra.bandwidth if k > 1 else math.inf
    lat_s = passes * (k - 1) * intra.latency
    inter_bw = math.inf
    if multi_node:
        crossing = groups[spans > 1] // per_node
        edges = np.zeros(world_nodes)
        for row in crossing:  # one outgoing ring edge per (group, node) it spans
            edges[np.unique(row)] += 1
        inter_bw = inter.bandwidth / float(edges.max())
        bandwidth = min(bandwidth, inter_bw)
        lat_s += passes * (int(spans.max()) - 1) * inter.latency
    ring_s = lat_s + factor * nbytes / bandwidth
    if kind != "all_reduce":
        return ring_s
    # Small all-reduces (a grad norm, loss sums) are latency-bound, and collective libraries then
    # switch to recursive doubling: log2 steps each moving the whole buffer. The faster one counts.
    doubling_s = math.ceil(math.log2(k)) * (intra.latency + nbytes / intra.bandwidth) if k > 1 else 0.0
    if multi_node:
        doubling_s += math.ceil(math.log2(int(spans.max()))) * (inter.latency + nbytes / inter_bw)
    return min(ring_s, doubling_s)


# ----------------------------------------------------------------------------- the model

def _expert_params(cfg: ModelConfig) -> int:
    return 0 if cfg.moe is None else cfg.n_layers * cfg.moe.n_experts * 3 * cfg.d_model * cfg.moe.d_expert


def _expert_flops_per_token(cfg: ModelConfig) -> int:
    """Forward + backward FLOPs of the top_k SwiGLU experts a token visits (6 x active weights)."""
    return 0 if cfg.moe is None else 6 * cfg.n_layers * cfg.moe.top_k * 3 * cfg.d_model * cfg.moe.d_expert


def _recompute_flops_per_token(cfg: ModelConfig, L: "Layout") -> tuple[int, int]:
    """(all, the experts' part) of the forward FLOPs per token the backward repeats under L's
    activation checkpointing (optimus_core.flops.recompute_flops_per_token)."""
    bits = level_bits(L.checkpointing)
    if (L.checkpointing == "moe" or bits & 1) and cfg.moe is None:
        raise ConfigError(f"layout.checkpointing = {L.checkpointing!r}: needs an MoE model")
    total = cfg.recompute_flops_per_token(L.seq_len, L.checkpointing, L.checkpointing_every)
    if bits & 1:  # the MoE block of every layer: its experts' GEMMs among what is recomputed
        return total, cfg.recompute_flops_per_token(L.seq_len, "moe")
    if cfg.moe is None or L.checkpointing != "full":
        return total, total if L.checkpointing == "moe" else 0
    return total, cfg.recompute_flops_per_token(L.seq_len, "moe") * _recomputed_blocks(cfg, L) // cfg.n_layers


def _recomputed_blocks(cfg: ModelConfig, L: "Layout") -> int:
    """Blocks whose expert exchange the backward runs again: those recomputed whole (checkpointing
    "full"; optimus_core.flops.checkpointed_blocks), or every one under a recompute level with
    the MoE bit (the MoE block after its routing is recomputed, exchange included)."""
    if level_bits(L.checkpointing) & 1:
        return cfg.n_layers
    return len(checkpointed_blocks(cfg.n_layers, L.checkpointing, L.checkpointing_every))


def ranks_visited(cfg: ModelConfig, ep: int) -> float:
    """Expected EP ranks one token is sent to: each holds n_experts / ep experts, and a token goes
    once to every rank holding at least one of its top_k (expert_parallel.apply_routed: one row
    per (token, rank), not per expert), so ep x P(a rank holds one of them)."""
    if cfg.moe is None or ep == 1:
        return 1.0
    E, K = cfg.moe.n_experts, cfg.moe.top_k
    return ep * (1 - math.comb(E - E // ep, K) / math.comb(E, K))


def predict(cfg: ModelConfig, layout: Layout, machine: Machine) -> Prediction:
    """Step time and its phases for ``cfg`` trained with ``layout`` on ``machine`` (package doc)."""
    if layout.pp > 1:
        return _pipelined(cfg, layout, machine)
    m, L = machine, layout
    if L.dtype not in m.matmul_flops:
        raise ConfigError(f"machine {m.name}: device.matmul_flops.{L.dtype}: missing (layout.dtype = {L.dtype!r})")
    if cfg.moe is not None and cfg.moe.n_experts % L.ep:
        raise ConfigError(f"layout.ep = {L.ep}: must divide model.moe.n_experts ({cfg.moe.n_experts})")
    if cfg.moe is None and L.ep != 1:  # nothing to split: expert_parallel() leaves a dense model whole
        L = replace(L, ep=1)
    W, tokens = L.devices, L.tokens_per_rank

    # ``share`` > 1 when more ranks than compute slots sit on a node (CPU processes > free cores):
    # they time-share the cores, so everything a core does stretches by it -- the matmuls, the
    # host's Python and launch time, the dispatch's copies, and on a CPU the collectives' copies
    # and reductions (gloo) and the optimizer's memory traffic (a collective's latency, mostly
    # waiting, does not).
    ranks_on_node = min(W, m.devices_per_node)
    share = max(1.0, ranks_on_node / m.slots)
    rate = m.matmul_flops[L.dtype] * m.compute_efficiency
    # All-to-all rows: per MoE layer and micro-batch each rank sends every token once to each EP
    # rank that holds one of its experts (its own included: the bus-bandwidth factor (n-1)/n
    # discounts that part); the most loaded rank's share counts. The paper's all-gather: every
    # rank holds all ep ranks' tokens and their partial sums, whatever the routing.
    tokens_mb = L.tokens_per_rank / L.micro_batches
    gathered = L.exchange == "all_gather"
    rows = tokens_mb * L.ep if gathered else tokens_mb * ranks_visited(cfg, L.ep) * m.moe_imbalance

    # Compute: FLOPs / achieved rate, the backward's recomputation included (activation
    # checkpointing); the experts' part waits on the most loaded EP rank.
    expert_f = _expert_flops_per_token(cfg)
    recompute_f, recompute_expert_f = _recompute_flops_per_token(cfg, L)
    imbalance = m.moe_imbalance if L.ep > 1 else 1
    flops = tokens * ((cfg.flops_per_token(L.seq_len) - expert_f) + expert_f * imbalance
                      + (recompute_f - recompute_expert_f) + recompute_expert_f * imbalance)
    # Host time: per micro-batch (Python, launches), and with the ``loop`` experts backend per
    # local expert too (it runs each expert's matmuls separately; torch / triton group them).
    per_mb = m.microbatch_overhead
    if cfg.moe is not None and L.experts == "loop":
        per_mb += m.expert_overhead * cfg.n_layers * (cfg.moe.n_experts // L.ep)
    # EP dispatch outside the all-to-alls: gathering the rows to send, sorting what arrives by
    # expert, weighting and summing the partials back, forward and backward: passes over the
    # dispatched float32 rows in memory (``dispatch_passes``, calibrated).
    # A block recomputed whole (checkpointing "full") dispatches its tokens again: its forward's
    # share (half) of the dispatch's passes and its forward all-to-alls come back; "moe"
    # recomputes the experts from the rows already dispatched.
    redispatched = _recomputed_blocks(cfg, L)  # 0 but under "full" or a level with the MoE bit
    dispatch_s = 0.0
    if cfg.moe is not None and L.ep > 1:
        dispatch_s = m.dispatch_passes * rows * cfg.d_model * 4 / m.memory_bandwidth * L.micro_batches \
            * (cfg.n_layers + redispatched / 2)
    compute_s = (flops / rate + L.micro_batches * per_mb + dispatch_s) * share

    ep_groups, edp_groups = rank_groups(W, L.ep)
    world = np.arange(W)[None, :]

    # All-to-all, per MoE layer and micro-batch (expert_parallel.apply_routed): forward the rows
    # (x in the autocast dtype), their routing metadata (2 top_k float32: weights and expert ids)
    # and the weighted partial outputs back (autocast dtype); backward the same three reversed;
    # plus the counts exchange (2 int64 per peer: latency only). The paper's exchange instead
    # all-gathers the tokens and the metadata and reduce-scatters the partial sums (nccl-tests'
    # S: the gathered size, ep x the rank's tokens), backward the reverse; no counts.
    a2a_s = 0.0
    if cfg.moe is not None and L.ep > 1 and gathered:
        act_bytes = 2 if L.dtype == "bfloat16" else 4
        x_B, meta_B = rows * cfg.d_model * act_bytes * share, rows * 2 * cfg.moe.top_k * 4 * share
        forward = (_collective_s("all_gather", x_B, ep_groups, m) + _collective_s("all_gather", meta_B, ep_groups, m)
                   + _collective_s("reduce_scatter", x_B, ep_groups, m))
        backward = (_collective_s("all_gather", x_B, ep_groups, m) + _collective_s("reduce_scatter", x_B, ep_groups, m)
                    + _collective_s("reduce_scatter", meta_B, ep_groups, m))
        a2a_s = ((forward + backward) * cfg.n_layers + forward * redispatched) * L.micro_batches
    elif cfg.moe is not None and L.ep > 1:
        act_bytes = 2 if L.dtype == "bfloat16" else 4
        forward = sum(_collective_s("all_to_all", rows * row_bytes * share, ep_groups, m)
                      for row_bytes in (cfg.d_model * act_bytes, 2 * cfg.moe.top_k * 4, cfg.d_model * act_bytes))
        counts = _collective_s("all_to_all", L.ep * 2 * 8, ep_groups, m)
        per_layer = 2 * forward + counts  # the backward's three mirror the forward's
        a2a_s = (per_layer * cfg.n_layers + (forward + counts) * redispatched) * L.micro_batches

    exposed_s = 0.0
    if L.overlap in ("layers", "grad_sync") and W > 1 and L.optimizer != "local":
        sync_s, optimizer_s, exposed_s = _fully_sharded(cfg, L, m, compute_s, share)
        compute_s += exposed_s  # the forward and the backward wait for it (where measurements count it)
    else:
        sync_s, optimizer_s = _zero1(cfg, L, m, compute_s, share, world, edp_groups)
    if W > 1 and L.optimizer != "local":  # what every layout of several ranks adds to a step:
        # train_step's all-reduces of the 4 loss sums and (MoE) the routing counts per layer and expert
        sync_s += _collective_s("all_reduce", 4 * 8, world, m)
        if cfg.moe is not None:
            sync_s += _collective_s("all_reduce", cfg.n_layers * cfg.moe.n_experts * 8, world, m)
        optimizer_s += _collective_s("all_reduce", 8, world, m)  # the clip's squared norm (one float64)
    if W > 1:
        # Ranks do not finish their compute together (routing, the host, a shared CPU): the
        # first collective after it waits for the slowest. With EP that is an all-to-all inside
        # every MoE layer; without, the gradient sync after the backward.
        wait_s = m.rank_skew * compute_s
        if a2a_s > 0:
            a2a_s += wait_s
        else:
            sync_s += wait_s
    idle_s = m.step_overhead
    step_s = compute_s + a2a_s + sync_s + optimizer_s + idle_s  # phases in sequence (package doc)
    return Prediction(step_s, compute_s, a2a_s, sync_s, optimizer_s, idle_s, exposed_s)


def _pipelined(cfg: ModelConfig, L: Layout, m: Machine) -> Prediction:
    """A step of ``pp`` pipeline ranks under 1F1B (package doc): the busiest rank -- the last,
    with the most layers of an even cut and the LM head -- priced as a run of its own on its
    devices / pp ranks (its compute and expert exchange for every micro-batch, its gradient sync
    and update); the bubble, (pp - 1) of its stage times (a micro-batch's time over its
    ``pp_chunks`` stages: interleaved, each stage is a chunk of the rank's layers), and the
    stage-to-stage sends (each micro-batch's hidden states forward and their gradients back at
    every stage boundary the rank holds, across nodes: every send the schedule waits on) are
    idle time."""
    if cfg.n_layers < L.pp * L.pp_chunks:
        raise ConfigError(f"layout.pp = {L.pp}: more stages than the model's {cfg.n_layers} layers")
    stage = cfg.replace(n_layers=-(-cfg.n_layers // L.pp))
    alone = predict(stage, replace(L, devices=L.data_devices, pp=1, pp_chunks=1), m)
    mbs = L.micro_batches
    per_mb = (alone.compute_s + alone.a2a_s) / mbs
    bubble = (L.pp - 1) * per_mb / L.pp_chunks
    act_bytes = 2 if L.dtype == "bfloat16" else 4
    link = (m.inter or m.intra)["all_to_all"]  # a pairwise transfer: the nearest collective's link
    hop = link.latency + L.tokens_per_rank / mbs * cfg.d_model * act_bytes / link.bandwidth
    sends = 2 * (L.pp_chunks * mbs + L.pp - 1) * hop
    return replace(alone, step_s=alone.step_s + bubble + sends, idle_s=alone.idle_s + bubble + sends)


def _zero1(cfg: ModelConfig, L: Layout, m: Machine, compute_s: float, share: float, world: np.ndarray,
           edp_groups: np.ndarray) -> tuple[float, float]:
    """(grad_sync_s, optimizer_s) of the ZeRO-1 optimizer of earlier measured points (overlap
    "none" or "chunks"; package doc): its flat buckets, float32 gradients and state (the step's
    small all-reduces are predict's)."""
    W, n_expert = L.devices, _expert_params(cfg)
    n_dense = cfg.num_params() - n_expert
    n_expert_local = n_expert // L.ep
    edp = W // L.ep
    reduce_s = gather_s = sync_s = opt_elems = 0.0
    # With ``overlap = "chunks"`` (the ZeRO-1 optimizer's parallel.overlap_grad_sync, before full sharding)
    # each chunk is reduced onto its owners (dist.reduce): every rank still sends its whole
    # gradient, n/(n-1) times a reduce-scatter's (n-1)/n share.
    chunked = L.overlap == "chunks"

    def reduce(nbytes: float, groups: np.ndarray) -> float:
        n = groups.shape[1]
        return _collective_s("reduce_scatter", nbytes * (n / (n - 1) if chunked and n > 1 else 1), groups, m)

    if L.optimizer == "local" or W == 1:
        # One rank (or plain AdamW): no collectives; AdamW over every parameter.
        opt_elems = cfg.num_params()
        flat_elems = 0
    else:
        flat_elems = n_dense + (n_expert_local if edp > 1 else 0)
        # Dense buckets: reduce-scatter over the world, update 1/W, all-gather back.
        reduce_s += reduce(n_dense * MASTER_BYTES * share, world)
        gather_s += _collective_s("all_gather", n_dense * MASTER_BYTES * share, world, m)
        opt_elems = n_dense / W
        if n_expert and L.optimizer == "ep_aware":
            reduce_s += reduce(n_expert_local * MASTER_BYTES * share, edp_groups)
            gather_s += _collective_s("all_gather", n_expert_local * MASTER_BYTES * share, edp_groups, m)
            opt_elems += n_expert_local / edp
        if chunked:
            # The reductions run under the last micro-batch's backward (about 2/3 of its compute)
            # as its chunks finish; what shows is what that backward cannot cover, and at least
            # the last chunk (a chunk as large as a bucket cannot start before the bucket is done).
            chunk_B = L.chunk_mb * 2 ** 20
            largest_B = max(n_dense, n_expert_local if n_expert else 0) * MASTER_BYTES
            f = min(1.0, chunk_B / largest_B) if largest_B else 1.0
            backward_s = 2 / 3 * compute_s / L.micro_batches
            reduce_s = max(f * reduce_s, reduce_s - backward_s * (1 - f))
        sync_s = reduce_s + gather_s
    sync_s += flat_elems * FLAT_GRAD_BYTES_PER_ELEMENT / m.memory_bandwidth * share
    optimizer_s = opt_elems * ADAMW_BYTES_PER_ELEMENT / m.memory_bandwidth * share
    return sync_s, optimizer_s


def sharding_groups(world: int, ep: int, dp_shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, expert_shard, replicate) groups as rank arrays, laid out as mesh.sharding_layout
    does: blocks of S consecutive ranks shard the dense units; within a block, the ranks of one
    EP rank shard its experts; the same place in every block replicates."""
    S = dp_shard or world
    ranks = np.arange(world)
    blocks = ranks.reshape(world // S, S)
    experts = ranks.reshape(world // S, S // ep, ep).transpose(0, 2, 1).reshape(-1, S // ep)
    return blocks, experts, blocks.T.copy()


def _fully_sharded(cfg: ModelConfig, L: Layout, m: Machine, compute_s: float, share: float) -> tuple[float, float, float]:
    """(grad_sync_s, optimizer_s, exposed_sync_s) of a fully sharded step (optimus_core.parallel.
    sharding): per micro-batch every unit is all-gathered in the gather dtype before its forward
    and again before its backward (the root, final norm + LM head, once), and its gradient
    reduce-scattered in ``reduce_bytes`` after its backward; dense units over the rank's block of
    ``dp_shard`` ranks (the world by default), the experts' over that block's ranks of its EP rank
    (their own unit when ep > 1, else in their block's); with replicas, each unit's reduced shard
    is all-reduced over them in the last micro-batch's backward. They run beside the compute, one
    unit ahead: of each pass what the compute of the other units cannot cover shows, and at least
    one unit's share (the first gather, the last reduction); on a CPU whose cores all run ranks,
    nothing hides. The paper's baseline (dp_sharded) shards the dense units over the expert-dp
    groups instead and all-reduces their reduced shards over the EP groups, as replicas. After the
    backward: AdamW on the shares (optimizer_s); the step's small all-reduces are predict's, as for
    every layout."""
    W, S = L.devices, L.dp_shard or L.devices
    blocks, expert_blocks, replicas = sharding_groups(W, L.ep, L.dp_shard)
    ep_groups, edp_groups = rank_groups(W, L.ep)
    if L.optimizer == "dp_sharded" and L.ep > 1:  # dense: sharded over expert-dp, replicated over EP
        blocks, replicas, S = edp_groups, ep_groups, W // L.ep
    g = 2 if L.dtype == "bfloat16" else 4
    V, D = cfg.padded_vocab_size, cfg.d_model
    n_expert_layer = (_expert_params(cfg) // cfg.n_layers // L.ep) if cfg.moe is not None else 0
    dense_layer = (cfg.num_params() - _expert_params(cfg) - 2 * V * D - D) // cfg.n_layers
    experts_apart = cfg.moe is not None and L.ep > 1
    block = dense_layer + (n_expert_layer if cfg.moe is not None and not experts_apart else 0)

    def gather(elems, groups, nbytes=g):
        return _collective_s("all_gather", elems * nbytes * share, groups, m)

    def reduce(elems, groups):
        return _collective_s("reduce_scatter", elems * L.reduce_bytes * share, groups, m)

    def across(elems, ranks, groups=replicas):  # the replicas' all-reduce of a unit's reduced shard
        return _collective_s("all_reduce", elems / ranks * L.reduce_bytes * share, groups, m) if W > S else 0.0

    layer_fwd = gather(block, blocks) + (gather(n_expert_layer, expert_blocks) if experts_apart else 0.0)
    layer_bwd = layer_fwd + reduce(block, blocks) + (reduce(n_expert_layer, expert_blocks) if experts_apart else 0.0)
    expert_replicas = sharding_groups(W, L.ep, L.dp_shard)[2]  # the experts' replicas: parallel.dp_shard's only
    layer_ar = across(block, S) + (across(n_expert_layer, S // L.ep, expert_replicas)
                                   if experts_apart and L.dp_shard else 0.0)
    ends_fwd = gather(V * D, blocks, 4) + gather(V * D + D, blocks)  # the embedding (float32) and the root
    ends_bwd = ends_fwd - gather(V * D + D, blocks) + 2 * reduce(V * D, blocks)  # the root stays gathered
    ends_ar = 2 * across(V * D, S)
    units = cfg.n_layers + 2
    per_mb = compute_s / L.micro_batches
    # On a CPU every core runs a rank once the ranks fill the cores: the collectives' copies and
    # sums (gloo) take the same cores as the compute, and nothing hides behind it.
    hides = 0.0 if m.device_kind == "cpu" and min(W, m.devices_per_node) >= m.slots else 1.0

    def exposed_pass(comm: float, work: float) -> float:
        return max(comm - hides * work * (units - 1) / units, comm / units)

    fwd = exposed_pass(cfg.n_layers * layer_fwd + ends_fwd, per_mb / 3)
    bwd_comm = cfg.n_layers * layer_bwd + ends_bwd
    exposed = (L.micro_batches - 1) * (fwd + exposed_pass(bwd_comm, 2 * per_mb / 3)) + fwd + exposed_pass(
        bwd_comm + cfg.n_layers * layer_ar + ends_ar, 2 * per_mb / 3)
    if L.gathers == "per_step":  # gathered in the first forward only, reduced in the last backward only
        reduces = cfg.n_layers * (layer_bwd - layer_fwd) + ends_bwd - (ends_fwd - gather(V * D + D, blocks))
        exposed = fwd + exposed_pass(reduces + cfg.n_layers * layer_ar + ends_ar, 2 * per_mb / 3)
    if L.overlap == "grad_sync":  # the what-if: every unit's collectives hidden
        exposed = 0.0

    sync_s = 0.0
    n_dense = cfg.num_params() - _expert_params(cfg)
    n_expert_local = _expert_params(cfg) // L.ep
    opt_elems = n_dense / S
    if cfg.moe is not None:
        opt_elems += n_expert_local / ((L.dp_shard or W) // L.ep)
    optimizer_s = opt_elems * ADAMW_BYTES_PER_ELEMENT / m.memory_bandwidth * share
    return sync_s, optimizer_s, exposed


# ----------------------------------------------------------------------------- measured points

def point_model(point: dict) -> ModelConfig:
    """The model of a measured point: its preset with the recorded overrides applied."""
    preset = presets.get(point["preset"])
    # (fields that left the model section since, as model.moe.experts_backend did, are not the model's)
    overrides = {k: v for k, v in (point.get("overrides") or {}).items()
                 if k.startswith("model.") and k not in MOVED and k not in RETIRED}
    return preset.run_config(**overrides).model if overrides else preset.model


def point_layout(point: dict) -> Layout:
    return Layout(devices=int(point["devices"]), ep=int(point.get("ep", 1)), global_batch=int(point["global_batch"]),
                  micro_batch=int(point.get("micro_batch") or 0), seq_len=int(point["seq_len"]),
                  optimizer=point.get("optimizer", "ep_aware") if int(point["devices"]) > 1 else "local",
                  dtype=point.get("dtype", "float32"), overlap=point_overlap(point),
                  chunk_mb=float(point.get("grad_sync_chunk_mb") or 128.0),
                  reduce_bytes=4 if point.get("reduce_dtype", "float32") == "float32" else 2,
                  dp_shard=int(point.get("dp_shard") or 0), experts=point_experts(point),
                  **point_checkpointing(point))


def point_checkpointing(point: dict) -> dict:
    """Layout fields of the activation checkpointing a measured point ran, as its plan recorded
    it ("full/2", "moe", a [mode, every] pair); none where it recorded none (the points measured
    before the execution plan ran without)."""
    plan = point.get("plan")
    value = point.get("checkpointing") or (plan.get("checkpointing") if isinstance(plan, dict) else None) or "none"
    if isinstance(value, (list, tuple)):
        mode, every = value[0], int(value[1])
    else:
        mode, _, every = str(value).partition("/")
        every = int(every or 1)
    return {"checkpointing": mode, "checkpointing_every": every}


def point_experts(point: dict) -> str:
    """The experts' backend a measured point ran: recorded, else its override, else the loop
    (the default of the points measured before the execution plan)."""
    overrides = point.get("overrides") or {}
    return (point.get("experts_backend") or overrides.get("execution.experts")
            or overrides.get("model.moe.experts_backend") or "loop")


def point_overlap(point: dict) -> str:
    """What a measured point's step overlapped: "layers" for points of the fully sharded code
    (they record ``sharding``), else the ZeRO-1 optimizer they ran, with or without its chunks."""
    if point.get("sharding") == "full":
        return "layers"
    return "chunks" if point.get("overlap_grad_sync") else "none"


def predict_point(point: dict, machine: Machine) -> Prediction:
    return predict(point_model(point), point_layout(point), machine)
