"""THE experiment registry: every run of the paper, at paper scale and at laptop scale.

Snakemake (workflow/rules/*.smk), the `optimus` command (``--experiment NAME --scale S``) and
the Parsl launcher (workflow/launch.py, workflow/plan.py) all read this module; nothing else
says how long a run is, on how many tiles, or with which layout (the house rule: one source of
truth per fact). Model shapes are not here: they live in optimus_core/presets.py.

    >>> from workflow.experiments import get, pretraining, dag, scaleup
    >>> exp = get("pretrain-mula-7b-a1b")
    >>> exp.paper.steps, exp.paper.batch, exp.laptop.steps
    (635783, 3072, 240)
    >>> len(dag("laptop")), len(dag("paper"))
    (5, 22)
    >>> [e.name for e in scaleup()]
    ['pretrain-mula-20b-a2b', 'pretrain-mula-100b-a7b', 'pretrain-mula-220b-a10b']

The runs
- pretraining (kind ``pretrain``): mula-1b and mula-7b-a1b to 4T tokens on 3072 tiles; the
  scale-up models mula-20b-a2b, mula-100b-a7b, mula-220b-a10b to 100B tokens.
- strong scaling (kind ``scaling``): mula-220b-a10b at 384 ... 12288 tiles, a fixed global batch
  and a fixed number of steps, so time per step is the only thing that changes.
- ablation (kind ``ablation``): the authors' own A/B (their README, "OLMoE Pretraining"):
  OLMoE-1B-7B rescaled ``SE1.125`` (72 experts), 32 steps at context 2048, one sequence per data
  rank (run_experiment.sh's batch), in their layouts DP12 and EP12 (one node), DP8-EP12 and
  DP2-PP4-EP12 (8 nodes; the pipeline's 4 micro-batches of one sequence per pipeline); in each,
  the per-expert loop against our kernels (the kernel arm), and at EP 12 the paper's baseline
  optimizer against the EP-aware one (the optimizer arm).

Tile counts, batch and context are the authors' (GitHub IntelLabs/Optimus-LM,
``submit_aurora_job_paper.pbs``, read 2026-12-06): every paper run on 256 nodes (3072 tiles), 3072
sequences of 2048 tokens a step (6.29M tokens: the presets' recipe, optimus_core/presets.py), so
4T tokens take 635,783 steps and 100B tokens 15,895. The decay horizon is one epoch of the data
(``schedule.decay_horizon = "epoch"``), also for the 100B-token runs, which stop early on it.
Expert parallelism is the authors' degree, 12 (one node's tiles) for Mula-20B-A2B, -100B-A7B and
-220B-A10B, none for Mula-1B and -7B-A1B. The 100B and 220B runs are the authors' layouts
(``submit_aurora_job_paper.pbs``): Mula-100B-A7B in 4 pipeline stages of 12 layers (1F1B, 4
micro-batches of one sequence per pipeline and step), recompute level 1 (the MoE block); Mula-
220B-A10B in 8 stages of 8 layers (8 micro-batches), recompute level 7 (MoE block, attention,
norms). Our own design for them stays registered by name (``Experiment.layouts``, DESIGNS):
"zero3-blocks", no pipeline, every parameter sharded in blocks of 384 tiles (below) with the
least recomputation its tiles need; `optimus pretrain|plan|rehearse --layout zero3-blocks`
selects it, and the report compares the two designs on the same runs.

Every paper-scale run trains in micro-batches of one sequence per tile (``train.micro_batch=1``,
what the performance model prices), accumulating ``global_batch / tiles`` of them per step, so
``global_batch`` must be a multiple of ``tiles x micro_batch``; RunScale checks it for every run.

Every paper-scale run of more than 384 tiles shards its parameters in blocks of 384 tiles (32
nodes: ``parallel.dp_shard``, the strong-scaling sweep's smallest job; with pipeline stages,
blocks of at most a stage's tiles) and replicates them over the blocks (hybrid sharding): a
layer's all-gathers and reduce-scatters then span at most 32 nodes, not up to 1024 (whose ring
latency workflow/perfmodel/ puts at 61% efficiency at 12288 tiles, against 95% in blocks), and
the per-tile state stays within the tile's memory
(optimus_core/memory.py: at most 1/12 of an EP rank's experts per tile). Activation
checkpointing is ``auto``: the least recomputation that fits a 64 GiB tile with the
memory model's error to spare (optimus_core.memory.FIT_MARGIN), resolved
by `optimus plan` (its GiB/tile column) and again by each run on its device. The strong-scaling
sweep is the exception: its smallest size's choice is pinned for all its sizes
(SCALING_CHECKPOINTING), so that every point does the same work per step.

Strong scaling keeps one global batch of 12288 sequences of 2048 tokens (25M tokens) for 6 steps,
EP 12 everywhere, in the authors' layout of Mula-220B-A10B (PP 8, recompute level 7): at 12288
tiles 8 micro-batches of one sequence per pipeline, at 384 tiles 256. What is known of the
authors' sweep: its sizes (384 to 12288 tiles), the model and its layout; its batch is not in
their code, so this batch is our assumption, the smallest that gives every point whole
micro-batches of one sequence in our own design ("zero3-blocks": one sequence per tile at
12288, 32 accumulated per tile at 384), where every point runs SCALING_CHECKPOINTING. A timed
run fits one job with room (workflow/plan.py), and the 384-tile point must fit the one-hour
debug-scaling queue (32 nodes is below prod's smallest tier).

Laptop proxies: the tiny presets (``<name>@laptop``: the same tags on tiny bases,
optimus_core/presets.py), one CPU process each, with the paper's recipe at a laptop's scale. The
laptop DAG (``dag("laptop")``, what `make reproduce` trains) holds every pretraining run: the two
4T proxies, LAPTOP_4T_STEPS steps each, and the three scale-up proxies, LAPTOP_SCALEUP_STEPS
steps each on the same corpus and batch, all five on one decay horizon, the 4T proxies' length
(LAPTOP_EVAL's comment says why). The scale-up proxies are evaluated on held-out loss only, on
fewer batches (``scaleup_eval`` in workflow/config/laptop.yaml: the lm-eval tasks would cost more
than their training); the 4T proxies' every 40th checkpoint is evaluated on held-out loss and the
offline tasks, the stand-ins of the paper's lm-eval tasks.
``scaleup_figure(scale)`` names the runs results/figures/scaleup.png draws. The scaling and
ablation proxies are registered (and runnable one by one with ``optimus pretrain --experiment
NAME``) but kept out of ``rule all``: their point is time on many devices, not a CPU curve.
The laptop ablation's kernel arms use the Triton kernels, which need ``triton`` and, on a CPU,
``TRITON_INTERPRET=1`` (slow); its optimizer arms equal the others with one process (the two
optimizers differ only where an EP group holds the dense parameters several times).

An EP group must be one node's tiles (or a divisor of them): a run whose EP degree does not divide
a node's TILES_PER_NODE is refused unless its overrides set ``parallel.ep_across_nodes``, so that
no registered layout sends its expert exchange over the network by accident.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from optimus_core import presets
from optimus_core.config import ConfigError

Scale = Literal["laptop", "paper"]
# The designs of a paper-scale run (Experiment.layouts): the authors' layout, every run's
# default, and ours where it differs (the module doc)
AUTHORS = "authors"
DESIGNS = (AUTHORS, "zero3-blocks")
Kind = Literal["pretrain", "scaling", "ablation"]
KINDS = ("pretrain", "scaling", "ablation")
TILES_PER_NODE = 12  # Aurora: 6 PVC GPUs x 2 tiles, one rank per tile


@dataclass(frozen=True)
class RunScale:
    """One experiment at one scale: what is trained, on how much data, on how many devices.

    ``global_batch`` is in sequences (0 = the preset's); ``ep`` the expert-parallel degree;
    ``walltime_h`` the walltime of one PBS job (a run longer than that spans several jobs,
    each resuming from the last checkpoint).
    """

    preset: str
    tokens: int  # training token budget
    devices: int  # GPU tiles (paper) or CPU processes (laptop)
    walltime_h: float = 0.0  # per PBS job (paper scale); 0: the longest its queue allows (timed: what it needs)
    extra: dict[str, Any] = field(default_factory=dict)  # further --set overrides
    ep: int = 1
    global_batch: int = 0
    dp_shard: int = 0  # shard block in ranks (parallel.dp_shard); 0 or >= a stage's devices: the whole stage
    timed: bool = False  # measured, not trained to a result (scaling, ablation): one job with room, never resumed
    pp: int = 1  # pipeline stages (parallel.pp): devices / pp tiles per stage

    def __post_init__(self):
        presets.get(self.preset)  # unknown preset names fail at import, not at submit time
        if self.devices < 1:
            raise ConfigError(f"devices = {self.devices}: must be >= 1")
        if self.global_batch < 0:
            raise ConfigError(f"global_batch = {self.global_batch}: must be >= 0 (0 = the preset's)")
        if self.tokens < self.tokens_per_step:
            raise ConfigError(f"tokens = {self.tokens}: less than one step ({self.tokens_per_step} tokens)")
        cfg = self.run_config()  # ep must divide the experts, overrides must name real fields
        if self.devices > 1 and TILES_PER_NODE % self.ep and not cfg.parallel.ep_across_nodes:
            raise ConfigError(f"ep = {self.ep}: an EP group must sit on one node of {TILES_PER_NODE} tiles (ep "
                              f"dividing {TILES_PER_NODE}); set parallel.ep_across_nodes in its overrides to run "
                              f"its exchange across nodes")
        if self.devices % (self.pp * self.ep):
            raise ConfigError(f"pp = {self.pp} x ep = {self.ep}: must divide devices ({self.devices})")
        data = self.data_devices
        micro = cfg.train.micro_batch or max(1, self.batch // data)  # 0: the whole local batch at once
        if self.batch % (data * micro):
            what = "devices" if self.pp == 1 else "devices / pp"
            raise ConfigError(f"global_batch = {self.batch}: must be a multiple of {what} x micro_batch "
                              f"({data} x {micro} = {data * micro} sequences), so that every "
                              f"rank runs whole micro-batches")

    @classmethod
    def for_steps(cls, preset: str, steps: int, devices: int, **kw: Any) -> "RunScale":
        """A run of a fixed number of steps (scaling, ablation): tokens = steps x tokens per step."""
        gb = kw.get("global_batch") or presets.get(preset).global_batch
        return cls(preset, steps * gb * presets.get(preset).seq_len, devices, **kw)

    @property
    def batch(self) -> int:
        return self.global_batch or presets.get(self.preset).global_batch

    @property
    def tokens_per_step(self) -> int:
        return self.batch * presets.get(self.preset).seq_len

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_step)

    @property
    def nodes(self) -> int:
        return math.ceil(self.devices / TILES_PER_NODE)

    @property
    def data_devices(self) -> int:
        """Devices that read distinct sequences: one pipeline stage's (all of them without stages)."""
        return self.devices // self.pp

    def overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {"train.steps": self.steps}
        if self.global_batch:
            out["train.global_batch"] = self.global_batch
        if self.ep != 1:
            out["parallel.ep"] = self.ep
        if self.pp != 1:
            out["parallel.pp"] = self.pp
        if self.dp_shard and self.dp_shard < self.data_devices:
            out["parallel.dp_shard"] = self.dp_shard
        return {**out, **self.extra}

    def run_config(self):
        return presets.get(self.preset).run_config(**self.overrides())

    def at_tiles(self, tiles: int) -> "RunScale":
        """This run's layout on ``tiles`` tiles (a rehearsal of it there): the global batch raised
        to a multiple of tiles x micro-batch where it is short, the shard block capped at ``tiles``."""
        if tiles == self.devices:
            return self
        micro = self.run_config().train.micro_batch or 1
        data = tiles // self.pp
        batch = self.batch if self.batch % (data * micro) == 0 else -(-self.batch // (data * micro)) * data * micro
        return RunScale.for_steps(self.preset, self.steps, tiles, walltime_h=self.walltime_h, extra=self.extra,
                                  ep=self.ep, global_batch=batch, timed=self.timed, pp=self.pp,
                                  dp_shard=self.dp_shard if 0 < self.dp_shard < data else 0)

    def flops(self) -> float:
        """Training FLOPs of the whole run (the model's FLOP-per-token count x tokens)."""
        p = presets.get(self.preset)
        return float(p.model.flops_per_token(p.seq_len)) * self.steps * self.tokens_per_step


@dataclass(frozen=True)
class Experiment:
    name: str
    kind: Kind
    paper: RunScale
    laptop: RunScale
    description: str = ""
    laptop_dag: bool = False  # trained by `make reproduce` (the laptop `rule all`)
    scaleup: bool = False  # one of the paper's scale-up runs (scaleup.png, the report's "Scale-up")
    # other designs of the paper-scale run, by name (DESIGNS; ``paper`` is the authors' layout)
    layouts: dict[str, RunScale] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"kind = {self.kind!r}: must be one of {', '.join(KINDS)}")
        unknown = set(self.layouts) - set(DESIGNS)
        if unknown:
            raise ConfigError(f"{self.name}: layouts {sorted(unknown)}: must be among {', '.join(DESIGNS)}")

    def scale(self, scale: Scale, layout: str = AUTHORS) -> RunScale:
        """The run at ``scale``; at paper scale in design ``layout`` (DESIGNS; the authors' by
        default) where the run has one of its own, else its only layout, the authors'."""
        if scale not in ("laptop", "paper"):
            raise ConfigError(f"scale = {scale!r}: must be 'laptop' or 'paper'")
        if layout not in DESIGNS:
            raise ConfigError(f"--layout {layout}: must be one of {', '.join(DESIGNS)}")
        if scale == "laptop":
            return self.laptop
        return self.layouts.get(layout, self.paper)

    def run_id(self, scale: Scale, layout: str = AUTHORS) -> str:
        """``<scale>-<name>``, and ``--<layout>`` for a paper-scale design other than the authors'."""
        ours = scale == "paper" and layout in self.layouts
        return f"{scale}-{self.name}" + (f"--{layout}" if ours else "")

    def describe(self) -> str:
        p, l = self.paper, self.laptop
        return (f"{self.name} ({self.kind})\n"
                f"    paper   {p.preset}: {p.tokens / 1e9:,.4g}B tokens, {p.steps:,} steps, {p.devices} tiles "
                f"({p.nodes} nodes), ep {p.ep}, batch {p.batch}\n"
                f"    laptop  {l.preset}: {l.tokens:,} tokens, {l.steps} steps, {l.devices} proc")


T, B = 10**12, 10**9
# Laptop budgets: 2 CPU cores, the whole `make reproduce` within 10 minutes.
# The 4T proxies' length is the laptop's decay horizon, the stand-in for the paper's one epoch
# (which a corpus of ~6,000 windows of 128 tokens would put at a few hundred steps, varying with
# the Python whose standard library the embedded corpus is made of): the 4T proxies decay over
# their whole run, and the scale-up proxies stop early on that horizon, as the paper's 100B-token
# runs stop early on the 4T runs' epoch. A model-only checkpoint every 40th step is kept for the
# evaluation against tokens (the paper evaluates every model-only checkpoint).
LAPTOP_4T_STEPS = 240
LAPTOP_EVAL = {"train.eval_every": 40, "train.eval_batches": 4, "train.log_every": 1,
               "train.checkpoint_every": 40, "train.model_checkpoint_every": 40,
               "schedule.decay_horizon": LAPTOP_4T_STEPS}
LAPTOP_SHORT = {"train.eval_every": 0, "train.eval_batches": 2, "train.log_every": 1}
# The scale-up proxies: LAPTOP_SCALEUP_STEPS steps of the 4T proxies' batch (module doc), held-out
# loss every 8 steps for the curve, the preset's warmup (20 steps).
LAPTOP_SCALEUP_STEPS = 32
LAPTOP_SCALEUP_TRAIN = {"train.eval_every": 8, "train.eval_batches": 4, "train.log_every": 1,
                        "schedule.decay_horizon": LAPTOP_4T_STEPS}
# Paper scale: checkpoints often enough that a job cut by its walltime loses little (the
# launcher resubmits it and it resumes from the newest valid checkpoint). One sequence per tile
# per forward / backward, accumulated up to the global batch (module doc). How the runs execute
# (bf16 autocast, our Triton experts where they pass their self-check on the tiles) is the
# execution plan's default (optimus_core.execution), as a laptop run's is; the ablation sets its own.
PAPER_TRAIN = {"train.checkpoint_every": 500, "train.micro_batch": 1}
# The authors' model-only ("cold") checkpoints, the evaluation's: every 1000 steps, every 500 for
# Mula-100B-A7B and every 250 for Mula-220B-A10B (their submit_aurora_job_paper.pbs)
PAPER_MODEL_CHECKPOINTS = {"mula-100b-a7b": 500, "mula-220b-a10b": 250}
PAPER_TIMED = {"train.eval_every": 0, "train.eval_batches": 1, "train.micro_batch": 1}
SHARD_BLOCK = 384  # tiles (32 nodes) a parameter is sharded over (parallel.dp_shard; module doc)
PAPER_TILES = 3072  # 256 nodes: every paper run (module doc)
PAPER_EP = 12  # the authors' expert-parallel degree: one node's tiles
SCALING_TILES = (384, 768, 1536, 3072, 6144, 12288)
SCALING_STEPS, SCALING_BATCH = 6, 12288
# One recomputation for the whole strong-scaling sweep, so that every point does the same work
# per step: what "auto" takes at its smallest size (384 tiles, whose 32 accumulated micro-batches
# keep the gradients: none at context 2048 and EP 12), pinned so that no larger point could take
# less and flatter its efficiency. tests/workflow/test_plan_memory.py checks it is still that
# choice and fits every size.
SCALING_CHECKPOINTING = ("none", 1)
ABLATION_STEPS, LAPTOP_TIMED_STEPS = 32, 20
ABLATION_MODEL = "olmoe-1b-7b--SE1.125"  # the authors' A/B model: OLMoE-1B-7B with 72 experts
# The authors' layouts: name -> (tiles, ep, pp), one sequence per data rank and step, except the
# pipeline's: 4 micro-batches of one sequence per pipeline and step (a sequence per tile either way)
ABLATION_LAYOUTS = {"dp12": (12, 1, 1), "ep12": (12, PAPER_EP, 1), "dp8-ep12": (96, PAPER_EP, 1),
                    "dp2-pp4-ep12": (96, PAPER_EP, 4)}
# The authors' pipelined runs (module doc): model -> (stages, recompute level)
PAPER_PIPELINES = {"mula-100b-a7b": (4, "level1"), "mula-220b-a10b": (8, "level7")}
# The arms: name -> (experts backend, optimizer). "fast" is the paper's runs (our kernels, the
# EP-aware optimizer); "loop" the per-expert loop (kernels/ "loop": torch._grouped_mm has no path
# on Aurora's XPUs), the kernel arm's baseline; "dp_sharded" the paper's baseline optimizer, the
# optimizer arm's, run only where an EP group exists (at EP 1 the two optimizers are one).
ABLATION_ARMS = {"loop": ("loop", "ep_aware"), "fast": ("triton", "ep_aware"), "dp_sharded": ("triton", "dp_sharded")}
# Layouts of the study not registered because the code cannot run them yet: name -> why (none now)
NOT_RUNNABLE: dict[str, str] = {}


def _pipelined(model: str) -> dict[str, Any]:
    """RunScale fields of the authors' pipelined layout of ``model`` (none for the others)."""
    if model not in PAPER_PIPELINES:
        return {}
    stages, level = PAPER_PIPELINES[model]
    return {"pp": stages, "extra": {"execution.activation_checkpointing": level}}


def _pretrain(model: str, tokens: int, tiles: int, ep: int = 1, batch: int = 0,
              scaleup: bool = False, description: str = "") -> Experiment:
    laptop = (RunScale.for_steps(f"{model}@laptop", LAPTOP_SCALEUP_STEPS, 1, extra=LAPTOP_SCALEUP_TRAIN) if scaleup
              else RunScale.for_steps(f"{model}@laptop", LAPTOP_4T_STEPS, 1, extra=LAPTOP_EVAL))
    train = {**PAPER_TRAIN, "train.model_checkpoint_every": PAPER_MODEL_CHECKPOINTS.get(model, 1000)}
    ours = RunScale(model, tokens, devices=tiles, ep=ep, global_batch=batch, extra=train, dp_shard=SHARD_BLOCK)
    pipe = _pipelined(model)
    authors = RunScale(model, tokens, devices=tiles, ep=ep, global_batch=batch, pp=pipe["pp"],
                       extra={**train, **pipe["extra"]}, dp_shard=SHARD_BLOCK) if pipe else ours
    return Experiment(
        f"pretrain-{model}", "pretrain", paper=authors,
        laptop=laptop, description=description, laptop_dag=True, scaleup=scaleup,
        layouts={"zero3-blocks": ours} if pipe else {},
    )


def _scaling(tiles: int) -> Experiment:
    pipe = _pipelined("mula-220b-a10b")
    return Experiment(
        f"scaling-mula-220b-a10b-{tiles}", "scaling",
        paper=RunScale.for_steps("mula-220b-a10b", SCALING_STEPS, tiles, timed=True, ep=PAPER_EP, pp=pipe["pp"],
                                 global_batch=SCALING_BATCH, dp_shard=SHARD_BLOCK,
                                 extra={**PAPER_TIMED, **pipe["extra"]}),
        laptop=RunScale.for_steps("mula-220b-a10b@laptop", LAPTOP_TIMED_STEPS, 1, extra=LAPTOP_SHORT),
        description=f"strong scaling of Mula-220B-A10B: {tiles} tiles, {SCALING_STEPS} steps of "
                    f"{SCALING_BATCH} x {presets.get('mula-220b-a10b').seq_len} tokens",
        layouts={"zero3-blocks": RunScale.for_steps(
            "mula-220b-a10b", SCALING_STEPS, tiles, timed=True, ep=PAPER_EP, global_batch=SCALING_BATCH,
            dp_shard=SHARD_BLOCK, extra={**PAPER_TIMED, "execution.activation_checkpointing": SCALING_CHECKPOINTING[0],
                                         "execution.activation_checkpointing_every": SCALING_CHECKPOINTING[1]})},
    )


def _ablation(layout: str, arm: str) -> Experiment:
    (tiles, ep, pp), (backend, optimizer) = ABLATION_LAYOUTS[layout], ABLATION_ARMS[arm]
    sets = {"execution.experts": backend, "parallel.optimizer": optimizer}
    base, tag = ABLATION_MODEL.split("--")
    return Experiment(
        f"ablation-{layout}-{arm}", "ablation",
        paper=RunScale.for_steps(ABLATION_MODEL, ABLATION_STEPS, tiles, timed=True, ep=ep, global_batch=tiles, pp=pp,
                                 extra={**PAPER_TIMED, **sets}),
        laptop=RunScale.for_steps(f"{base}{presets.LAPTOP}--{tag}", LAPTOP_TIMED_STEPS, 1,
                                  extra={**LAPTOP_SHORT, **sets}),
        description=f"the authors' A/B on OLMoE-1B-7B {tag}, {layout.upper()} ({tiles} tiles): experts {backend}, "
                    f"{optimizer} optimizer",
    )


_REGISTRY = [
    _pretrain("mula-1b", 4 * T, PAPER_TILES, description="dense Mula-1B on OLMoE-mix-0924 (4T tokens)"),
    _pretrain("mula-7b-a1b", 4 * T, PAPER_TILES,
              description="MoE Mula-7B-A1B (OLMoE-1B-7B) on OLMoE-mix-0924 (4T tokens)"),
    _pretrain("mula-20b-a2b", 100 * B, PAPER_TILES, ep=PAPER_EP, scaleup=True,
              description="scale-up: MoE Mula-20B-A2B to 100B tokens"),
    _pretrain("mula-100b-a7b", 100 * B, PAPER_TILES, ep=PAPER_EP, scaleup=True,
              description="scale-up: MoE Mula-100B-A7B to 100B tokens"),
    _pretrain("mula-220b-a10b", 100 * B, PAPER_TILES, ep=PAPER_EP, scaleup=True,
              description="scale-up: MoE Mula-220B-A10B to 100B tokens"),
    *[_scaling(t) for t in SCALING_TILES],
    *[_ablation(layout, arm) for layout, (_, ep, _) in ABLATION_LAYOUTS.items() for arm in ABLATION_ARMS
      if ep > 1 or arm != "dp_sharded"],
]
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in _REGISTRY}


def get(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ConfigError(f"experiment = {name!r}: unknown; known: {', '.join(EXPERIMENTS)}") from None


def of_kind(kind: Kind) -> list[Experiment]:
    if kind not in KINDS:
        raise ConfigError(f"kind = {kind!r}: must be one of {', '.join(KINDS)}")
    return [e for e in EXPERIMENTS.values() if e.kind == kind]


def pretraining() -> list[Experiment]:
    """Every pretraining run (4T and scale-up); all of them are in ``dag("laptop")``."""
    return of_kind("pretrain")


def scaleup() -> list[Experiment]:
    """The paper's scale-up runs (Mula-20B-A2B, -100B-A7B, -220B-A10B to 100B tokens), smallest first."""
    return [e for e in EXPERIMENTS.values() if e.scaleup]


def scaleup_figure(scale: Scale) -> list[Experiment]:
    """The runs results/figures/scaleup.png draws at ``scale``, so what its Snakemake target waits
    for: the MoE pretraining runs of ``dag(scale)``, i.e. mula-7b-a1b (the reference) and the
    scale-up runs. stages/scaleup.py picks the same runs out of the store by their attributes
    (fewer active than total parameters), since a stage never reads the registry."""
    return [e for e in dag(scale) if e.kind == "pretrain" and e.scale(scale).run_config().model.moe is not None]


def dag(scale: Scale) -> list[Experiment]:
    """The runs the Snakemake DAG trains at ``scale``: at paper scale every run, at laptop scale
    those cheap enough for `make reproduce` (see the module docstring)."""
    if scale not in ("laptop", "paper"):
        raise ConfigError(f"scale = {scale!r}: must be 'laptop' or 'paper'")
    return [e for e in EXPERIMENTS.values() if scale == "paper" or e.laptop_dag]
