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
    ParallelConfig  how ranks are arranged (data, expert and hybrid-sharded data parallel)
    ExecutionConfig how a run executes: precision, kernels, compile, recomputation, memory budget
    RunConfig       all of the above, the thing a run resolves and records
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Union

from . import flops
from .validation import MOVED, RETIRED, ConfigError, Validated, fail, from_dict

__all__ = ["MOVED", "RETIRED", "ConfigError", "DataConfig", "ExecutionConfig", "ModelConfig", "MoEConfig",
           "OptimConfig", "ParallelConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
           "from_dict", "parse_value"]


# ----------------------------------------------------------------------------- concerns

LB_LOSS_SCOPES = ("forward", "global")


@dataclass(frozen=True)
class MoEConfig(Validated):
    """Mixture-of-experts feed-forward: a softmax top-k router over ``n_experts`` SwiGLU experts."""

    _section: typing.ClassVar[str] = "model.moe"

    n_experts: int = 64
    top_k: int = 8
    d_expert: int = 1024  # SwiGLU hidden size of one expert
    # The auxiliary losses' coefficients (Transformer.aux_loss): the load-balancing loss's, of the
    # form lb_loss_form names, and the router z-loss's, on its mean over the MoE layers
    lb_loss_coef: float = 0.01
    # Which load-balancing loss: "all_layers", transformers' load_balancing_loss_func over the
    # router outputs of every layer together (the paper's runs: E * sum_e F_e * P_e with F_e the
    # share of all layers' top-k assignments to e times k and P_e e's mean probability over all
    # layers' tokens; k at balance); "per_layer", each layer's E * sum_e f_e * P_e averaged over
    # the layers (OLMoE's trainer, megablocks; 1 at balance)
    lb_loss_form: Literal["all_layers", "per_layer"] = "per_layer"
    # Over which tokens the share of assignments is counted: "forward", each rank's micro-batch
    # (OLMoE's recipe: megablocks' per-forward statistic, so the objective depends on the layout);
    # "global", the counts summed over the data-parallel ranks and the step's micro-batches so far
    # (Megatron's global auxiliary loss: the same objective on 1 or N ranks, one micro-batch each).
    lb_loss_scope: str = "forward"
    z_loss_coef: float = 0.001  # router z-loss: mean over tokens of logsumexp(logits)^2
    norm_topk_probs: bool = False  # OLMoE does not renormalise the top-k probabilities
    # aux-loss-free balancing (DeepSeek-V3 style): a per-expert bias added to the routing scores
    # for selection only, nudged by ``bias_update_rate`` towards balance after each step.
    bias_update_rate: float = 0.0
    # capacity factor: None = dropless (default); c > 0 keeps at most ceil(c * T * k / E) tokens
    # per expert and drops the rest (their expert output is zero; the residual carries them).
    capacity_factor: Optional[float] = None

    def check(self) -> None:
        self._require(self.n_experts >= 1, "n_experts", "must be >= 1")
        self._require(1 <= self.top_k <= self.n_experts, "top_k", f"must be between 1 and n_experts ({self.n_experts})")
        self._require(self.d_expert >= 1, "d_expert", "must be >= 1")
        self._require(self.lb_loss_coef >= 0, "lb_loss_coef", "must be >= 0")
        self._require(self.z_loss_coef >= 0, "z_loss_coef", "must be >= 0")
        self._require(self.lb_loss_scope in LB_LOSS_SCOPES, "lb_loss_scope", f"must be one of {LB_LOSS_SCOPES}")
        self._require(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")
        self._require(self.capacity_factor is None or self.capacity_factor > 0, "capacity_factor",
                      "must be null (dropless) or > 0")


@dataclass(frozen=True)
class ModelConfig(Validated):
    """A decoder-only transformer: pre-norm (RMSNorm or OLMo-1B's non-parametric LayerNorm), RoPE,
    optional QK-norm, SwiGLU or MoE feed-forward, untied embeddings."""

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
    # The pre-norms and the final norm: "rmsnorm" with a learned scale (OLMoE), or
    # "nonparametric_layernorm", LayerNorm with neither weight nor bias (OLMo-1B)
    norm: Literal["rmsnorm", "nonparametric_layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Every matrix starts N(0, init_std), truncated at init_truncation x init_std (OLMo-core's
    # OLMoE recipe: 3), or not truncated (null: transformers' init, which the paper's runs used)
    init_truncation: Optional[float] = 3.0
    # The padding token's embedding row: zero from the start and never updated (its gradient is
    # zero, as nn.Embedding's padding_idx makes it). null: every row is a token's.
    pad_token_id: Optional[int] = None
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
        self._require(self.init_truncation is None or self.init_truncation > 0, "init_truncation",
                      "must be null (untruncated) or > 0 standard deviations")
        self._require(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size, "pad_token_id",
                      f"must be null or a token id below vocab_size ({self.vocab_size})")

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

    # Analytic counts (tested against the real model); the arithmetic and its conventions are
    # optimus_core.flops'.
    def num_params(self) -> int:
        """Every parameter of the instantiated model."""
        return flops.num_params(self)

    def num_active_params(self) -> int:
        """The parameters one token touches: only ``top_k`` of each MoE layer's experts."""
        return flops.num_active_params(self)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``."""
        return flops.flops_per_token(self, seq_len)

    def recompute_flops_per_token(self, seq_len: int, mode: str, every: int = 1) -> int:
        """The forward FLOPs per token activation checkpointing ``mode`` repeats in the backward."""
        return flops.recompute_flops_per_token(self, seq_len, mode, every)


@dataclass(frozen=True)
class OptimConfig(Validated):
    """AdamW (decoupled weight decay; norms, biases and embeddings' decay as OLMoE) + clipping."""

    _section: typing.ClassVar[str] = "optim"

    lr: float = 4e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: Optional[float] = 1.0  # max global grad norm; None disables clipping
    # Clip only from the end of the warmup on (schedule.warmup_steps), as the paper's runs did;
    # false: from the first step
    clip_after_warmup: bool = False
    # Weight decay on every parameter, the norm scales included (the paper's runs: one group),
    # instead of on the matrices only (OLMoE's groups)
    decay_norms: bool = False

    def check(self) -> None:
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(all(0 <= b < 1 for b in self.betas), "betas", "must both be in [0, 1)")
        self._require(self.eps > 0, "eps", "must be > 0")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(self.grad_clip is None or self.grad_clip > 0, "grad_clip", "must be null or > 0")


@dataclass(frozen=True)
class ScheduleConfig(Validated):
    """Learning rate: linear warmup, then cosine to ``min_lr_ratio`` x lr over the decay horizon,
    or warmup-stable-decay (optimus_core.train.schedule)."""

    _section: typing.ClassVar[str] = "schedule"

    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 2500
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr
    # Where the warmup starts: "zero" (lr x (step + 1) / warmup_steps) or "min_lr" (linear from
    # min_lr_ratio x lr at step 0 to lr at warmup_steps: the paper's runs)
    warmup_from: Literal["zero", "min_lr"] = "zero"
    # The steps the decay spans, separate from how long the run trains: "run" (the run's own
    # steps: the floor at its last step), "epoch" (one epoch of the training data, in whole global
    # batches, counted when the run starts: the paper's, whose 100B-token runs stop early on that
    # horizon), or a number of steps (the floor at that step). The lr stays at the floor past it.
    decay_horizon: Union[int, Literal["run", "epoch"]] = "run"

    def check(self) -> None:
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self._require(0 < self.decay_fraction <= 1, "decay_fraction", "must be in (0, 1]")
        if isinstance(self.decay_horizon, int):
            self._require(self.decay_horizon > self.warmup_steps, "decay_horizon",
                          f"must be 'run', 'epoch' or a number of steps above warmup_steps ({self.warmup_steps})")


@dataclass(frozen=True)
class DataConfig(Validated):
    """The tokenized data: a directory written by ``optimus tokenize``."""

    _section: typing.ClassVar[str] = "data"

    path: str = ""
    seq_len: int = 4096
    seed: int = 0  # the shuffle of training sequences
    # How training sequences are cut and ordered (optimus_core.data.loader): "stream", seq_len + 1
    # tokens at a time from the split's files as one stream, a fresh permutation each epoch;
    # "file_windows", each file cut into seq_len-token windows (its tail dropped; seq_len - 1
    # tokens predicted in each), one permutation of all windows by numpy's legacy generator seeded
    # with data.seed, data rank r taking every (data ranks)-th window of each step's block (the
    # paper's runs: optimus_core.data.windows)
    order: Literal["stream", "file_windows"] = "stream"

    def check(self) -> None:
        self._require(self.seq_len >= 2, "seq_len", "must be >= 2")


@dataclass(frozen=True)
class ParallelConfig(Validated):
    """Rank layout: every rank is data parallel; experts split over ``ep`` ranks."""

    _section: typing.ClassVar[str] = "parallel"

    ep: int = 1
    # Where the dense parameters' float32 weights, gradients and AdamW state live (the experts'
    # are sharded over the ranks that hold the same experts, the expert-dp group, either way):
    # "ep_aware" shards them over every rank (the paper's EP-aware optimizer, its runs');
    # "dp_sharded" over the data-parallel ranks only, replicated over the EP group with their
    # gradients all-reduced over it (the paper's baseline: optimus_core.parallel.sharding).
    # The same at ep 1.
    optimizer: Literal["ep_aware", "dp_sharded"] = "ep_aware"
    # Every collective (and the rendezvous) fails after this many seconds instead of waiting
    # forever for a dead or stuck rank (torch.distributed.init_process_group's timeout).
    collective_timeout_s: float = 1800.0
    # Ranks that shard the parameters between them, blocks of consecutive ranks (a multiple of ep
    # dividing the world); the blocks replicate each other and all-reduce the gradients once a
    # step (hybrid sharding: a layer's collectives span dp_shard ranks, not the world). 0: shard
    # over the whole world.
    dp_shard: int = 0
    # The dtype a bf16 run's gradients are reduce-scattered in (each unit's, under the backward):
    # float32 sums the bf16 gradients without rounding them first; bfloat16 halves the traffic
    # (the paper's runs). A float32 run reduces in float32.
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # EP groups (consecutive ranks) may span nodes, their exchange then crossing the network;
    # false: a launch whose EP groups would not each sit on one node stops before training
    # (optimus_core.parallel.mesh). The paper's EP groups are one node's tiles.
    ep_across_nodes: bool = False
    # Pipeline stages the model's layers are cut into (optimus_core.parallel.pipeline): the rank
    # order is DP, PP, EP (an EP group one node's ranks, a pipeline across nodes); every other
    # choice above applies within a stage, over its world / pp ranks. 1: no pipeline.
    pp: int = 1
    # Layers of each stage, first to last (pp x pp_chunks of them), where the layers are not cut
    # evenly; empty: an even cut
    pp_split: tuple[int, ...] = ()
    # The pipeline's schedule: "1f1b" (the paper's: one forward, one backward, in-flight
    # micro-batches at most the stages ahead) or "interleaved_1f1b" (each rank holds pp_chunks
    # stages, rank r stages r, r + pp, ...: a smaller bubble, more activations in flight)
    pp_schedule: Literal["1f1b", "interleaved_1f1b"] = "1f1b"
    # Stages each rank holds: 1 under 1f1b, 2 or more under interleaved_1f1b
    pp_chunks: int = 1

    def check(self) -> None:
        self._require(self.ep >= 1, "ep", "must be >= 1")
        self._require(self.pp >= 1, "pp", "must be >= 1")
        self._require(self.pp_chunks >= 1, "pp_chunks", "must be >= 1")
        self._require((self.pp_chunks > 1) == (self.pp_schedule == "interleaved_1f1b"), "pp_chunks",
                      f"{self.pp_chunks} with parallel.pp_schedule {self.pp_schedule!r}: interleaved_1f1b holds 2 or "
                      f"more stages per rank, 1f1b one")
        self._require(not self.pp_split or len(self.pp_split) == self.stages, "pp_split",
                      f"must give the layers of each of the {self.stages} stages (parallel.pp x pp_chunks), or be "
                      f"empty")
        self._require(all(n >= 1 for n in self.pp_split), "pp_split", "a stage of no layers: every stage needs one")
        self._require(self.dp_shard >= 0 and self.dp_shard % self.ep == 0, "dp_shard",
                      f"must be 0 (the whole world) or a multiple of ep ({self.ep})")
        self._require(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0 (seconds)")
        self._require(self.optimizer != "dp_sharded" or self.dp_shard == 0, "optimizer",
                      "'dp_sharded' shards over the data-parallel ranks: it needs parallel.dp_shard = 0")

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks of pp_chunks stages each."""
        return self.pp * self.pp_chunks

    def stage_world(self, world_size: int) -> int:
        """The ranks one pipeline stage is built, sharded and updated on, of a run of
        ``world_size`` (world_size without stages); ConfigError where pp does not divide it."""
        if world_size % self.pp:
            fail("parallel.pp", self.pp, f"must divide the world size ({world_size} ranks)")
        return world_size // self.pp

    def check_micro_batches(self, micro_batches: int) -> None:
        """ConfigError where a step's ``micro_batches`` cannot run under the schedule: none at all,
        or, interleaved, not a multiple of pp."""
        if micro_batches < 1:
            fail("train.micro_batch", micro_batches, "leaves no micro-batch a step for the pipeline")
        if self.pp_chunks > 1 and micro_batches % self.pp:
            fail("parallel.pp_schedule", self.pp_schedule, f"{micro_batches} micro-batches a step must be a "
                 f"multiple of parallel.pp ({self.pp}); set train.micro_batch so they are")

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds: itself, then every pp-th after it."""
        return [pp_rank + chunk * self.pp for chunk in range(self.pp_chunks)]

    def stage_layers(self, n_layers: int) -> list[tuple[int, int]]:
        """The layers of each pipeline stage (``stages`` of them) as [first, stop) ranges:
        ``pp_split`` where given, else an even cut; ConfigError naming the field where the
        model's ``n_layers`` cannot be cut so.

        >>> ParallelConfig(pp=2).stage_layers(8)
        [(0, 4), (4, 8)]
        >>> ParallelConfig(pp=2, pp_split=(3, 4)).stage_layers(7)
        [(0, 3), (3, 7)]
        """
        pp = self.stages
        if pp > n_layers:
            fail("parallel.pp", self.pp, f"x pp_chunks {self.pp_chunks}: more pipeline stages than the model's "
                 f"{n_layers} layers" if self.pp_chunks > 1 else f"more pipeline stages than the model's {n_layers} "
                 f"layers")
        if self.pp_split:
            if sum(self.pp_split) != n_layers:
                fail("parallel.pp_split", list(self.pp_split), f"its layers add up to {sum(self.pp_split)}, "
                     f"the model has {n_layers}")
            counts = list(self.pp_split)
        elif n_layers % pp:
            base, extra = divmod(n_layers, pp)
            example = ",".join(str(base + (i >= pp - extra)) for i in range(pp))
            fail("parallel.pp", self.pp, f"does not cut the model's {n_layers} layers evenly into {pp} stages: give "
                 f"each stage's layers in parallel.pp_split (e.g. [{example}])")
        else:
            counts = [n_layers // pp] * pp
        starts = [sum(counts[:i]) for i in range(pp)]
        return [(first, first + c) for first, c in zip(starts, counts)]


@dataclass(frozen=True)
class TrainConfig(Validated):
    """How long and how: steps, batch in sequences, precision, cadences."""

    _section: typing.ClassVar[str] = "train"

    steps: int = 1000
    global_batch: int = 1024  # sequences per optimizer step, over all ranks
    micro_batch: int = 0  # sequences per forward/backward on one rank; 0 = global_batch / dp
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
    # A model-only checkpoint (the weights, none of the optimizer state: a third of a full one's
    # bytes) every N steps, all kept, for the evaluation curves of a long run (the paper's "cold"
    # checkpoints, in run_dir/model_checkpoints/); 0: none
    model_checkpoint_every: int = 0
    # Ranks write a checkpoint in this many waves, by data-parallel replica (replica d in wave
    # d mod W; a replica's ranks, one node's under the paper's rank order, together), each wave
    # after the one before: at most 1/W of the replicas write at once (each manifest records its
    # window; checkpoint.concurrent_writers). 1: every rank at once. What a replicated part is
    # written once, by one replica, DCP already spreads over the replicas.
    checkpoint_write_waves: int = 1
    # Write checkpoints in the background from a CPU copy (training goes on meanwhile); the
    # newest is published (its step directory appears) when the next one starts or the run ends.
    async_checkpoint: bool = False
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

    def check(self) -> None:
        self._require(self.steps >= 1, "steps", "must be >= 1")
        self._require(self.global_batch >= 1, "global_batch", "must be >= 1")
        self._require(self.micro_batch >= 0, "micro_batch", "must be >= 0 (0 = no accumulation)")
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
        self._require(self.model_checkpoint_every >= 0, "model_checkpoint_every", "must be >= 0 (0 = none)")
        self._require(self.checkpoint_write_waves >= 1, "checkpoint_write_waves", "must be >= 1 (1: all at once)")
        self._require(self.loss_spike_factor is None or self.loss_spike_factor > 1, "loss_spike_factor",
                      "must be null or > 1")
        self._require(self.max_bad_steps >= 1, "max_bad_steps", "must be >= 1")
        self._require(self.watchdog_timeout_s >= 0, "watchdog_timeout_s", "must be >= 0 seconds (0 = no watchdog)")
        self._require(self.watchdog_io_timeout_s >= 0, "watchdog_io_timeout_s", "must be >= 0 seconds (0 = unwatched)")


@dataclass(frozen=True)
class ExecutionConfig(Validated):
    """How a run executes on its devices, not what it trains: every choice here leaves the model's
    parameters, the data order and the checkpoint format as they are (a run resumes under other
    choices), and changes its numbers by rounding only (bf16 autocast the most).

    ``"auto"`` (the default of each) is resolved per run by optimus_core.execution.plan_execution
    into the fastest path validated on the device at hand; its printed plan says what each became
    and why. An explicit choice the device cannot run is an error naming the choice and the reason.
    """

    _section: typing.ClassVar[str] = "execution"

    # bfloat16: autocast with float32 master weights and AdamW state. auto: bfloat16 on a GPU,
    # float32 on a CPU (no fast bf16 matmul there)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # the experts' GEMMs: "triton" (kernels/), "torch" (torch._grouped_mm), "loop" (one matmul per
    # expert, the ablation's baseline). auto: triton where it passed its self-check on the
    # device (optimus_kernels.selfcheck), else torch where torch._grouped_mm has a fast path, else loop
    experts: Literal["auto", "loop", "torch", "triton"] = "auto"
    # torch.compile of each block. auto: on for one CUDA GPU (measured faster there), off on a
    # CPU and on XPU (not measured there yet)
    compile: Union[bool, Literal["auto"]] = "auto"
    # the AdamW update: "triton" (one streaming kernel per tensor, optimus_kernels.adamw) or "torch"
    # (torch.optim.AdamW). auto: triton on a GPU where it passed its self-check, else torch
    adamw: Literal["auto", "torch", "triton"] = "auto"
    # the fused LM loss's log-softmax and gradient: "triton" (optimus_kernels.cross_entropy) or torch
    # ops. auto: triton on a GPU where it passed its self-check, else torch
    lm_loss: Literal["auto", "torch", "triton"] = "auto"
    # the attention's QK-norm and RoPE: "triton" (one pass each way per projection,
    # optimus_kernels.qk_norm_rope) or torch ops. auto: triton on a GPU where it passed its self-check,
    # else torch; torch for a model without QK-norm
    qk_norm_rope: Literal["auto", "torch", "triton"] = "auto"
    # What the backward recomputes instead of keeping from the forward: "none"; "full": every
    # ``activation_checkpointing_every``-th block whole (its input is all it keeps); "moe": the
    # experts' GEMMs and SwiGLU only (the routed rows in, not the dispatch); "level<N>": the
    # authors' recompute levels, a bitmask over every layer (optimus_core.flops.LEVEL_BITS): 1 the
    # MoE block after its routing (its exchange, the experts, the combine), 2 the attention
    # (projections, QK-norm, RoPE, scores), 4 the norms (the paper's Mula-100B-A7B: level1,
    # Mula-220B-A10B: level7). auto: the least recomputation of none, moe and full that fits
    # memory_budget_gib with the memory model's error to spare, else the least that fits
    # (optimus_core.memory.fit_checkpointing; "none" where no budget is known)
    activation_checkpointing: Literal["auto", "none", "full", "moe", "level1", "level2", "level3", "level4",
                                      "level5", "level6", "level7"] = "auto"
    activation_checkpointing_every: int = 1
    # GiB one rank may plan to allocate on its device: the run is checked against it before
    # anything is allocated. None: the usable share of the device's memory (a CPU's is unknown)
    memory_budget_gib: Optional[float] = None
    # Under bf16 on one process: the experts' float32 weights cast inside each grouped GEMM
    # (forward, and again in backward) instead of bf16 copies that the optimizer keeps: less
    # memory for a little more time
    recast_expert_weights: bool = False
    # Under bf16: the residual stream (the blocks' inputs and outputs, and their gradients) in
    # float32 instead of bf16 (Megatron's --fp32-residual-connection). Off: bf16, as OLMo-core's
    # FSDP recipe for OLMoE-1B-7B keeps it; half the residual's bytes kept and moved
    fp32_residual: bool = False
    # How tokens reach their experts across an EP group (optimus_core.parallel.expert_parallel):
    # "all_to_all", each token only to the ranks of its experts (variable splits, the least
    # traffic); "all_gather", the paper's: every rank's tokens all-gathered, each rank's partial
    # outputs reduce-scattered back (equal-size collectives; ep x the tokens' bytes). auto: the
    # paper's on XPU (oneCCL's variable all-to-all fails with empty splits), the all-to-all
    # elsewhere (fewer bytes; not measured against the other on a GPU yet)
    expert_exchange: Literal["auto", "all_to_all", "all_gather"] = "auto"
    # How often several ranks gather their sharded weights (optimus_core.parallel.sharding):
    # "per_micro_batch", each unit before its forward and again before its backward in every
    # micro-batch, its gradients reduce-scattered after each backward (ZeRO-3); "per_step", the
    # paper's granularity: each unit gathered once, in the step's first forward, and kept through
    # its micro-batches, the gradients accumulated whole and reduced once, in the last backward
    # (the gathers and reductions of one micro-batch, for the memory of the whole gathered share).
    # auto: per_step where a rank runs several micro-batches a step and the memory model says it
    # fits the budget, else per_micro_batch
    weight_gathers: Literal["auto", "per_micro_batch", "per_step"] = "auto"
    # Import intel_extension_for_pytorch on an XPU run (its optimized xpu ops). Off: Intel archived
    # it and ALCF deprecates its import; torch's own xpu runs everything here, and a run imports it
    # only when it asks, on one rank as on many.
    intel_extension: bool = False

    def check(self) -> None:
        self._require(self.activation_checkpointing_every >= 1, "activation_checkpointing_every",
                      "must be >= 1 (1: every block)")
        self._require(self.memory_budget_gib is None or self.memory_budget_gib > 0, "memory_budget_gib",
                      "must be null (the device's) or > 0 GiB")


@dataclass(frozen=True)
class RunConfig(Validated):
    """Everything a training run resolves to; recorded in the run directory and the store."""

    preset: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

    def check(self) -> None:
        if self.data.seq_len > self.model.max_seq_len:
            fail("data.seq_len", self.data.seq_len, f"must be <= model.max_seq_len ({self.model.max_seq_len})")
        if self.model.moe is not None and self.model.moe.n_experts % self.parallel.ep:
            fail("parallel.ep", self.parallel.ep, f"must divide model.moe.n_experts ({self.model.moe.n_experts})")
        if self.parallel.pp > 1:
            self.parallel.stage_layers(self.model.n_layers)
            if self.model.moe is not None and self.model.moe.lb_loss_scope == "global":
                fail("model.moe.lb_loss_scope", "global", "is not carried between pipeline stages (parallel.pp "
                     f"= {self.parallel.pp}); use 'forward'")
        checkpointing = self.execution.activation_checkpointing
        if self.model.moe is None and (checkpointing == "moe" or flops.level_bits(checkpointing) & 1):
            fail("execution.activation_checkpointing", checkpointing, "recomputes the MoE block: it needs an MoE "
                 "model (model.moe); use 'full', 'none' or a level without bit 1")
        if self.execution.expert_exchange == "all_gather" and self.model.moe is not None \
                and self.model.moe.capacity_factor is not None:
            fail("execution.expert_exchange", "all_gather", "the paper's exchange is dropless: it needs "
                 f"model.moe.capacity_factor = null (got {self.model.moe.capacity_factor})")

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
    """``--set`` values: YAML scalars (``3``, ``1e-3``, ``true``, ``null``, ``[0.9, 0.95]``), with
    a number read as a user writes it: YAML 1.1 takes ``1e-3`` (no dot) for a string."""
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() not in ("nan", "inf", "+inf", "-inf", "infinity") \
                else value
        except ValueError:
            return value
    return value


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """Return ``cfg`` with dotted-path overrides applied (``{"train.steps": 10}``), re-validated.

    Setting a nested config that is None (``model.moe.top_k`` on a dense model) is an error;
    set ``model.moe`` to a mapping first to add one.
    """
    data = cfg.to_dict()
    for dotted, value in overrides.items():
        if dotted in MOVED:
            raise ConfigError(f"{dotted} is now {MOVED[dotted]} (the execution section: how a run executes)")
        if dotted in RETIRED:
            raise ConfigError(f"{dotted} is no longer a choice: {RETIRED[dotted]}")
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
