"""A first-principles performance model of one training step, calibrated on measured points.

    from workflow import perfmodel as pm
    machine = pm.load_machine("aurora")                 # workflow/machines/aurora.yaml
    cfg = presets.get("mula-220b-a10b").model
    pred = pm.predict(cfg, pm.Layout(devices=384, ep=32, global_batch=12288, micro_batch=1,
                                     seq_len=4096, dtype="bfloat16"), machine)
    pred.step_s, pred.compute_s, pred.a2a_s, pred.grad_sync_s, pred.optimizer_s, pred.idle_s
    fitted = pm.calibrate(points, pm.load_machine("cpu"))    # points: the lead's measured dicts
    pm.holdout_error(points, pm.load_machine("cpu"))         # error on points not fitted

What one step does (optimus_core/train/step.py, parallel/{expert_parallel,dispatch,optimizer}.py),
and therefore what this module adds up, per rank:

1. compute: forward + backward of ``global_batch / devices`` sequences in micro-batches:
   ``ModelConfig.flops_per_token(seq_len)`` FLOPs per token (optimus_core/flops.py) at the
   device's measured matmul rate times an achieved fraction (``compute_efficiency``), plus a
   fixed host overhead per micro-batch (Python, kernel launches: what dominates tiny models),
   per local expert with the ``loop`` backend, and with EP the dispatch's own memory passes
   over the rows it sends and receives (``overhead.dispatch``).
2. all-to-all: per MoE layer and micro-batch, a counts exchange, then forward the rows (one per
   token and EP rank holding one of its experts: ``ranks_visited``), their routing metadata and
   the weighted partial outputs back, the same three reversed backward; of each buffer (ep-1)/ep
   leaves the rank.
3. gradient sync. Full sharding (what the code does, ``overlap = "layers"``; optimus_core/
   parallel/sharding.py): per micro-batch every unit (a block's dense part; its experts, over the
   expert-dp group, when ep > 1; the embedding; the root: final norm + LM head) is all-gathered
   in the gather dtype before its forward and again before its backward, and its gradient
   reduce-scattered after its backward, all on a side stream one unit ahead of the compute: what
   the compute of the other units cannot cover is exposed (``exposed_sync_s``, part of
   ``compute_s``: the passes wait for it, and that is where a measurement sees it); after the
   backward the EP-unaware experts' all-reduce and the step's two small all-reduces of losses and
   routing counts (grad_sync_s). The ZeRO-1 optimizer of earlier measured points (``"none"`` /
   ``"chunks"``): dense grads reduce-scatter over the world then the updated shards all-gather
   back; expert grads over the expert-dp group: reduce-scatter + all-gather (ep_aware) or
   all-reduce (ep_unaware).
4. optimizer: the squared-grad-norm all-reduce, then AdamW on this rank's shard, memory-bound:
   bytes touched / memory bandwidth.
5. idle: a fixed per-step overhead (host work outside the phases above).

Overlap (``Layout.overlap``): ``"layers"``, the code's full sharding (above); for the ZeRO-1
points, ``"none"``, the plain sum of the phases, and ``"chunks"``: gradient chunks of
``chunk_mb`` reduced onto their owners while the last micro-batch's backward runs, so only what
that backward (2/3 of its compute) cannot cover shows, and at least the last chunk. The what-if
``"grad_sync"`` (WHATIFS) is full sharding with every unit's collectives hidden; it prices a
step we do not have, to show what that would buy. Measured points use what they ran (their
``sharding`` or ``overlap_grad_sync``), the paper sweep and node-hour estimates full sharding.

Rank skew (``overhead.skew``, calibrated): ranks do not finish their compute together, and the
first collective after it waits for the slowest -- an all-to-all inside each MoE layer with EP,
else the gradient sync. On a shared CPU box it is most of what the all-to-alls measure.

Collectives: time = latency x steps + bytes / bandwidth, with bandwidths in the bus-bandwidth
convention of nccl-tests (what workflow/machines/*.yaml record): a ring reduce-scatter or
all-gather of an S-byte buffer over n ranks moves (n-1)/n S per rank, an all-reduce 2 (n-1)/n S,
a pairwise all-to-all (n-1)/n S. Groups are laid out as optimus_core/parallel/mesh.py's
``group_layout`` does (EP groups consecutive ranks, expert-dp groups strided by ep), ranks are
packed onto nodes in order, and every group of a kind runs its collective at the same time, so
groups that leave a node share its NICs.

This module imports no torch: it runs on a login node and in the Snakemake dry run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from optimus_core import presets
from optimus_core.config import MOVED, RETIRED, ConfigError, ModelConfig

MACHINES_DIR = Path(__file__).resolve().parent / "machines"
KINDS = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")
DTYPES = ("float32", "bfloat16")
OPTIMIZERS = ("ep_aware", "ep_unaware", "local")
PHASES = ("compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")
OVERLAPS = ("none", "chunks", "layers", "grad_sync")
HOLDOUT_SCHEMES = ("largest", "role", "leave_one_out")
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


# ----------------------------------------------------------------------------- machine

@dataclass(frozen=True)
class Link:
    """One collective on one kind of link: bus bandwidth (B/s) and latency per algorithm step (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Machine:
    """A machine as the model sees it (see workflow/machines/*.yaml for each field's source).

    ``matmul_flops``: per-device dense matmul rate per dtype (FLOP/s, measured where we could);
    ``compute_efficiency``: the fraction of it a whole training step achieves; ``intra`` /
    ``inter``: per collective kind, the link inside a node and the node's whole network
    injection (all NICs) across nodes (``inter`` None: a one-node machine).
    """

    name: str
    matmul_flops: dict[str, float]
    compute_efficiency: float
    memory_bandwidth: float
    devices_per_node: int
    intra: dict[str, Link]
    inter: Optional[dict[str, Link]] = None
    nics_per_node: int = 0
    nic_bandwidth: float = 0.0
    compute_slots_per_node: float = 0  # devices computing at once (free CPU cores); 0 = devices_per_node
    peak_flops: float = 0.0  # datasheet peak of the main dtype: the MFU denominator (0 = unknown)
    step_overhead: float = 0.0  # s per step outside every phase (host work)
    microbatch_overhead: float = 0.0  # s of host time per micro-batch forward + backward
    expert_overhead: float = 0.0  # s per local expert, MoE layer and micro-batch (loop backend only)
    dispatch_passes: float = 0.0  # EP dispatch: memory passes over the dispatched rows, per MoE layer and micro-batch
    rank_skew: float = 0.0  # the slowest rank's compute over the mean, minus 1: the others wait that long
    moe_imbalance: float = 1.0  # slowest EP rank's expert tokens / the mean (1 = balanced routing)
    memory_bytes: float = 0.0  # one device's memory (0 = unknown): the memory model's budget
    device_kind: str = "cuda"  # the torch device type a rank runs on

    @property
    def slots(self) -> int:
        return self.compute_slots_per_node or self.devices_per_node

    @property
    def injection_bandwidth(self) -> float:
        return self.nics_per_node * self.nic_bandwidth


def _bad(machine: str, key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"machine {machine}: {key} = {value!r}: {allowed}")


def _number(machine: str, key: str, value: Any, *, positive: bool = True, integer: bool = False) -> float:
    if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1.6e11 as a string: accept what float() reads
        try:
            value = float(value)
        except ValueError:
            raise _bad(machine, key, value, "must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and int(value) != value):
        raise _bad(machine, key, value, "must be an integer" if integer else "must be a number")
    if (positive and value <= 0) or value < 0 or not math.isfinite(value):
        raise _bad(machine, key, value, "must be > 0" if positive else "must be >= 0")
    return int(value) if integer else float(value)


def _mapping(machine: str, key: str, value: Any, known: Iterable[str], required: Iterable[str]) -> dict:
    if not isinstance(value, dict):
        raise _bad(machine, key, value, "must be a mapping")
    known = list(known)
    for k in value:
        if k not in known:
            raise ConfigError(f"machine {machine}: {key}.{k}: unknown key; known: {', '.join(known)}")
    for k in required:
        if k not in value:
            raise ConfigError(f"machine {machine}: {key}.{k}: missing")
    return value


def _links(machine: str, key: str, value: Any) -> dict[str, Link]:
    value = _mapping(machine, key, value, KINDS, KINDS)
    out = {}
    for kind in KINDS:
        spec = _mapping(machine, f"{key}.{kind}", value[kind], ("bandwidth", "latency"), ("bandwidth", "latency"))
        out[kind] = Link(_number(machine, f"{key}.{kind}.bandwidth", spec["bandwidth"]),
                         _number(machine, f"{key}.{kind}.latency", spec["latency"], positive=False))
    return out


def machine_from_dict(data: Any, name: str = "") -> Machine:
    """Validate a machine mapping (the YAML's layout); errors name the machine and the key."""
    name = (data or {}).get("name", name) if isinstance(data, dict) else name
    top = ("name", "device", "devices_per_node", "compute_slots_per_node", "network", "overhead")
    data = _mapping(name, "machine", data, top, ("device", "devices_per_node", "network"))
    dev = _mapping(name, "device", data["device"], ("matmul_flops", "peak_flops", "compute_efficiency",
                                                    "memory_bandwidth", "memory_gib", "kind"),
                   ("matmul_flops", "compute_efficiency", "memory_bandwidth"))
    rates = _mapping(name, "device.matmul_flops", dev["matmul_flops"], DTYPES, ())
    if not rates:
        raise ConfigError(f"machine {name}: device.matmul_flops: needs at least one of {', '.join(DTYPES)}")
    eff = _number(name, "device.compute_efficiency", dev["compute_efficiency"])
    if eff > 1:
        raise _bad(name, "device.compute_efficiency", eff, "must be in (0, 1]")
    net = _mapping(name, "network", data["network"], ("intra_node", "inter_node", "nics_per_node", "nic_bandwidth"),
                   ("intra_node",))
    inter = net.get("inter_node")
    nics = nic_bw = 0
    if inter is not None:
        nics = _number(name, "network.nics_per_node", net.get("nics_per_node"), integer=True)
        nic_bw = _number(name, "network.nic_bandwidth", net.get("nic_bandwidth"))
        inter = _links(name, "network.inter_node", inter)
        for kind, link in inter.items():  # a node cannot push more than its NICs carry
            if link.bandwidth > nics * nic_bw * (1 + 1e-9):
                raise _bad(name, f"network.inter_node.{kind}.bandwidth", link.bandwidth,
                           f"must be <= nics_per_node x nic_bandwidth ({nics * nic_bw:.4g} B/s)")
    over = _mapping(name, "overhead", data.get("overhead") or {}, ("step", "microbatch", "expert", "dispatch",
                                                                   "skew", "moe_imbalance"), ())
    imb = _number(name, "overhead.moe_imbalance", over.get("moe_imbalance", 1.0))
    if imb < 1:
        raise _bad(name, "overhead.moe_imbalance", imb, "must be >= 1 (slowest / mean)")
    return Machine(
        name=name or "unnamed",
        matmul_flops={d: _number(name, f"device.matmul_flops.{d}", v) for d, v in rates.items()},
        compute_efficiency=eff,
        memory_bandwidth=_number(name, "device.memory_bandwidth", dev["memory_bandwidth"]),
        devices_per_node=_number(name, "devices_per_node", data["devices_per_node"], integer=True),
        compute_slots_per_node=_number(name, "compute_slots_per_node", data.get("compute_slots_per_node", 0),
                                       positive=False),
        intra=_links(name, "network.intra_node", net["intra_node"]),
        inter=inter, nics_per_node=nics, nic_bandwidth=nic_bw,
        peak_flops=_number(name, "device.peak_flops", dev.get("peak_flops", 0.0), positive=False),
        step_overhead=_number(name, "overhead.step", over.get("step", 0.0), positive=False),
        microbatch_overhead=_number(name, "overhead.microbatch", over.get("microbatch", 0.0), positive=False),
        expert_overhead=_number(name, "overhead.expert", over.get("expert", 0.0), positive=False),
        dispatch_passes=_number(name, "overhead.dispatch", over.get("dispatch", 0.0), positive=False),
        rank_skew=_number(name, "overhead.skew", over.get("skew", 0.0), positive=False),
        moe_imbalance=imb,
        memory_bytes=_number(name, "device.memory_gib", dev.get("memory_gib", 0), positive=False) * 2 ** 30,
        device_kind=_kind(name, dev.get("kind", "cuda")),
    )


def _kind(machine: str, value: Any) -> str:
    if value not in ("cpu", "cuda", "xpu"):
        raise _bad(machine, "device.kind", value, "must be one of 'cpu', 'cuda', 'xpu'")
    return value


def load_machine(name_or_path: str | Path) -> Machine:
    """``h200``, ``cpu``, ``aurora`` (workflow/machines/<name>.yaml) or a path to a YAML file."""
    import yaml

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = MACHINES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MACHINES_DIR.glob("*.yaml"))
        raise ConfigError(f"machine = {str(name_or_path)!r}: unknown; known: {', '.join(known)} or a YAML path")
    return machine_from_dict(yaml.safe_load(path.read_text()), name=path.stem)


# ----------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Layout:
    """How a step is run: ranks, EP degree, batch (sequences), micro-batch per rank, precision."""

    devices: int
    ep: int = 1
    global_batch: int = 1
    micro_batch: int = 0  # sequences per forward/backward per rank; 0 = the whole local batch
    seq_len: int = 4096
    optimizer: str = "ep_aware"  # ep_aware | ep_unaware | local (one rank: plain AdamW)
    dtype: str = "bfloat16"
    # layers: full sharding, what the code does (optimus_core.parallel.sharding); none | chunks: the
    # ZeRO-1 optimizer of earlier measured points, without / with overlapped gradient chunks;
    # grad_sync: a what-if, full sharding with every collective hidden (module doc)
    overlap: str = "none"
    chunk_mb: float = 128.0  # the ZeRO-1 points' parallel.grad_sync_chunk_mb (overlap "chunks")
    reduce_bytes: int = 4  # parallel.reduce_dtype's bytes (overlap "layers")
    dp_shard: int = 0  # parallel.dp_shard: ranks a parameter is sharded over (0 = every rank)
    experts: str = "triton"  # the experts' backend as the run's execution plan resolves it

    def __post_init__(self):
        def bad(name, allowed):
            raise ConfigError(f"layout.{name} = {getattr(self, name)!r}: {allowed}")

        for name in ("devices", "ep", "global_batch", "seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if self.devices % self.ep:
            bad("ep", f"must divide devices ({self.devices})")
        if self.global_batch % self.devices:
            bad("global_batch", f"must be a multiple of devices ({self.devices})")
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
        shard = self.dp_shard or self.devices
        if self.dp_shard < 0 or self.devices % shard or shard % self.ep:
            bad("dp_shard", f"must be 0 or divide devices ({self.devices}) and be a multiple of ep ({self.ep})")

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.devices

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


def ranks_visited(cfg: ModelConfig, ep: int) -> float:
    """Expected EP ranks one token is sent to: each holds n_experts / ep experts, and a token goes
    once to every rank holding at least one of its top_k (expert_parallel.apply_routed: one row
    per (token, rank), not per expert), so ep x P(a rank holds one of them)."""
    if cfg.moe is None or ep == 1:
        return 1.0
    E, K = cfg.moe.n_experts, cfg.moe.top_k
    return ep * (1 - math.comb(E - E // ep, K) / math.comb(E, K))


def predict(cfg: ModelConfig, layout: Layout, machine: Machine) -> Prediction:
    """Step time and its phases for ``cfg`` trained with ``layout`` on ``machine`` (module doc)."""
    m, L = machine, layout
    if L.dtype not in m.matmul_flops:
        raise ConfigError(f"machine {m.name}: device.matmul_flops.{L.dtype}: missing (layout.dtype = {L.dtype!r})")
    if cfg.moe is not None and cfg.moe.n_experts % L.ep:
        raise ConfigError(f"layout.ep = {L.ep}: must divide model.moe.n_experts ({cfg.moe.n_experts})")
    if cfg.moe is None and L.ep != 1:  # nothing to split: parallelize() leaves a dense model whole
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
    # discounts that part); the most loaded rank's share counts.
    rows = L.tokens_per_rank / L.micro_batches * ranks_visited(cfg, L.ep) * m.moe_imbalance

    # Compute: FLOPs / achieved rate; the experts' part waits on the most loaded EP rank.
    expert_f = _expert_flops_per_token(cfg)
    flops = tokens * ((cfg.flops_per_token(L.seq_len) - expert_f) + expert_f * (m.moe_imbalance if L.ep > 1 else 1))
    # Host time: per micro-batch (Python, launches), and with the ``loop`` experts backend per
    # local expert too (it runs each expert's matmuls separately; torch / triton group them).
    per_mb = m.microbatch_overhead
    if cfg.moe is not None and L.experts == "loop":
        per_mb += m.expert_overhead * cfg.n_layers * (cfg.moe.n_experts // L.ep)
    # EP dispatch outside the all-to-alls: gathering the rows to send, sorting what arrives by
    # expert, weighting and summing the partials back, forward and backward: passes over the
    # dispatched float32 rows in memory (``dispatch_passes``, calibrated).
    dispatch_s = 0.0
    if cfg.moe is not None and L.ep > 1:
        dispatch_s = m.dispatch_passes * rows * cfg.d_model * 4 / m.memory_bandwidth * cfg.n_layers * L.micro_batches
    compute_s = (flops / rate + L.micro_batches * per_mb + dispatch_s) * share

    ep_groups, edp_groups = rank_groups(W, L.ep)
    world = np.arange(W)[None, :]

    # All-to-all, per MoE layer and micro-batch (expert_parallel.apply_routed): forward the rows
    # (x in the autocast dtype), their routing metadata (2 top_k float32: weights and expert ids)
    # and the weighted partial outputs back (autocast dtype); backward the same three reversed;
    # plus the counts exchange (2 int64 per peer: latency only).
    a2a_s = 0.0
    if cfg.moe is not None and L.ep > 1:
        act_bytes = 2 if L.dtype == "bfloat16" else 4
        per_layer = 0.0
        for row_bytes in (cfg.d_model * act_bytes, 2 * cfg.moe.top_k * 4, cfg.d_model * act_bytes):
            per_layer += 2 * _collective_s("all_to_all", rows * row_bytes * share, ep_groups, m)  # fwd + bwd
        per_layer += _collective_s("all_to_all", L.ep * 2 * 8, ep_groups, m)
        a2a_s = per_layer * cfg.n_layers * L.micro_batches

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
    step_s = compute_s + a2a_s + sync_s + optimizer_s + idle_s  # phases in sequence (module doc)
    return Prediction(step_s, compute_s, a2a_s, sync_s, optimizer_s, idle_s, exposed_s)


def _zero1(cfg: ModelConfig, L: Layout, m: Machine, compute_s: float, share: float, world: np.ndarray,
           edp_groups: np.ndarray) -> tuple[float, float]:
    """(grad_sync_s, optimizer_s) of the ZeRO-1 optimizer of earlier measured points (overlap
    "none" or "chunks"; module doc): its flat buckets, float32 gradients and state (the step's
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
        elif n_expert:  # ep_unaware: all-reduce, then every replica updates all its experts
            reduce_s += _collective_s("all_reduce", n_expert_local * MASTER_BYTES * share, edp_groups, m)
            opt_elems += n_expert_local
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
    nothing hides. After the backward: the EP-unaware experts' all-reduce (grad_sync_s) and AdamW
    on the shares (optimizer_s); the step's small all-reduces are predict's, as for every layout."""
    W, S = L.devices, L.dp_shard or L.devices
    blocks, expert_blocks, replicas = sharding_groups(W, L.ep, L.dp_shard)
    _, edp_groups = rank_groups(W, L.ep)
    g = 2 if L.dtype == "bfloat16" else 4
    V, D = cfg.padded_vocab_size, cfg.d_model
    n_expert_layer = (_expert_params(cfg) // cfg.n_layers // L.ep) if cfg.moe is not None else 0
    dense_layer = (cfg.num_params() - _expert_params(cfg) - 2 * V * D - D) // cfg.n_layers
    experts_apart = cfg.moe is not None and L.ep > 1 and L.optimizer == "ep_aware"
    block = dense_layer + (n_expert_layer if (cfg.moe is not None and not experts_apart and L.optimizer == "ep_aware")
                           else 0)

    def gather(elems, groups, nbytes=g):
        return _collective_s("all_gather", elems * nbytes * share, groups, m)

    def reduce(elems, groups):
        return _collective_s("reduce_scatter", elems * L.reduce_bytes * share, groups, m)

    def across(elems, ranks):  # the replicas' all-reduce of a unit's reduced shard
        return _collective_s("all_reduce", elems / ranks * L.reduce_bytes * share, replicas, m) if W > S else 0.0

    layer_fwd = gather(block, blocks) + (gather(n_expert_layer, expert_blocks) if experts_apart else 0.0)
    layer_bwd = layer_fwd + reduce(block, blocks) + (reduce(n_expert_layer, expert_blocks) if experts_apart else 0.0)
    layer_ar = across(block, S) + (across(n_expert_layer, S // L.ep) if experts_apart else 0.0)
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
    if L.overlap == "grad_sync":  # the what-if: every unit's collectives hidden
        exposed = 0.0

    sync_s = 0.0
    n_dense = cfg.num_params() - _expert_params(cfg)
    n_expert_local = _expert_params(cfg) // L.ep
    opt_elems = n_dense / S
    if cfg.moe is not None and L.optimizer == "ep_unaware":
        sync_s += _collective_s("all_reduce", n_expert_local * MASTER_BYTES * share, edp_groups, m)
        opt_elems += n_expert_local
    elif cfg.moe is not None:
        opt_elems += n_expert_local / (S // L.ep)
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
                  dp_shard=int(point.get("dp_shard") or 0), experts=point_experts(point))


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


# ----------------------------------------------------------------------------- calibration

# Free knobs: each scales fields of the machine; fitted in log space (all must stay > 0).
KNOBS = {
    "compute_efficiency": "device.compute_efficiency (caps at 1)",
    "a2a_bandwidth": "intra/inter all_to_all bandwidth, one common factor",
    "sync_bandwidth": "reduce_scatter/all_gather/all_reduce bandwidth, one common factor",
    "latency": "every collective latency, one common factor",
    "memory_bandwidth": "device.memory_bandwidth",
    "compute_slots": "compute_slots_per_node (on a shared CPU box: the cores our ranks really get)",
    "step_overhead": "overhead.step (s)",
    "microbatch_overhead": "overhead.microbatch (s)",
    "expert_overhead": "overhead.expert (s per local expert, layer and micro-batch; loop backend)",
    "dispatch_passes": "overhead.dispatch (EP dispatch: passes over the dispatched rows in memory)",
    "rank_skew": "overhead.skew (the slowest rank's compute over the mean, minus 1)",
}
DEFAULT_FIT = ("compute_efficiency", "microbatch_overhead", "expert_overhead", "dispatch_passes", "rank_skew",
               "compute_slots", "a2a_bandwidth", "sync_bandwidth", "latency", "step_overhead")
TARGETS = ("step_s", "compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")


def _scale_links(links: Optional[dict[str, Link]], kinds, bw: float = 1.0, lat: float = 1.0):
    if links is None:
        return None
    return {k: Link(l.bandwidth * (bw if k in kinds else 1.0), l.latency * (lat if k in kinds else 1.0))
            for k, l in links.items()}


# Knobs that set one Machine field to the fitted value as it is.
FIELD_KNOBS = {"memory_bandwidth": "memory_bandwidth", "compute_slots": "compute_slots_per_node",
               "step_overhead": "step_overhead", "microbatch_overhead": "microbatch_overhead",
               "expert_overhead": "expert_overhead", "dispatch_passes": "dispatch_passes",
               "rank_skew": "rank_skew"}


def _apply(machine: Machine, knobs: dict[str, float]) -> Machine:
    m = machine
    for name, value in knobs.items():
        if name in FIELD_KNOBS:
            m = replace(m, **{FIELD_KNOBS[name]: value})
        elif name == "compute_efficiency":
            m = replace(m, compute_efficiency=min(1.0, value))
        elif name == "a2a_bandwidth":
            m = replace(m, intra=_scale_links(m.intra, ("all_to_all",), bw=value),
                        inter=_scale_links(m.inter, ("all_to_all",), bw=value))
        elif name == "sync_bandwidth":
            kinds = ("reduce_scatter", "all_gather", "all_reduce")
            m = replace(m, intra=_scale_links(m.intra, kinds, bw=value), inter=_scale_links(m.inter, kinds, bw=value))
        elif name == "latency":
            m = replace(m, intra=_scale_links(m.intra, KINDS, lat=value), inter=_scale_links(m.inter, KINDS, lat=value))
        else:
            raise ConfigError(f"fit: {name!r}: unknown knob; known: {', '.join(KNOBS)}")
    return m


def _start(machine: Machine, name: str) -> float:
    """Where a knob starts: its machine value (a multiplier of 1 for bandwidth/latency knobs);
    overheads that are 0 start at 1 ms (log space needs > 0)."""
    if name in ("a2a_bandwidth", "sync_bandwidth", "latency"):
        return 1.0
    value = {"compute_efficiency": machine.compute_efficiency, "memory_bandwidth": machine.memory_bandwidth,
             "compute_slots": float(machine.slots),
             "step_overhead": machine.step_overhead, "microbatch_overhead": machine.microbatch_overhead,
             "expert_overhead": machine.expert_overhead, "dispatch_passes": machine.dispatch_passes,
             "rank_skew": machine.rank_skew}[name]
    return value if value > 0 else {"expert_overhead": 1e-5, "dispatch_passes": 1.0, "rank_skew": 0.01}.get(name, 1e-3)


def calibrate(points: Sequence[dict], machine: Machine, fit: Sequence[str] = DEFAULT_FIT,
              targets: Sequence[str] = TARGETS, iterations: int = 100) -> Machine:
    """The machine with the knobs in ``fit`` set by least squares on log(predicted / measured) of
    ``targets`` over ``points``: the step time, and by default also each phase a point measured
    (weighted by the square root of its share of the step), since the step time alone cannot
    tell, say, a slower all-to-all from a slower matmul. Levenberg-Marquardt with a
    finite-difference Jacobian, in log space so every knob stays positive. Knobs the points
    cannot see (no multi-rank point for a bandwidth) stay put, held by a weak prior at their
    start value. ``targets=("step_s",)`` fits the step time alone."""
    for name in fit:
        if name not in KNOBS:
            raise ConfigError(f"fit: {name!r}: unknown knob; known: {', '.join(KNOBS)}")
    if not points:
        raise ConfigError("calibrate: no measured points")
    cases = [(point_model(p), point_layout(p), p) for p in points]
    x0 = np.log([_start(machine, n) for n in fit])
    prior = 1e-3  # weight of the pull towards the start (keeps unobservable knobs finite)

    def residuals(x: np.ndarray) -> np.ndarray:
        m = _apply(machine, dict(zip(fit, np.exp(x))))
        out = []
        for cfg, layout, p in cases:
            pred = predict(cfg, layout, m)
            for t in targets:
                if p.get(t) is not None and p[t] > 0 and getattr(pred, t) > 0:
                    # A phase counts by its share of the step: a phase of 1 % of the step, timed
                    # with its noise, must not pull the knobs as hard as the step time itself.
                    weight = 1.0 if t == "step_s" else math.sqrt(min(1.0, p[t] / p["step_s"]))
                    out.append(weight * math.log(getattr(pred, t) / p[t]))
        return np.concatenate([np.asarray(out), prior * (x - x0)])

    x, lam = x0.copy(), 1e-2
    r = residuals(x)
    for _ in range(iterations):
        J = np.empty((r.size, x.size))
        for j in range(x.size):  # backward: a knob at a kink (compute_slots at the core count) still moves
            dx = np.zeros_like(x)
            dx[j] = 1e-5
            J[:, j] = (r - residuals(x - dx)) / 1e-5
        g, H = J.T @ r, J.T @ J
        improved = False
        for _ in range(20):
            step = np.linalg.solve(H + lam * np.diag(np.diag(H) + 1e-12), -g)
            x_new = np.clip(x + step, x0 - 25, x0 + 25)
            r_new = residuals(x_new)
            if r_new @ r_new < r @ r:
                x, r, lam, improved = x_new, r_new, max(lam / 3, 1e-9), True
                break
            lam *= 4
        if not improved or np.abs(step).max() < 1e-7:
            break
    return _apply(machine, dict(zip(fit, np.exp(x))))


def knob_values(machine: Machine, reference: Machine) -> dict[str, float]:
    """The knobs of ``machine`` relative to ``reference`` (bandwidth / latency knobs as factors)."""
    return {
        "compute_efficiency": machine.compute_efficiency,
        "a2a_bandwidth": machine.intra["all_to_all"].bandwidth / reference.intra["all_to_all"].bandwidth,
        "sync_bandwidth": machine.intra["reduce_scatter"].bandwidth / reference.intra["reduce_scatter"].bandwidth,
        "latency": (machine.intra["all_to_all"].latency / reference.intra["all_to_all"].latency
                    if reference.intra["all_to_all"].latency else 1.0),
        "memory_bandwidth": machine.memory_bandwidth,
        "compute_slots": float(machine.slots),
        "step_overhead": machine.step_overhead,
        "microbatch_overhead": machine.microbatch_overhead,
        "expert_overhead": machine.expert_overhead,
        "dispatch_passes": machine.dispatch_passes,
        "rank_skew": machine.rank_skew,
    }


def split_points(points: Sequence[dict], scheme: str = "largest") -> list[tuple[list[dict], list[dict]]]:
    """(fitted, held-out) splits of ``points`` by ``scheme`` (holdout_error)."""
    if scheme not in HOLDOUT_SCHEMES:
        raise ConfigError(f"scheme = {scheme!r}: must be one of {', '.join(repr(s) for s in HOLDOUT_SCHEMES)}")
    if scheme == "leave_one_out":
        return [([q for j, q in enumerate(points) if j != i], [p]) for i, p in enumerate(points)]
    if scheme == "role":
        train = [p for p in points if p.get("role") != "held-out"]
        test = [p for p in points if p.get("role") == "held-out"]
        if not train or not test:
            raise ConfigError("holdout_error: 'role' needs points of role 'held-out' and others to fit on")
        return [(train, test)]
    top = max(int(p["devices"]) for p in points)
    train = [p for p in points if int(p["devices"]) < top]
    test = [p for p in points if int(p["devices"]) == top]
    if not train or not test:
        raise ConfigError("holdout_error: 'largest' needs points at more than one device count")
    return [(train, test)]


def holdout_error(points: Sequence[dict], machine: Machine, fit: Sequence[str] = DEFAULT_FIT,
                  scheme: str = "largest", targets: Sequence[str] = TARGETS) -> list[dict]:
    """Relative step-time error of points NOT used for fitting.

    ``scheme="largest"``: fit on the points below the largest device count of each sweep (same
    preset, device kind, dtype), test on those at the largest; ``"role"``: fit on the points
    whose ``role`` is not "held-out" (a design chosen before measuring: stages/scaling.py),
    test on the held-out ones; ``"leave_one_out"``: fit on all but one, test on it, for each
    point. Returns one row per tested point: its identity, measured and predicted step time and
    phases (``measured_<phase>``, ``predicted_<phase>``), and ``rel_error`` = predicted /
    measured - 1 of the step time.
    """
    rows = []
    for train, test in split_points(points, scheme):
        rows += error_rows(test, calibrate(train, machine, fit, targets), fitted_on=len(train))
    return rows


def error_rows(points: Sequence[dict], fitted: Machine, fitted_on: int) -> list[dict]:
    """holdout_error's rows for ``points`` predicted by an already ``fitted`` machine."""
    rows = []
    for p in points:
        pred = predict_point(p, fitted)
        rows.append({"preset": p["preset"], "device": p.get("device", ""), "devices": int(p["devices"]),
                     "ep": int(p.get("ep", 1)), "optimizer": p.get("optimizer", ""),
                     **({"setting": p["setting"]} if p.get("setting") else {}),
                     "global_batch": int(p["global_batch"]), "micro_batch": int(p.get("micro_batch") or 0),
                     "measured_s": float(p["step_s"]), "predicted_s": pred.step_s,
                     "rel_error": pred.step_s / float(p["step_s"]) - 1, "fitted_on": fitted_on,
                     **{f"measured_{ph}": float(p[ph]) for ph in PHASES if p.get(ph) is not None},
                     **{f"predicted_{ph}": getattr(pred, ph) for ph in PHASES}})
    return rows


# ----------------------------------------------------------------------------- sweeps and node-hours

def efficiency(devices: Sequence[int], step_s: Sequence[float]) -> list[float]:
    """Strong-scaling efficiency T(base) x base / (T(n) x n), base = the smallest device count."""
    i0 = int(np.argmin(devices))
    return [step_s[i0] * devices[i0] / (t * n) for n, t in zip(devices, step_s)]


def predict_sweep(preset: str, tiles_list: Sequence[int], machine: Machine, *, global_batch: int,
                  ep: int, micro_batch: int = 1, seq_len: int = 0, dtype: str = "bfloat16",
                  optimizer: str = "ep_aware", overrides: Optional[dict] = None, overlap: str = "layers",
                  chunk_mb: float = 128.0, dp_shard: int = 0, experts: str = "triton") -> list[dict]:
    """One row per tile count: the layout (``overlap`` included), each phase, tokens/s and
    efficiency within the sweep. ``dp_shard``: the shard block (parallel.dp_shard), capped at
    each point's tile count. A what-if ``overlap`` (WHATIFS: one our step does not do) marks
    its rows with ``scenario`` so they never mix with the plain sweep."""
    p = presets.get(preset)
    cfg = p.run_config(**overrides).model if overrides else p.model
    seq_len = seq_len or p.seq_len
    rows = []
    for tiles in tiles_list:
        layout = Layout(devices=tiles, ep=ep, global_batch=global_batch, micro_batch=micro_batch,
                        seq_len=seq_len, optimizer=optimizer if tiles > 1 else "local", dtype=dtype, overlap=overlap,
                        chunk_mb=chunk_mb, dp_shard=dp_shard if 0 < dp_shard < tiles else 0, experts=experts)
        pred = predict(cfg, layout, machine)
        rows.append({"preset": preset, "machine": machine.name, "devices": tiles, "ep": ep, "overlap": overlap,
                     "dp_shard": layout.dp_shard,
                     **({"scenario": f"overlap {overlap}"} if overlap in WHATIFS else {}),
                     "nodes": math.ceil(tiles / machine.devices_per_node), "global_batch": global_batch,
                     "micro_batch": micro_batch, "seq_len": seq_len, "dtype": dtype, "optimizer": layout.optimizer,
                     **pred.as_dict(), "tokens_per_s": global_batch * seq_len / pred.step_s})
    for row, eff in zip(rows, efficiency([r["devices"] for r in rows], [r["step_s"] for r in rows])):
        row["efficiency"] = eff
    return rows


def code_overlap(parallel) -> str:
    """The overlap our step does on several ranks: full sharding's per-unit collectives."""
    return "layers"


def planned_execution(cfg, machine: Machine, devices: int):
    """The execution plan of ``cfg`` on ``devices`` of ``machine``, as the run will resolve it
    there (optimus_core.execution; its kernels assumed to pass their self-check)."""
    from optimus_core.execution import resolve_choices

    return resolve_choices(cfg, machine.device_kind, devices, probe=False)


def paper_sweep(machine: Machine, overlap: Optional[str] = None) -> list[dict]:
    """The paper's strong-scaling sweep of Mula-220B-A10B as the registry defines it
    (workflow/experiments.py: SCALING_TILES, SCALING_BATCH, ep 32, bf16), one sequence per
    micro-batch (12288 tiles hold one sequence each; 384 accumulate 32). ``overlap`` None: what
    the run's configuration does (code_overlap); a what-if otherwise."""
    from workflow import experiments as ex

    run = ex.get(f"scaling-mula-220b-a10b-{ex.SCALING_TILES[0]}").paper
    cfg = run.run_config()
    plan = planned_execution(cfg, machine, run.devices)
    return predict_sweep(run.preset, ex.SCALING_TILES, machine, global_batch=ex.SCALING_BATCH, ep=run.ep,
                         micro_batch=1, dtype=plan.dtype, experts=plan.experts or "loop", overlap=overlap or code_overlap(cfg.parallel),
                         dp_shard=ex.get(f"scaling-mula-220b-a10b-{ex.SCALING_TILES[-1]}").paper.run_config().parallel.dp_shard)


def estimate_node_hours(run_scale, machine: Machine, micro_batch: int = 1) -> dict[str, Any]:
    """Hours and node-hours of a registry run (workflow.experiments.RunScale) on ``machine``:
    steps x predicted step time. ``source`` says it is the model's estimate."""
    cfg = run_scale.run_config()
    local = cfg.train.global_batch // run_scale.devices
    if local < 1 or cfg.train.global_batch % run_scale.devices:
        raise ConfigError(f"global_batch = {cfg.train.global_batch}: must be a multiple of the "
                          f"{run_scale.devices} devices for the performance model")
    mb = cfg.train.micro_batch or (micro_batch if local % micro_batch == 0 else 0)
    plan = planned_execution(cfg, machine, run_scale.devices)
    layout = Layout(devices=run_scale.devices, ep=cfg.parallel.ep, global_batch=cfg.train.global_batch,
                    micro_batch=mb, seq_len=cfg.data.seq_len, experts=plan.experts or "loop",
                    optimizer=cfg.parallel.optimizer if run_scale.devices > 1 else "local", dtype=plan.dtype,
                    overlap=code_overlap(cfg.parallel), dp_shard=cfg.parallel.dp_shard,
                    reduce_bytes=4 if cfg.parallel.reduce_dtype == "float32" else 2)
    pred = predict(cfg.model, layout, machine)
    hours = run_scale.steps * pred.step_s / 3600
    nodes = math.ceil(run_scale.devices / machine.devices_per_node)
    return {"source": f"perfmodel:{machine.name}", "step_s": pred.step_s, "steps": run_scale.steps,
            "hours": hours, "nodes": nodes, "node_hours": hours * nodes, "prediction": pred}


def predict_points(points: Sequence[dict], machine: Machine) -> list[dict]:
    """The model's row for each measured point (same identity fields, predicted phases), e.g. to
    draw a calibrated model beside a measured sweep."""
    rows = []
    for p in points:
        pred = predict_point(p, machine)
        rows.append({**({"run_id": p["run_id"]} if p.get("run_id") else {}),
                     "preset": p["preset"], "device": p.get("device", machine.name), "machine": machine.name,
                     "devices": int(p["devices"]), "ep": int(p.get("ep", 1)),
                     "optimizer": point_layout(p).optimizer, **pred.as_dict(),
                     "tokens_per_s": int(p["global_batch"]) * int(p["seq_len"]) / pred.step_s})
    return rows
