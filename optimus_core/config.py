"""Configuration: one frozen dataclass per concern, validated on construction.

Every config is built from a preset (optimus_core.presets) plus overrides; YAML and the
command line only choose a preset and override fields (``--set train.steps=100``), never copy
one. An error names the field, the bad value and what is allowed::

    >>> ModelConfig(n_layers=-1)
    ConfigError: model.n_layers = -1: must be >= 1

Concerns:
    ModelConfig     the architecture (MoEConfig inside it when the model has experts)
    OptimConfig     AdamW and gradient clipping
    ScheduleConfig  learning-rate schedule
    TrainConfig     steps, batch, precision, seeds, cadences of eval / checkpoint / logging
    DataConfig      where the tokens are and how sequences are cut
    ParallelConfig  how ranks are arranged (data and expert parallel today; tp/pp reserved)
    RunConfig       all of the above, the thing a run resolves and records
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and what is allowed."""


# ----------------------------------------------------------------------------- validation helpers

def _fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{path} = {value!r}: {allowed}")


def _check_type(path: str, value: Any, tp: Any) -> Any:
    """Check (and where lossless, coerce) ``value`` against annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        if len(candidates) == 1:  # Optional[X]: X's own message is the helpful one
            return _check_type(path, value, candidates[0])
        for arg in candidates:
            try:
                return _check_type(path, value, arg)
            except ConfigError:
                pass
        _fail(path, value, f"must be {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            _fail(path, value, f"must be one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (tuple,):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            _fail(path, value, f"must be a sequence of {len(args)} values")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            _fail(path, value, f"must have exactly {len(args)} values")
        return tuple(_check_type(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value, path)
        _fail(path, value, f"must be a mapping for {tp.__name__}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(path, value, "must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            _fail(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, value, "must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, value, "must be a string")
        return value
    return value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


class _Validated:
    """Base: type-checks every field against its annotation, then calls ``check()``."""

    _section: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = _check_type(self._path(f.name), getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self.check()

    def _path(self, name: str) -> str:
        return f"{self._section}.{name}" if self._section else name

    def _require(self, ok: bool, name: str, allowed: str) -> None:
        if not ok:
            _fail(self._path(name), getattr(self, name), allowed)

    def check(self) -> None:  # overridden per concern
        pass

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build ``cls`` from a mapping; unknown keys are an error that lists the known ones."""
    if not isinstance(data, dict):
        _fail(path or cls.__name__, data, f"must be a mapping for {cls.__name__}")
    known = {f.name for f in fields(cls)}
    data = {k: v for k, v in data.items() if k not in getattr(cls, "_retired", ())}
    unknown = sorted(set(data) - known)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown field {where}{unknown[0]} (in {cls.__name__}); known fields: {', '.join(sorted(known))}"
        )
    return cls(**data)


# ----------------------------------------------------------------------------- concerns

@dataclass(frozen=True)
class MoEConfig(_Validated):
    """Mixture-of-experts feed-forward: a softmax top-k router over ``n_experts`` SwiGLU experts."""

    _section: typing.ClassVar[str] = "model.moe"

    n_experts: int = 64
    top_k: int = 8
    d_expert: int = 1024  # SwiGLU hidden size of one expert
    # OLMoE's coefficients, on the mean over the MoE layers of each layer's loss (OLMoE's
    # convention: Transformer.aux_loss), so they do not grow with the depth
    lb_loss_coef: float = 0.01  # load-balancing loss: E * sum_e (share of assignments) * (mean prob)
    z_loss_coef: float = 0.001  # router z-loss: mean over tokens of logsumexp(logits)^2
    norm_topk_probs: bool = False  # OLMoE does not renormalise the top-k probabilities
    # aux-loss-free balancing (DeepSeek-V3 style): a per-expert bias added to the routing scores
    # for selection only, nudged by ``bias_update_rate`` towards balance after each step.
    bias_update_rate: float = 0.0
    # capacity factor: None = dropless (default); c > 0 keeps at most ceil(c * T * k / E) tokens
    # per expert and drops the rest (their expert output is zero; the residual carries them).
    capacity_factor: Optional[float] = None
    experts_backend: Literal["loop", "torch", "triton"] = "loop"
    # The routing weights scale each row's SwiGLU output, before the down projection, and the
    # top-k combine is a plain sum; false: they weight the combine of the expert outputs, which
    # then keeps those outputs for its backward (R x d_model per layer; optimus_core.model.experts).
    weights_before_down: bool = True

    def check(self) -> None:
        self._require(self.n_experts >= 1, "n_experts", "must be >= 1")
        self._require(1 <= self.top_k <= self.n_experts, "top_k", f"must be between 1 and n_experts ({self.n_experts})")
        self._require(self.d_expert >= 1, "d_expert", "must be >= 1")
        self._require(self.lb_loss_coef >= 0, "lb_loss_coef", "must be >= 0")
        self._require(self.z_loss_coef >= 0, "z_loss_coef", "must be >= 0")
        self._require(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")
        self._require(self.capacity_factor is None or self.capacity_factor > 0, "capacity_factor",
                      "must be null (dropless) or > 0")


@dataclass(frozen=True)
class ModelConfig(_Validated):
    """A decoder-only transformer: pre-norm RMSNorm, RoPE, QK-norm, SwiGLU or MoE feed-forward."""

    _section: typing.ClassVar[str] = "model"

    vocab_size: int = 50280  # the tokenizer's vocabulary
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    n_kv_heads: Optional[int] = None  # None = n_heads (no GQA)
    d_ff: int = 8192  # SwiGLU hidden size of the dense feed-forward (unused when moe is set)
    moe: Optional[MoEConfig] = None
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    qk_norm: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    pad_vocab_to: int = 128  # the embedding is padded to a multiple of this

    def check(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "pad_vocab_to"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(self.d_model % self.n_heads == 0, "n_heads", f"must divide d_model ({self.d_model})")
        self._require((self.d_model // self.n_heads) % 2 == 0, "n_heads",
                      f"must leave an even head dim for RoPE (d_model {self.d_model} / n_heads)")
        if self.n_kv_heads is not None:
            self._require(1 <= self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0,
                          "n_kv_heads", f"must divide n_heads ({self.n_heads})")
        self._require(self.rope_theta > 0, "rope_theta", "must be > 0")
        self._require(self.norm_eps > 0, "norm_eps", "must be > 0")
        self._require(self.init_std > 0, "init_std", "must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to
        return (self.vocab_size + m - 1) // m * m

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


@dataclass(frozen=True)
class OptimConfig(_Validated):
    """AdamW (decoupled weight decay; norms, biases and embeddings' decay as OLMoE) + clipping."""

    _section: typing.ClassVar[str] = "optim"

    lr: float = 4e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: Optional[float] = 1.0  # max global grad norm; None disables clipping
    # The update kernel: "triton" = one streaming kernel per (flat) tensor (optimus_core.train.adamw,
    # 28 bytes per parameter), "torch" = torch.optim.AdamW (fused on CUDA), "auto" = triton on a
    # CUDA / XPU device where Triton imports, torch elsewhere. Same arithmetic and state either way.
    implementation: Literal["auto", "torch", "triton"] = "auto"
    # On a CUDA GPU, the clip's gradient norm computed under the last backward, each gradient's as
    # soon as it is final, on a side stream (optimus_core.train.grad_norm), instead of one more
    # pass over every gradient after it. Same value up to float32 rounding.
    grad_norm_under_backward: bool = True
    # With grad_norm_under_backward and the triton experts: the expert weights' squared gradient
    # norms summed by the dW kernel from the values it stores (kernels.grouped_mm's dw_square),
    # instead of one more read of their gradients (12.9 GB per step for 8 OLMoE layers). Used
    # when the last backward makes the whole gradient (no earlier micro-batch added to it).
    grad_norm_from_dw: bool = True
    # On a CUDA GPU with the Triton AdamW on one process: the update queued on a side stream, stage
    # by stage (embedding, each block, head) in the forward's order, each stage's next forward
    # waiting for its own update only (optimus_core.train.update_stream). The memory-bound update
    # runs under the next forward. Same parameters bit for bit.
    update_beside_forward: bool = True

    def check(self) -> None:
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(all(0 <= b < 1 for b in self.betas), "betas", "must both be in [0, 1)")
        self._require(self.eps > 0, "eps", "must be > 0")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(self.grad_clip is None or self.grad_clip > 0, "grad_clip", "must be null or > 0")


@dataclass(frozen=True)
class ScheduleConfig(_Validated):
    """Learning rate: linear warmup, then cosine to ``min_lr_ratio`` x lr, or warmup-stable-decay."""

    _section: typing.ClassVar[str] = "schedule"

    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 2500
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr

    def check(self) -> None:
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self._require(0 < self.decay_fraction <= 1, "decay_fraction", "must be in (0, 1]")


@dataclass(frozen=True)
class DataConfig(_Validated):
    """The tokenized data: a directory written by ``optimus tokenize``."""

    _section: typing.ClassVar[str] = "data"

    path: str = ""
    seq_len: int = 4096
    seed: int = 0  # the shuffle of training sequences

    def check(self) -> None:
        self._require(self.seq_len >= 2, "seq_len", "must be >= 2")


@dataclass(frozen=True)
class ParallelConfig(_Validated):
    """Rank layout. ``dp`` is the world size / (tp * pp); experts split over ``ep`` ranks."""

    _section: typing.ClassVar[str] = "parallel"
    # fields of the ZeRO-1 optimizer's gradient buckets, which run configs written before full
    # sharding hold: read and dropped, so those runs still evaluate and export
    _retired: typing.ClassVar[frozenset] = frozenset({"grad_sync_chunk_mb", "overlap_grad_sync"})

    ep: int = 1
    tp: int = 1  # reserved: tensor parallelism is not implemented yet (must be 1)
    pp: int = 1  # reserved: pipeline parallelism is not implemented yet (must be 1)
    # The experts' weights, gradients and AdamW state: "ep_aware" shards them over the ranks that
    # hold the same experts (the expert-dp group), as the dense ones are over the world;
    # "ep_unaware" (the paper's baseline) keeps them whole on each of those ranks and all-reduces
    # their gradients (optimus_core.parallel.sharding, optimus_core.train.sharded_adamw).
    optimizer: Literal["ep_aware", "ep_unaware"] = "ep_aware"
    # Every collective (and the rendezvous) fails after this many seconds instead of waiting
    # forever for a dead or stuck rank (torch.distributed.init_process_group's timeout).
    collective_timeout_s: float = 1800.0
    # Ranks that shard the parameters between them, blocks of consecutive ranks (a multiple of ep
    # dividing the world); the blocks replicate each other and all-reduce the gradients once a
    # step (hybrid sharding: a layer's collectives span dp_shard ranks, not the world). 0: shard
    # over the whole world.
    dp_shard: int = 0
    # The dtype gradients are reduce-scattered in (each unit's, under the backward): float32
    # sums the bf16 gradients of a bf16 run without rounding them first; bfloat16 halves the traffic.
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # The EP token exchange's collective: all_to_all (variable splits: the least traffic), or
    # all_gather (every rank gathers every send buffer: ep times the bytes) for collective stacks
    # whose all-to-all is missing or hangs (reported for some xccl builds). Same results.
    dispatch: Literal["all_to_all", "all_gather"] = "all_to_all"

    def check(self) -> None:
        self._require(self.ep >= 1, "ep", "must be >= 1")
        self._require(self.dp_shard >= 0 and self.dp_shard % self.ep == 0, "dp_shard",
                      f"must be 0 (the whole world) or a multiple of ep ({self.ep})")
        self._require(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0 (seconds)")
        self._require(self.tp == 1, "tp", "must be 1 (tensor parallelism is not implemented yet)")
        self._require(self.pp == 1, "pp", "must be 1 (pipeline parallelism is not implemented yet)")


@dataclass(frozen=True)
class TrainConfig(_Validated):
    """How long and how: steps, batch in sequences, precision, cadences."""

    _section: typing.ClassVar[str] = "train"

    steps: int = 1000
    global_batch: int = 1024  # sequences per optimizer step, over all ranks
    micro_batch: int = 0  # sequences per forward/backward on one rank; 0 = global_batch / dp
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16 = autocast, fp32 master weights
    device: Literal["auto", "cpu", "cuda", "xpu"] = "auto"
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # 0 = only at the start and the end
    eval_batches: int = 8  # batches of held-out sequences per source per evaluation
    checkpoint_every: int = 0  # 0 = only at the end
    # ... and when this many minutes have passed since the last checkpoint (or the job's start):
    # large jobs see interrupts about hourly (ALCF), so a site sets 15-60 (0: by steps only)
    checkpoint_every_minutes: float = 0.0
    keep_checkpoints: int = 2  # the newest N checkpoints are kept ...
    keep_every: int = 0  # ... and every one at a multiple of this step (0: none)
    # Write checkpoints in the background from a CPU copy (training goes on meanwhile); the
    # newest is published (its step directory appears) when the next one starts or the run ends.
    async_checkpoint: bool = False
    # What the backward recomputes instead of keeping from the forward: "none"; "full": every
    # ``activation_checkpointing_every``-th block whole (its input is all it keeps); "moe": the
    # experts' GEMMs and SwiGLU only (the routed rows in, not the dispatch: no all-to-all is
    # repeated); "auto": the least recomputation that fits the device's memory budget
    # (optimus_core.memory; "none" where the budget is unknown, as on a CPU).
    activation_checkpointing: Literal["auto", "none", "full", "moe"] = "auto"
    activation_checkpointing_every: int = 1
    # GiB one rank may plan to allocate on its device (optimus_core.memory: the run is checked
    # against it before anything is allocated, and "auto" checkpointing fits it); None: the
    # usable share of the device's memory (none known on a CPU: unchecked).
    memory_budget_gib: Optional[float] = None
    # Under bf16: cast the experts' float32 weights inside each grouped GEMM (forward, and again
    # in backward) instead of keeping bf16 copies from forward to backward. Less memory (8
    # OLMoE-size layers, triton experts + compile on an H200: 74.8 -> 55.9 GiB peak), one more
    # cast pass per layer in backward (bench/NOTES.md).
    recast_expert_weights: bool = False
    # Under bf16 (without recast_expert_weights): keep a bf16 copy of the experts' float32
    # weights that the optimizer writes with each update (the Triton AdamW in the same pass, 2
    # more bytes per parameter; torch's AdamW and the sharded optimizer's all-gather by a cast
    # after), so the forward reads it instead of casting the weights every step. About the same
    # peak memory: the forward otherwise keeps such a copy for the backward (optimus_core.model.
    # experts; bench/train_step.py's "-casts" variants turn it off).
    expert_weight_casts: bool = True
    # The expert weights' gradients: "bfloat16" keeps them on those bf16 copies, as the bf16 dW
    # GEMM makes them (torch's autocast makes the same values, then widens them into a float32
    # .grad), and the Triton AdamW widens them as it reads: 6 GiB less at the end of the
    # backward, where an 8-layer mula-7b-a1b step peaked (59.4 -> 55.7 GiB on an H200), and 2
    # bytes less per expert parameter to write and read (-2.6 ms of 105; bench/NOTES.md). Needs
    # the copies (above, under bf16), the Triton AdamW, one process and one micro-batch per step
    # (micro-batches would add up in bf16). "auto": bfloat16 where all that holds, else float32
    # (the dW kernel writes float32 gradients on the weights).
    expert_grad_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # The LM head and the cross-entropy fused, a few thousand tokens at a time
    # (optimus_core.model.linear_cross_entropy): the same loss and gradients without the
    # micro-batch's full logits in bf16 and float32 and their gradients (several GB at 8192
    # tokens x 50k vocabulary) and with a third of the memory passes over them. Off: logits,
    # then F.cross_entropy, as evaluation does.
    fused_lm_loss: bool = True
    # With fused_lm_loss, each chunk's log-softmax, loss and gradient: "triton" = one kernel that
    # overwrites the logits with their gradient (kernels.cross_entropy; 6 bytes per bf16 logit
    # instead of torch's 20: -2 ms of a 110 ms step on an H200, bench/NOTES.md), "torch" = torch
    # ops, "auto" = triton on a CUDA / XPU device where Triton imports, torch elsewhere.
    lm_loss_softmax: Literal["auto", "torch", "triton"] = "auto"
    compile: bool = False
    # torch.compile's mode for each block: "reduce-overhead" replays the block's kernels as a
    # CUDA graph (no per-kernel launch cost on the host, which leaves the forward host-bound on
    # an H200: bench/NOTES.md), at the price of a static memory pool.
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    # A step whose loss is not finite, or above loss_spike_factor x the median of recent good
    # losses (None: only non-finite), is skipped; max_bad_steps in a row roll the run back to
    # its last checkpoint and skip the data seen since.
    loss_spike_factor: Optional[float] = 2.0
    max_bad_steps: int = 3
    # Start from these weights (a Hugging Face export directory, optimus_core.hf) instead of the
    # seeded initialisation; ignored when the run directory already holds a checkpoint.
    init_from: Optional[str] = None
    # A rank with no completed step for this many seconds reports itself (rank, last step) and
    # exits non-zero, so a launcher restarts the run from its checkpoint (optimus_core.train.
    # watchdog). Generous: it must outlast the torch.compile warm-up. 0 = off.
    watchdog_timeout_s: float = 1800.0
    # ... and a checkpoint save or load or an evaluation, each its own phase, this many (0: unwatched):
    # a multi-terabyte checkpoint at 12k ranks may outlast any step, and a dead file system must not
    # hang the job forever
    watchdog_io_timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):  # configs written before the modes
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")
        super().__post_init__()

    def check(self) -> None:
        self._require(self.steps >= 1, "steps", "must be >= 1")
        self._require(self.activation_checkpointing_every >= 1, "activation_checkpointing_every",
                      "must be >= 1 (1: every block)")
        self._require(self.memory_budget_gib is None or self.memory_budget_gib > 0, "memory_budget_gib",
                      "must be null (the device's) or > 0 GiB")
        self._require(self.global_batch >= 1, "global_batch", "must be >= 1")
        self._require(self.micro_batch >= 0, "micro_batch", "must be >= 0 (0 = no accumulation)")
        self._require(self.expert_grad_dtype != "bfloat16" or (
            self.dtype == "bfloat16" and self.expert_weight_casts and not self.recast_expert_weights),
            "expert_grad_dtype", "'bfloat16' needs the experts' bf16 weight copies: dtype = bfloat16, "
            "expert_weight_casts = true, recast_expert_weights = false")
        self._require(self.fused_lm_loss or self.lm_loss_softmax != "triton", "lm_loss_softmax",
                      "'triton' needs fused_lm_loss = true (the kernel is the fused loss's softmax part)")
        if self.micro_batch:
            self._require(self.global_batch % self.micro_batch == 0, "micro_batch",
                          f"must divide global_batch ({self.global_batch})")
        for name in ("log_every",):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("eval_every", "eval_batches", "checkpoint_every"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        self._require(self.checkpoint_every_minutes >= 0, "checkpoint_every_minutes", "must be >= 0 (0 = by steps only)")
        self._require(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        self._require(self.keep_every >= 0, "keep_every", "must be >= 0 (0 = keep only the newest)")
        self._require(self.loss_spike_factor is None or self.loss_spike_factor > 1, "loss_spike_factor",
                      "must be null or > 1")
        self._require(self.max_bad_steps >= 1, "max_bad_steps", "must be >= 1")
        self._require(self.watchdog_timeout_s >= 0, "watchdog_timeout_s", "must be >= 0 seconds (0 = no watchdog)")
        self._require(self.watchdog_io_timeout_s >= 0, "watchdog_io_timeout_s", "must be >= 0 seconds (0 = unwatched)")


@dataclass(frozen=True)
class RunConfig(_Validated):
    """Everything a training run resolves to; recorded in the run directory and the store."""

    preset: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def check(self) -> None:
        if self.data.seq_len > self.model.max_seq_len:
            _fail("data.seq_len", self.data.seq_len, f"must be <= model.max_seq_len ({self.model.max_seq_len})")
        if self.model.moe is not None and self.model.moe.n_experts % self.parallel.ep:
            _fail("parallel.ep", self.parallel.ep, f"must divide model.moe.n_experts ({self.model.moe.n_experts})")
        if self.model.moe is None and self.train.activation_checkpointing == "moe":
            _fail("train.activation_checkpointing", "moe", "needs an MoE model (model.moe); use 'full' or 'none'")

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.data.seq_len

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return from_dict(cls, json.loads(text))


# ----------------------------------------------------------------------------- overrides

def parse_value(text: str) -> Any:
    """``--set`` values: YAML scalars (``3``, ``1e-3``, ``true``, ``null``, ``[0.9, 0.95]``)."""
    import yaml

    return yaml.safe_load(text)


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """Return ``cfg`` with dotted-path overrides applied (``{"train.steps": 10}``), re-validated.

    Setting a nested config that is None (``model.moe.top_k`` on a dense model) is an error;
    set ``model.moe`` to a mapping first to add one.
    """
    data = cfg.to_dict()
    for dotted, value in overrides.items():
        keys = dotted.split(".")
        node, cls = data, type(cfg)
        for i, key in enumerate(keys):
            known = {f.name: f for f in fields(cls)} if dataclasses.is_dataclass(cls) else {}
            if key not in known:
                where = ".".join(keys[:i]) or "the run config"
                raise ConfigError(f"unknown field {'.'.join(keys[: i + 1])} (in {where}); known fields: "
                                  f"{', '.join(sorted(known))}")
            if i == len(keys) - 1:
                node[key] = value
                break
            if node.get(key) is None:
                raise ConfigError(f"{'.'.join(keys[: i + 1])} is null; set it to a mapping before setting {dotted}")
            hint = typing.get_type_hints(cls)[key]
            cls = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
            node = node[key]
    return from_dict(type(cfg), data)


# ----------------------------------------------------------------------------- analytic counts
# Methods on the config, as the house plan promises (``cfg.num_params()``); the arithmetic and
# its conventions live in optimus_core.flops.

def _num_params(self: ModelConfig) -> int:
    from . import flops
    return flops.num_params(self)


def _num_active_params(self: ModelConfig) -> int:
    from . import flops
    return flops.num_active_params(self)


def _flops_per_token(self: ModelConfig, seq_len: int) -> int:
    from . import flops
    return flops.flops_per_token(self, seq_len)


ModelConfig.num_params = _num_params
ModelConfig.num_active_params = _num_active_params
ModelConfig.flops_per_token = _flops_per_token
