"""Memory per rank: what one rank of a training run allocates at its peak, term by term, the
activation checkpointing that fits a budget, and the error that says what to change.

    est = estimate(presets.get("mula-220b-a10b").model,
                   MemoryLayout(world=3072, ep=12, micro_batch=1, seq_len=2048, checkpointing="full"))
    est.peak_gib, est.terms                       # {"weights": bytes, "activations": bytes, ...}
    mode, every = fit_checkpointing(model_cfg, layout, budget_bytes)   # or raise MemoryBudgetError

Torch-free arithmetic (it runs on a login node and in a Snakemake dry run), from the parameter
shapes (``parameter_table``, tested against the model) and what the code keeps:

- ``weights``, ``gradients``, ``optimizer``: float32 shares of every parameter and their AdamW
  moments (8 bytes). Several ranks (optimus_core.parallel.sharding): dense rows over the world
  (or the rank's block of parallel.dp_shard ranks; the paper's baseline, dp_sharded: over the
  data-parallel ranks only, replicated over the EP group), the rank's experts' rows over its
  expert-dp group (or its block's part of it), each share padded as FSDP2 pads it
  (ceil(rows / ranks) rows). One process: whole; the experts' gradients in bf16 where the
  execution plan keeps them so (optimus_core.execution).
- ``weight copies``: one process under bf16, the experts' bf16 copies the optimizer keeps.
- ``gathered``: FSDP2's unsharded units in the gather dtype (bf16 under bf16): the root (final
  norm + LM head) for the whole step, and at the forward's end two blocks and one block's
  experts (the next block is prefetched); gathered once a step (the plan's weight_gathers
  per_step), every block and its experts, and in the backward their gradients accumulated whole.
- ``activations``: what the forward keeps for the backward, per token and block (counted from
  the tensors autograd saves: bench/saved_activations.py; tests check the count against it on
  fake tensors), by checkpointing mode; one process under bf16 also keeps the autocast copies of
  each block's dense weights.
- ``lm loss``: the fused LM loss keeps the head's float32 dW and dh from the forward.
- ``transient``: the largest short-lived buffer: an LM-loss chunk's logits, the EP exchange's
  row buffers (the all-to-all's rows sent and received; the paper's all-gather: every rank's
  tokens and their partial outputs, ep x the rank's tokens x width each), or one block's
  recomputation; at the backward's start also one layer's expert dW.

Pipeline stages (parallel.pp; optimus_core.parallel.pipeline): a rank holds its stage's layers
only -- the embedding on the first, the final norm, the LM head and the loss on the last -- and
under 1F1B stage s keeps the activations of min(micro-batches, pp - s) micro-batches in flight
(the first stage the most); ``pipeline`` is the schedule's receive buffers (hidden states in,
their gradients back: one per micro-batch). The run's peak is its heaviest stage's
(``heaviest_stage``).

The peak is the larger of the forward's end (everything the backward needs at once) and the
backward's start (the same activations, with the last units gathered again and their gradients
being made and reduced). Each term was checked against the allocator's record of a rehearsed
rank (bench/memory_rehearsal.py).
Device memory outside the allocator (runtime context, collective buffers) and the allocator's
fragmentation are what ``USABLE_FRACTION`` leaves out of a device's memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable

from .config import ConfigError, ModelConfig
from .flops import RECOMPUTE_LEVELS, checkpointed_blocks, level_bits

GIB = 2 ** 30
# The share of a device's memory a run may plan to allocate: the rest is the runtime's context,
# the collective library's buffers and the caching allocator's fragmentation (what it reserves
# beyond what is allocated).
USABLE_FRACTION = 0.90
# "auto" activation checkpointing takes the least recomputation whose estimate has this share of
# itself to spare under the budget. Rehearsed, the model is close to every rank's allocated peak,
# but the caching allocator reserves more than that peak (bench/README.md, memory per tile):
# mula-220b-a10b chosen at the budget's edge reserved past a 64 GiB tile; with this margin a
# chosen mode stays under it. Where no mode has that headroom, the least recomputation that fits
# at all.
FIT_MARGIN = 0.09
CHECKPOINTING = ("none", "moe", "full", *RECOMPUTE_LEVELS)  # "auto" chooses among the first three
LM_LOSS_CHUNK_ROWS = 4096  # optimus_core.model.linear_cross_entropy.DEFAULT_CHUNK_ROWS


class MemoryBudgetError(ConfigError):
    """A layout does not fit its device; the message names the run, the GiB, the budget and the knob."""


@dataclass(frozen=True)
class MemoryLayout:
    """How one run is laid out and trained, as far as memory goes."""

    world: int = 1  # ranks
    ep: int = 1
    dp_shard: int = 0  # ranks a parameter is sharded over (parallel.dp_shard; 0 = the world)
    micro_batch: int = 1  # sequences per forward on one rank
    accumulation: int = 1  # micro-batches per step on one rank
    seq_len: int = 4096
    dtype: str = "bfloat16"  # execution.dtype, resolved
    optimizer: str = "ep_aware"  # parallel.optimizer
    exchange: str = "all_to_all"  # the plan's expert exchange (EP > 1): all_to_all | all_gather
    gathers: str = "per_micro_batch"  # the plan's weight gathers (several ranks): per_micro_batch | per_step
    reduce_bytes: int = 4  # a gathered unit's gradient element: 2 where a bf16 run reduces in bf16 (parallel.reduce_dtype)
    checkpointing: str = "none"  # resolved execution.activation_checkpointing: none | full | moe
    every: int = 1  # full: every k-th block
    lm_loss_kernel: bool = True  # the fused LM loss's softmax by the Triton kernel (execution.lm_loss)
    fp32_residual: bool = False  # under bf16, the residual stream in float32 (the plan's residual_dtype)
    expert_weight_casts: bool = True  # the experts' bf16 copies (one process under bf16: the plan's)
    bf16_expert_grads: bool = False  # the expert gradients on those copies (the plan's)
    pp: int = 1  # pipeline ranks (parallel.pp); world is then one pipeline rank's stage world
    stage: int = 0  # which pipeline rank this layout is (0 .. pp - 1)
    chunks: int = 1  # stages each pipeline rank holds (parallel.pp_chunks: interleaved 1F1B)
    cut: tuple[tuple[int, int], ...] | None = None  # every stage's layers [first, stop) (pp x chunks of them)

    def __post_init__(self):
        if self.world < 1 or self.ep < 1 or self.world % self.ep:
            raise ConfigError(f"memory layout: world {self.world}, ep {self.ep}: ep must divide the world")
        if self.world % self.shard or self.shard % self.ep:
            raise ConfigError(f"parallel.dp_shard = {self.dp_shard}: must divide the world ({self.world}) and be a "
                              f"multiple of ep ({self.ep})")
        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError(f"execution.activation_checkpointing = {self.checkpointing!r}: must be one of "
                              f"{', '.join(map(repr, CHECKPOINTING))} (or 'auto')")
        if self.every < 1 or self.micro_batch < 1 or self.accumulation < 1:
            raise ConfigError("memory layout: every, micro_batch and accumulation must be >= 1")
        if not 0 <= self.stage < self.pp or (self.pp > 1) != (
                self.cut is not None and len(self.cut) == self.pp * self.chunks):
            raise ConfigError(f"memory layout: stage {self.stage} of {self.pp}, cut {self.cut}: a pipeline's layout "
                              f"gives each stage's layers, a whole model's none")

    @property
    def layers(self) -> tuple[int, int] | None:
        """The layers of this rank's first stage [first, stop), or None: every layer."""
        return self.cut[self.stage] if self.cut is not None else None

    def stage_layers(self, n_layers: int) -> list[int]:
        """The layers this rank holds (of its stages: this one, then every pp-th after it)."""
        if self.cut is None:
            return list(range(n_layers))
        return [i for c in range(self.chunks) for i in range(*self.cut[self.stage + c * self.pp])]

    def stage_layouts(self) -> list["MemoryLayout"]:
        """This layout for every stage of its pipeline ([self] without one)."""
        return [replace(self, stage=s) for s in range(self.pp)] if self.pp > 1 else [self]

    def holds(self, name: str, n_layers: int) -> bool:
        """Whether this rank holds the parameter ``name`` (a name of parameter_table)."""
        if self.layers is None:
            return True
        if name.startswith("blocks."):
            return int(name.split(".")[1]) in self.stage_layers(n_layers)
        return self.stage == 0 if name.startswith("embed.") else self.stage == self.pp - 1

    @property
    def in_flight(self) -> float:
        """Micro-batches' worth of this rank's activations it holds at once: under 1F1B, stage s
        runs pp - s forwards before its first backward; interleaved, its warm-up is 2 (pp - s - 1)
        + (chunks - 1) pp forwards of one of its chunks (Megatron's count), and one more."""
        if self.chunks == 1:
            return min(self.accumulation, self.pp - self.stage)
        warm = 2 * (self.pp - self.stage - 1) + (self.chunks - 1) * self.pp + 1
        return min(self.accumulation * self.chunks, warm) / self.chunks

    @property
    def tokens(self) -> int:
        """Tokens of one forward on one rank."""
        return self.micro_batch * self.seq_len

    @property
    def residual_bytes(self) -> int:
        """Bytes an element of the residual stream: bf16 under bf16 unless fp32_residual."""
        return 2 if self.dtype == "bfloat16" and not self.fp32_residual else 4

    @property
    def shard(self) -> int:
        """Ranks one parameter's rows are sharded over."""
        return self.dp_shard or self.world

    @classmethod
    def of_run(cls, cfg, world: int, checkpointing: tuple[str, int], plan,
               micro_batches: int | None = None) -> "MemoryLayout":
        """The layout of ``cfg`` (a RunConfig) on ``world`` ranks (with pipeline stages the
        layout's world is one stage's world / parallel.pp ranks; the layout is the first
        stage's, ``heaviest_stage`` finds the run's peak), with ``checkpointing`` resolved and
        the rest as ``plan`` (an optimus_core.execution.ExecutionPlan: the memory model reads
        its choices and knows nothing of how they are made) executes it; ``micro_batches`` caps
        the micro-batches per step (a rehearsal's)."""
        world = cfg.parallel.stage_world(world)
        per_rank = cfg.train.global_batch // world
        if per_rank < 1:
            raise ConfigError(f"train.global_batch = {cfg.train.global_batch}: fewer sequences than data-parallel "
                              f"ranks ({world})")
        micro = cfg.train.micro_batch or per_rank
        accumulation = max(1, per_rank // micro)
        if micro_batches is not None:
            accumulation = min(accumulation, micro_batches)
        return cls(world=world, ep=cfg.parallel.ep, dp_shard=cfg.parallel.dp_shard if world > 1 else 0,
                   micro_batch=micro, accumulation=accumulation,
                   seq_len=cfg.data.seq_len, dtype=plan.dtype, optimizer=cfg.parallel.optimizer,
                   exchange=plan.expert_exchange or "all_to_all",
                   gathers=plan.weight_gathers or "per_micro_batch",
                   reduce_bytes=2 if plan.dtype == "bfloat16" and cfg.parallel.reduce_dtype == "bfloat16" else 4,
                   checkpointing=checkpointing[0], every=checkpointing[1],
                   lm_loss_kernel=plan.lm_loss == "triton", fp32_residual=plan.residual_dtype == "float32",
                   expert_weight_casts=plan.expert_copies,
                   bf16_expert_grads=plan.bf16_expert_grads and accumulation == 1, pp=cfg.parallel.pp,
                   chunks=cfg.parallel.pp_chunks,
                   cut=tuple(cfg.parallel.stage_layers(cfg.model.n_layers)) if cfg.parallel.pp > 1 else None)


@dataclass
class MemoryEstimate:
    """Bytes per rank at the peak, by term (module doc)."""

    terms: dict[str, float] = field(default_factory=dict)
    at: str = ""  # "forward end" | "backward"

    @property
    def peak_bytes(self) -> float:
        return sum(self.terms.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.terms.items() if v >= 0.05 * GIB)
        return f"{self.peak_gib:.1f} GiB at the {self.at}" + (f" ({parts})" if parts else "")  # none: all tiny


# ----------------------------------------------------------------------------- parameters

@dataclass(frozen=True)
class ParamShape:
    name: str
    rows: int  # dim 0 as stored (experts: n_experts * rows per expert); vectors: their length
    cols: int  # the rest (1 for a vector)
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def parameter_table(cfg: ModelConfig) -> list[ParamShape]:
    """Every parameter of ``Transformer(cfg)`` with its stored 2-D shape, in registration order."""
    D, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    V = cfg.padded_vocab_size
    scaled = cfg.norm == "rmsnorm"  # OLMo-1B's LayerNorm has no parameters
    out = [ParamShape("embed.weight", V, D)]
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        out += [ParamShape(b + "attn_norm.weight", D, 1)] if scaled else []
        out += [ParamShape(b + "attn.w_q.weight", D, D), ParamShape(b + "attn.w_k.weight", kv, D),
                ParamShape(b + "attn.w_v.weight", kv, D), ParamShape(b + "attn.w_o.weight", D, D)]
        if cfg.qk_norm:
            out += [ParamShape(b + "attn.q_norm.weight", D, 1), ParamShape(b + "attn.k_norm.weight", kv, 1)]
        out += [ParamShape(b + "ffn_norm.weight", D, 1)] if scaled else []
        if cfg.moe is None:
            out += [ParamShape(b + "ffn.w_gate.weight", cfg.d_ff, D), ParamShape(b + "ffn.w_up.weight", cfg.d_ff, D),
                    ParamShape(b + "ffn.w_down.weight", D, cfg.d_ff)]
        else:
            E, F = cfg.moe.n_experts, cfg.moe.d_expert
            out += [ParamShape(b + "ffn.router.gate.weight", E, D),
                    ParamShape(b + "ffn.experts.w_up", E * D, 2 * F, expert=True),
                    ParamShape(b + "ffn.experts.w_down", E * F, D, expert=True)]
    return out + ([ParamShape("final_norm.weight", D, 1)] if scaled else []) + [ParamShape("lm_head.weight", V, D)]


def _share_elements(p: ParamShape, L: MemoryLayout) -> int:
    """Elements of ``p`` one rank holds (padded as FSDP2 pads: whole rows of ceil(rows / ranks))."""
    rows = p.rows
    if L.world == 1:
        return rows * p.cols
    if p.expert:  # this rank's experts, sharded over the ranks that hold the same ones
        return math.ceil(rows // L.ep / (L.shard // L.ep)) * p.cols
    # dense: over every rank of the block (EP-aware), or over the data-parallel ranks only,
    # replicated over the EP group (dp_sharded, the paper's baseline)
    over = L.shard // L.ep if L.optimizer == "dp_sharded" else L.shard
    return math.ceil(rows / over) * p.cols


# ----------------------------------------------------------------------------- activations

def block_activation_bytes(cfg: ModelConfig, tokens: int, checkpointed: bool = False, experts_only: bool = False,
                           residual_bytes: int = 2, level: int = 0) -> float:
    """Bytes one block keeps for its backward over ``tokens`` tokens (eager, Triton experts, bf16
    autocast, the residual stream ``residual_bytes`` an element: 2 in bf16, 4 in float32),
    counted from the tensors autograd saves:

        attention and norms   the block's input and the residual after the attention (each norm
                              keeps its input as it comes, and a float32 rsqrt per token, a
                              LayerNorm its mean too; given
                              a float32 one, torch's ops keep its normalised value too); the
                              normed input the q, k and v projections read (one bf16 tensor, or
                              three bf16 casts of a float32 one); six more bf16 (tokens x d_model)
                              tensors (q, k, v, the attention's output and the projections' views)
                              and the attention's log-sum-exp (float32 per head)
        MoE feed-forward      the bf16 input, router logits and probabilities (float32 x E),
                              routing ids and weights (20 bytes per slot), and per routed row
                              (top_k per token) its bf16 input (D), up projection (2F) and
                              SwiGLU output (F)
        dense feed-forward    the normed input the gate and up projections read (one bf16
                              tensor, or two casts), 4 bf16 (tokens x d_ff)

    ``checkpointed``: the block recomputes everything, keeping its input; ``experts_only`` (the
    "moe" mode): the routed rows' up projection and SwiGLU output are recomputed. ``level``: the
    authors' recompute level's bits (optimus_core.flops.LEVEL_BITS): 1 keeps of the MoE block
    only its normed input and routing (none of the routed rows), 2 of the attention only its
    normed input, 4 none of the norms' statistics (their inputs are kept anyway).
    """
    D, H, r = cfg.d_model, cfg.n_heads, residual_bytes
    if r not in (2, 4):
        raise ValueError(f"residual_bytes = {r}: 2 (bf16) or 4 (float32)")
    if checkpointed:
        return float(r * D * tokens)
    kv = cfg.kv_heads * cfg.head_dim
    rms = cfg.norm == "rmsnorm"
    if r == 2:  # each norm keeps its bf16 input; its bf16 output feeds q, k and v (gate and up) as it is
        normalised, qkv_input, gate_up_input = 0, 2 * D, 2 * D
    else:  # torch's RMSNorm ops keep each norm's float32 normalised value (F.layer_norm its input,
        # the residual itself); autocast casts it for each projection
        normalised, qkv_input, gate_up_input = (2 * 4 * D if rms else 0), 3 * 2 * D, 2 * 2 * D
    stats = 8 if rms else 16  # the two norms' rsqrt (and LayerNorm's means) per token
    raw_qk = 0 if cfg.qk_norm else 2 * (D + kv)  # without QK-norm the raw q and k are not kept
    if level & 4:  # the norms recomputed: their statistics and normalised values not kept
        normalised, stats = 0, 0
    inner = 12 * D - raw_qk + 4 * H  # the attention's own tensors
    if level & 2:  # the attention recomputed: it keeps its input, the normed residual as it comes
        inner, qkv_input = 0, r * D
    attn = 2 * r * D + normalised + qkv_input + inner + stats
    if cfg.moe is None:
        ffn = gate_up_input + 8 * cfg.d_ff
    else:
        E, K, F = cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.d_expert
        rows = 2 * K * D + (0 if experts_only else 2 * K * 3 * F)
        if level & 1:  # the MoE block recomputed after its routing: it keeps its input as it comes
            rows = 0 if r == 2 else r * D  # (in bf16 the router's input already; a float32 one apart)
        ffn = 2 * D + 8 * E + 20 * K + rows
    return float(attn + ffn) * tokens


def _dense_block_params(cfg: ModelConfig) -> int:
    return sum(p.numel for p in parameter_table(cfg.replace(n_layers=1)) if p.name.startswith("blocks.0.")
               and not p.expert)


def _expert_block_params(cfg: ModelConfig) -> int:
    return 0 if cfg.moe is None else 3 * cfg.moe.n_experts * cfg.d_model * cfg.moe.d_expert


def expected_ranks_visited(ep: int, top_k: int) -> float:
    """EP ranks a token's top-k experts lie on, in expectation under uniform routing."""
    return ep * (1 - (1 - 1 / ep) ** top_k) if ep > 1 else 1.0


# ----------------------------------------------------------------------------- the estimate

def _held_elements(cfg: ModelConfig, L: MemoryLayout) -> tuple[int, int]:
    """(dense, expert) parameter elements one rank holds (of its stage's parameters)."""
    table = [p for p in parameter_table(cfg) if L.holds(p.name, cfg.n_layers)]
    return (sum(_share_elements(p, L) for p in table if not p.expert),
            sum(_share_elements(p, L) for p in table if p.expert))


def static_bytes(cfg: ModelConfig, L: MemoryLayout) -> dict[str, float]:
    """The float32 weights, gradients and AdamW moments one rank holds (module doc)."""
    dense, experts = _held_elements(cfg, L)
    expert_grad_bytes = 2 if (L.world == 1 and L.bf16_expert_grads) else 4
    return {"weights": 4.0 * (dense + experts), "gradients": 4.0 * dense + expert_grad_bytes * experts,
            "optimizer": 8.0 * (dense + experts)}


def estimate(cfg: ModelConfig, L: MemoryLayout) -> MemoryEstimate:
    """Bytes per rank at the peak of a step of ``cfg`` laid out as ``L`` (module doc)."""
    if cfg.moe is not None and cfg.moe.n_experts % L.ep:
        raise ConfigError(f"parallel.ep = {L.ep}: must divide model.moe.n_experts ({cfg.moe.n_experts})")
    if cfg.moe is None and (L.checkpointing == "moe" or level_bits(L.checkpointing) & 1):
        raise ConfigError(f"execution.activation_checkpointing = {L.checkpointing!r}: needs an MoE model")
    bf16 = L.dtype == "bfloat16"
    sharded = L.world > 1
    T, D, V = L.tokens, cfg.d_model, cfg.padded_vocab_size
    local_expert_params = _expert_block_params(cfg) // L.ep  # one layer's, this rank's experts
    held = static_bytes(cfg, L)
    weights, gradients, optimizer = held["weights"], held["gradients"], held["optimizer"]
    experts = _held_elements(cfg, L)[1]
    copies = 2.0 * experts if bf16 and not sharded and L.expert_weight_casts else 0.0

    # activations: blocks recomputed keep their input; the rest what autograd saves (a pipeline
    # stage: its blocks, for each micro-batch in flight)
    layers = L.stage_layers(cfg.n_layers)
    first, last = 0 in layers, cfg.n_layers - 1 in layers
    full = set(checkpointed_blocks(cfg.n_layers, L.checkpointing, L.every)) & set(layers)
    bits = level_bits(L.checkpointing)
    acts = L.in_flight * sum(block_activation_bytes(cfg, T, checkpointed=i in full,
                                                    experts_only=L.checkpointing == "moe",
                                                    residual_bytes=L.residual_bytes, level=bits) for i in layers)
    if bf16 and not sharded:  # autocast's bf16 copies of each kept block's dense weights
        acts += 2.0 * _dense_block_params(cfg) * (len(layers) - len(full))
    # the schedule's receive buffers, one per micro-batch: hidden states in, their gradients back
    # (each of its stages but the model's first receives inputs, each but the last gradients)
    receives = 2 * L.chunks - int(first) - int(last)
    pipeline = receives * L.accumulation * T * D * L.residual_bytes if L.pp > 1 else 0.0

    # the head's float32 dW, and dh in h's dtype (the last stage's)
    lm_loss = 4.0 * V * D + L.residual_bytes * T * D if last else 0.0
    # a chunk's logits, and two more buffers of its size at the loss's peak (measured on an H200)
    lm_chunk = 3 * min(LM_LOSS_CHUNK_ROWS, T) * V * 2.0 if last else 0.0
    recompute = 0.0
    if L.checkpointing == "full":
        recompute = block_activation_bytes(cfg, T, residual_bytes=L.residual_bytes)
    elif L.checkpointing == "moe":
        recompute = 2.0 * T * cfg.moe.top_k * 3 * cfg.moe.d_expert
    elif bits:  # the largest part one layer recomputes: its routed rows, or its attention's tensors
        H, kv = cfg.n_heads, cfg.kv_heads * cfg.head_dim
        rows = 2.0 * T * cfg.moe.top_k * (D + 3 * cfg.moe.d_expert) if bits & 1 else 0.0
        attention = float(T * (12 * D - (0 if cfg.qk_norm else 2 * (D + kv)) + 4 * H)) if bits & 2 else 0.0
        recompute = max(rows, attention)
    dispatch = 0.0
    if cfg.moe is not None and L.ep > 1 and L.exchange == "all_gather":
        # every rank's tokens gathered, and the partial sums of all of them before the
        # reduce-scatter (backward: their gradients, the same two)
        dispatch = 2 * L.ep * T * D * (2.0 if bf16 else 4.0) + 4.0 * T * D
    elif cfg.moe is not None and L.ep > 1:
        rows = T * expected_ranks_visited(L.ep, cfg.moe.top_k)
        dispatch = 4 * rows * D * (2.0 if bf16 else 4.0) + 4.0 * T * D
    transient = max(lm_chunk, recompute, dispatch)

    gathered_fwd = gathered_bwd = 0.0
    if sharded:
        g = 2.0 if bf16 else 4.0
        dense_block = _dense_block_params(cfg)
        expert_unit = local_expert_params if cfg.moe is not None else 0
        root = g * (V * D + D) if last else 0.0
        gathered_fwd = root + g * (2 * dense_block + expert_unit)
        reduce_bytes = 2.0 + (4.0 if bf16 else 0.0)  # the unsharded gradient, and its float32 copy to reduce
        biggest_unit = max(dense_block, expert_unit)
        gathered_bwd = root + g * 2 * (dense_block + expert_unit) + reduce_bytes * biggest_unit
        if L.gathers == "per_step":  # every unit kept gathered (the embedding in float32, as
            # stored), its gradient accumulated whole from the step's first backward on (in the
            # reduction's dtype, FSDP2's accumulation; the embedding's in float32), beside the
            # unit's gradient being made
            whole = len(layers) * (dense_block + expert_unit)
            embed = 4.0 * V * D if first else 0.0
            accumulated = L.reduce_bytes * (whole + (V * D if last else 0)) + embed
            gathered_fwd = root + embed + g * whole + (accumulated if L.accumulation > 1 else 0.0)
            gathered_bwd = root + embed + g * whole + accumulated + g * biggest_unit

    accumulating = L.accumulation > 1
    static = {"weights": weights, "optimizer": optimizer, "weight copies": copies,
              "gradients": gradients if accumulating else 0.0}
    forward_end = dict(static, gathered=gathered_fwd, activations=acts, **{"lm loss": lm_loss}, transient=transient)
    if L.pp > 1:
        forward_end["pipeline"] = pipeline
    # The backward's start: every activation still held, the LM loss's dW, the last units
    # gathered again with their gradients being made and reduced (FSDP2's buffers), one layer's
    # expert dW in bf16 (the grouped GEMM's output), the recomputation or the dispatch's buffers.
    expert_dw = 2.0 * local_expert_params if cfg.moe is not None else 0.0
    backward = dict(static, gathered=gathered_bwd, activations=acts, **{"lm loss": 4.0 * V * D if last else 0.0},
                    transient=max(recompute, dispatch) + expert_dw)
    if L.pp > 1:
        backward["pipeline"] = pipeline
    if sum(forward_end.values()) >= sum(backward.values()):
        return MemoryEstimate(forward_end, "forward end")
    return MemoryEstimate(backward, "backward start")


def heaviest_stage(cfg: ModelConfig, L: MemoryLayout) -> MemoryLayout:
    """The stage of ``L``'s pipeline whose estimate peaks highest (``L`` itself without stages):
    the one that has to fit its device."""
    return max(L.stage_layouts(), key=lambda S: estimate(cfg, S).peak_bytes)


def recompute_fraction(cfg: ModelConfig, checkpointing: str, every: int, seq_len: int) -> float:
    """The share of one forward's FLOPs a checkpointing mode repeats in the backward (what it
    costs), at ``seq_len``: optimus_core.flops.recompute_flops_per_token over the forward's third
    of flops_per_token."""
    return 3 * cfg.recompute_flops_per_token(seq_len, checkpointing, every) / cfg.flops_per_token(seq_len)


def checkpointing_candidates(cfg: ModelConfig, seq_len: int) -> list[tuple[str, int]]:
    """(mode, every) from the least recomputation to the most, at ``seq_len``: every block
    spacing, so that a layout between two of them recomputes no more than it must."""
    out = [("none", 1)] + ([("moe", 1)] if cfg.moe is not None else [])
    out += [("full", k) for k in range(cfg.n_layers, 0, -1)]
    return sorted(out, key=lambda c: recompute_fraction(cfg, *c, seq_len))


def fit_checkpointing(cfg: ModelConfig, L: MemoryLayout, budget_bytes: float | None, *,
                      run: str = "this run") -> tuple[str, int]:
    """The (mode, every) of least recomputation whose estimate fits ``budget_bytes`` with
    FIT_MARGIN to spare, else the least that fits at all (None: no budget known: "none");
    MemoryBudgetError when even full checkpointing does not fit."""
    if budget_bytes is None:
        return "none", 1
    peaks = {c: max(estimate(cfg, replace(S, checkpointing=c[0], every=c[1])).peak_bytes for S in L.stage_layouts())
             for c in checkpointing_candidates(cfg, L.seq_len)}
    for limit in (budget_bytes / (1 + FIT_MARGIN), budget_bytes):
        for candidate, peak in peaks.items():  # least recomputation first
            if peak <= limit:
                return candidate
    raise over_budget(cfg, heaviest_stage(cfg, replace(L, checkpointing="full", every=1)), budget_bytes, run)


def resolve_checkpointing(cfg, world: int, plan, budget_bytes: float | None, *,
                          run: str = "this run") -> tuple[str, int]:
    """execution.activation_checkpointing of ``cfg`` (a RunConfig) as (mode, every): the
    configured mode, or for "auto" the least recomputation that fits ``budget_bytes`` (with
    FIT_MARGIN to spare where one does) on ``world`` ranks as ``plan`` executes it
    (MemoryLayout.of_run; fit_checkpointing: MemoryBudgetError when nothing fits)."""
    ex = cfg.execution
    if ex.activation_checkpointing != "auto":
        return ex.activation_checkpointing, ex.activation_checkpointing_every
    return fit_checkpointing(cfg.model, MemoryLayout.of_run(cfg, world, ("none", 1), plan), budget_bytes, run=run)


def check_run(cfg, world: int, plan, budget_bytes: float | None, *,
              run: str = "this run") -> tuple[tuple[str, int], MemoryEstimate]:
    """(checkpointing, estimate) of ``cfg`` (a RunConfig) on ``world`` ranks as ``plan`` (an
    ExecutionPlan) executes it, checkpointing resolved (resolve_checkpointing); MemoryBudgetError
    if over ``budget_bytes``."""
    checkpointing = resolve_checkpointing(cfg, world, plan, budget_bytes, run=run)
    layout = heaviest_stage(cfg.model, MemoryLayout.of_run(cfg, world, checkpointing, plan))
    return checkpointing, check_fits(cfg.model, layout, budget_bytes, run=run)


def check_fits(cfg: ModelConfig, L: MemoryLayout, budget_bytes: float | None, *, run: str = "this run") -> MemoryEstimate:
    """The estimate of ``L``; MemoryBudgetError if it exceeds ``budget_bytes`` (None: unchecked)."""
    est = estimate(cfg, L)
    if budget_bytes is not None and est.peak_bytes > budget_bytes:
        raise over_budget(cfg, L, budget_bytes, run)
    return est


def over_budget(cfg: ModelConfig, L: MemoryLayout, budget_bytes: float, run: str) -> MemoryBudgetError:
    """The error for a layout over its budget: the run, the GiB, the budget and what would help."""
    est = estimate(cfg, L)
    if L.pp > 1:
        held = L.stage_layers(cfg.n_layers)
        run = f"{run} (pipeline rank {L.stage} of {L.pp}, {len(held)} layers from {held[0]})"
    hints = []
    if L.checkpointing != "full" or L.every != 1:
        hints.append("execution.activation_checkpointing=full (or auto)")
    if L.micro_batch > 1:
        hints.append("a smaller train.micro_batch")
    if cfg.moe is not None and L.optimizer == "dp_sharded" and L.ep > 1:
        hints.append("parallel.optimizer=ep_aware")
    if cfg.moe is not None:
        bigger = [e for e in _divisors(cfg.moe.n_experts) if e > L.ep and L.world % e == 0]
        if bigger:
            hints.append(f"a larger parallel.ep ({bigger[0]})")
    if L.pp > 1:
        hints.append(f"more pipeline stages (parallel.pp, {L.pp} now)")
    hints.append("more ranks (tiles)")
    return MemoryBudgetError(f"{run}: {est.describe()} per rank is over the budget of {budget_bytes / GIB:.1f} GiB "
                             f"per device; try {', or '.join(hints)}")


def _divisors(n: int) -> Iterable[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def device_budget(total_bytes: float | None) -> float | None:
    """The bytes a run may plan to allocate on a device of ``total_bytes`` (None: unknown)."""
    return None if total_bytes is None else total_bytes * USABLE_FRACTION
