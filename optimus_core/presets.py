"""The Mula model family as the paper's authors ran it: presets by base model and scaling tag.

    >>> from optimus_core import presets
    >>> p = presets.get("mula-20b-a2b")
    >>> p.base, p.tag, p.model.num_params(), p.model.num_active_params()
    ('olmoe-1b-7b', 'SE1.5-L32', 20076824576, 2360084480)
    >>> presets.get("olmoe-1b-7b--SE1.125").model.moe.n_experts   # any tag, as the authors scale
    72
    >>> cfg = p.run_config(**{"train.steps": 10})                   # a RunConfig, overrides validated

A preset is a model plus the recipe it trains with (optimizer, schedule, data order, sequence
length, global batch). Token budgets, tile counts and layouts are not model facts: they live
with the runs in workflow/experiments.py.

The paper's models (GitHub IntelLabs/Optimus-LM: its README's "Paper variants" and
``optimus/config_utils.py``; read 2026-12-06). Every MoE model is OLMoE-1B-7B-0924 rescaled by a
tag (optimus_core.tags):

    mula-1b         olmo-1b       OLMo-1B: non-parametric LayerNorm, no QK-norm, SwiGLU 8192, untied
    mula-7b-a1b     olmoe-1b-7b   OLMoE-1B-7B-0924 itself
    mula-20b-a2b    olmoe-1b-7b   SE1.5-L32
    mula-100b-a7b   olmoe-1b-7b   SA1.5-SH1.5-SE2.25-SI1.5-L48
    mula-220b-a10b  olmoe-1b-7b   SA1.5-SH1.5-SE3.75-SI1.5-L64

``BASE--TAG`` names any other model of the grammar (``olmoe-1b-7b--SE1.125``: the authors' kernel
A/B model). Both bases use the OLMoE tokenizer's vocabulary (50280, embedding padded to 50304),
the padding id 1 (its embedding row zero and never updated) and transformers' init, N(0, 0.02)
untruncated.

The paper's recipe (``dist_train.py``, ``run_experiment.sh``, ``submit_aurora_job_paper.pbs``):
context 2048, 3072 sequences a step (6.29M tokens), AdamW lr 4e-4 (betas 0.9, 0.95, eps 1e-8,
weight decay 0.1 on every parameter), warmup 2500 steps linear from 4e-5, cosine to 4e-5 over
one epoch of the data, clipping at 1.0 from the end of the warmup, load balancing 0.01 x
transformers' loss over every layer's router logits together, no router z-loss, the paper's
data order (optimus_core.data.windows, seed 42), gradients reduced in bf16.

Our own choices stay selectable by name: ``--set model.moe.lb_loss_form=per_layer``,
``model.moe.z_loss_coef=0.001``, ``model.moe.lb_loss_scope=global``, ``model.moe.bias_update_rate``,
``model.init_truncation=3``, ``schedule.decay_horizon=run``, ``schedule.warmup_from=zero``,
``optim.clip_after_warmup=false``, ``optim.decay_norms=false``, ``data.order=stream``.

Laptop proxies (``<name>@laptop``) are the same tags on tiny bases (``olmoe-1b-7b@laptop``:
width 128, 4 heads of 32, 4 layers, 16 experts, top-2, expert hidden 64, a quarter of OLMoE's
depth and experts with its share of active experts and its expert-hidden-to-width ratio;
``olmo-1b@laptop`` likewise), with each tag's ``L`` scaled by the base's quarter depth
(``laptop_tag``), so that the proxies keep the paper's ratios of layers, width, experts and
active share. They train on the 4096-token BPE `optimus tokenize` trains on the embedded corpus,
with the paper's recipe at a laptop's scale: context 128, 16 sequences a step, lr 3e-3 (tiny
models learn in a few hundred steps only at a larger rate), a 20-step warmup.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import (ConfigError, DataConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, RunConfig,
                     ScheduleConfig, TrainConfig, apply_overrides)
from .tags import apply_tag, parse_tag, split_name

OLMOE_VOCAB = 50280  # gpt-neox-olmo-dolma-v1_5; padded to 50304 in the embedding
LAPTOP_VOCAB = 4096  # the byte-level BPE `optimus tokenize` trains on the embedded corpus
PAD_ID = 1  # OLMoE's tokenizer's <|padding|>, and the laptop tokenizer's (stages/tokenize.py)
LAPTOP = "@laptop"

# The paper's two base models (the authors' Hugging Face configs, as they modify them).
_PAPER_BASE = dict(vocab_size=OLMOE_VOCAB, d_model=2048, n_layers=16, n_heads=16, max_seq_len=4096,
                   init_truncation=None, pad_token_id=PAD_ID)
_PAPER_MOE = MoEConfig(n_experts=64, top_k=8, d_expert=1024, lb_loss_coef=0.01, lb_loss_form="all_layers",
                       z_loss_coef=0.0)
# Tiny bases: a quarter of the paper bases' depth and experts, the same share of active experts
# (1/8), head dim 32, expert hidden half the width (OLMoE's), dense hidden 4 x the width (OLMo's).
_LAPTOP_BASE = dict(vocab_size=LAPTOP_VOCAB, d_model=128, n_layers=4, n_heads=4, max_seq_len=512,
                    init_truncation=None, pad_token_id=PAD_ID)
_LAPTOP_MOE = _PAPER_MOE.replace(n_experts=16, top_k=2, d_expert=64)

BASES: dict[str, ModelConfig] = {
    "olmoe-1b-7b": ModelConfig(**_PAPER_BASE, moe=_PAPER_MOE),
    "olmo-1b": ModelConfig(**_PAPER_BASE, d_ff=8192, qk_norm=False, norm="nonparametric_layernorm"),
    f"olmoe-1b-7b{LAPTOP}": ModelConfig(**_LAPTOP_BASE, moe=_LAPTOP_MOE),
    f"olmo-1b{LAPTOP}": ModelConfig(**_LAPTOP_BASE, d_ff=512, qk_norm=False, norm="nonparametric_layernorm"),
}
BASE_SUMMARY = {"olmoe-1b-7b": "OLMoE-1B-7B-0924", "olmo-1b": "OLMo-1B"}

# name: (base, the authors' tag, summary)
MULA = {
    "mula-1b": ("olmo-1b", "", "dense reference: OLMo-1B"),
    "mula-7b-a1b": ("olmoe-1b-7b", "", "OLMoE-1B-7B-0924"),
    "mula-20b-a2b": ("olmoe-1b-7b", "SE1.5-L32", "32 layers, 96 experts"),
    "mula-100b-a7b": ("olmoe-1b-7b", "SA1.5-SH1.5-SE2.25-SI1.5-L48", "48 layers, width 3072, 144 experts"),
    "mula-220b-a10b": ("olmoe-1b-7b", "SA1.5-SH1.5-SE3.75-SI1.5-L64", "64 layers, width 3072, 240 experts"),
}


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    global_batch: int = 1024  # sequences
    base: str = ""  # the base model the tag rescales (BASES)
    tag: str = ""  # the authors' scaling tag ("" for the base itself)
    summary: str = ""

    @property
    def seq_len(self) -> int:
        return self.data.seq_len

    def run_config(self, **overrides: Any) -> RunConfig:
        """The RunConfig this preset trains with, with dotted-path ``overrides`` applied."""
        base = RunConfig(preset=self.name, model=self.model, optim=self.optim, schedule=self.schedule,
                         train=TrainConfig(global_batch=self.global_batch), data=self.data, parallel=self.parallel)
        return apply_overrides(base, overrides) if overrides else base


# The paper's recipe (module doc) and its laptop scale.
PAPER_OPTIM = OptimConfig(lr=4e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0,
                          clip_after_warmup=True, decay_norms=True)
PAPER_SCHEDULE = ScheduleConfig(kind="cosine", warmup_steps=2500, min_lr_ratio=0.1, warmup_from="min_lr",
                                decay_horizon="epoch")
PAPER_DATA = DataConfig(seq_len=2048, seed=42, order="file_windows")
PAPER_PARALLEL = ParallelConfig(reduce_dtype="bfloat16")
PAPER_BATCH = 3072
LAPTOP_OPTIM = PAPER_OPTIM.replace(lr=3e-3)
LAPTOP_SCHEDULE = PAPER_SCHEDULE.replace(warmup_steps=20)
LAPTOP_DATA = PAPER_DATA.replace(seq_len=128)
LAPTOP_BATCH = 16


def laptop_tag(tag: str, base: str) -> str:
    """``tag`` for ``base``'s tiny proxy: its ``L`` (a depth, not a scale) scaled by the tiny
    base's share of the paper base's depth; every scale key as it is."""
    if not tag:
        return tag
    ratio = BASES[base + LAPTOP].n_layers / BASES[base].n_layers
    parsed = parse_tag(tag)
    tokens = []
    for token in tag.split("-"):
        if token.startswith("L"):  # the one key that starts with L
            depth = parsed["L"] * ratio
            if not float(depth).is_integer() or depth < 1:
                raise ConfigError(f"tag {tag!r}: L{int(parsed['L'])} x {ratio} is not a whole depth for {base}{LAPTOP}")
            token = f"L{int(depth)}"
        tokens.append(token)
    return "-".join(tokens)


def _preset(name: str, base: str, tag: str, summary: str = "") -> Preset:
    if base not in BASES:
        raise ConfigError(f"preset = {name!r}: unknown base model {base!r}; tags rescale one of "
                          f"{', '.join(BASES)}")
    model = apply_tag(BASES[base], tag) if tag else BASES[base]
    if base.endswith(LAPTOP):
        return Preset(name, model, LAPTOP_OPTIM, LAPTOP_SCHEDULE, LAPTOP_DATA, PAPER_PARALLEL, LAPTOP_BATCH,
                      base, tag, summary)
    return Preset(name, model, PAPER_OPTIM, PAPER_SCHEDULE, PAPER_DATA, PAPER_PARALLEL, PAPER_BATCH,
                  base, tag, summary)


def _build() -> dict[str, Preset]:
    out = {name: _preset(name, base, tag, summary) for name, (base, tag, summary) in MULA.items()}
    for name, (base, tag, summary) in MULA.items():
        out[name + LAPTOP] = _preset(name + LAPTOP, base + LAPTOP, laptop_tag(tag, base), f"laptop proxy of {name}")
    return out


PRESETS: dict[str, Preset] = _build()


def names() -> list[str]:
    return list(PRESETS)


def get(name: str) -> Preset:
    """The preset called ``name``: a Mula preset (``names()``), a base model (``BASES``), or
    ``BASE--TAG``, a base rescaled by an authors' tag."""
    if name in PRESETS:
        return PRESETS[name]
    if not isinstance(name, str):
        raise ConfigError(f"preset = {name!r}: must be a preset name")
    base, tag = split_name(name)
    if base in BASES:
        return _preset(name, base, tag, BASE_SUMMARY.get(base, "") if not tag else "")
    raise ConfigError(f"preset = {name!r}: unknown; known presets: {', '.join(PRESETS)}; or a base "
                      f"({', '.join(BASES)}) with a scaling tag, e.g. olmoe-1b-7b--SE1.125")
