"""The Mula model family: paper-scale presets and their laptop proxies (the one source of shapes).

    >>> from optimus_core import presets
    >>> p = presets.get("mula-7b-a1b")
    >>> p.model.num_params(), p.model.num_active_params()
    (6919161856, 1282017280)
    >>> cfg = p.run_config(**{"train.steps": 10})     # a RunConfig, overrides validated

A preset is a model shape plus the training recipe it was designed with (optimizer, schedule,
sequence length, global batch). Token budgets, tile counts and walltimes are not model facts:
they live with the runs in workflow/experiments.py.

Why these shapes
- mula-1b: the dense reference, OLMo-1B's shape (16 x 2048, 16 heads, SwiGLU hidden 8192) with
  OLMoE's untied embeddings, QK-norm and vocabulary, so that it differs from mula-7b-a1b only in
  its feed-forward: 1.28B parameters, all active, the same as mula-7b-a1b's 1.28B active.
- mula-7b-a1b: OLMoE-1B-7B exactly (DESIGN.md reference facts): 6.92B total, 1.28B active.
- The three large models have no published configuration. We keep OLMoE's recipe (head dim 128,
  no GQA, top-8, fine-grained experts) and grow the model along the axes MoE scaling work grows
  it (more and wider layers, more experts at fixed top-k):
  * mula-20b-a2b: OLMoE's width and expert size, 24 layers and 128 experts (2x the expert pool,
    so 1/16 of experts active): 19.94B total, 1.82B active (0.91x of "2B").
  * mula-100b-a7b: width 4096 (32 heads), 32 layers, 128 experts of hidden 2048 (half the
    width, OLMoE's ratio): 105.7B total, 9.0B active (1.29x of "7B"; top-8 of 128 at this width
    cannot reach 7B without narrowing experts below OLMoE's ratio).
  * mula-220b-a10b: width 4096, 60 layers, 256 experts of hidden 1152 (top-8 of 256: 1/32
    active, the sparsity of the largest fine-grained MoEs): 221.9B total, 11.3B active (1.13x).
    60 layers divide by 4, 6, 12 and 15 for pipeline stages, and 256 experts by every EP degree
    up to 256.
- Laptop proxies (``<name>@laptop``) keep the family: same expert count and top-k, same ratios
  of expert hidden to width, tiny widths (128) and depth (4), a 4096-token BPE vocabulary
  trained on the embedded corpus, and a recipe scaled to a few hundred CPU steps.
  The scale-up proxies (LAPTOP_SCALEUP) keep the paper's ordering, 20B < 100B < 220B in total
  and in active parameters, and the paper's growth axes within a CPU budget (all three train in
  `make reproduce`): mula-20b-a2b@laptop is deeper than the 7B-A1B proxy (5 layers, as 24 > 16);
  mula-100b-a7b@laptop is wider (160, as 4096 > 2048); mula-220b-a10b@laptop keeps that width
  and is deeper (8, as 60 > 32) with its 256 narrower experts: 17.2M / 2.44M, 26.5M / 3.46M
  and 46.7M / 3.85M parameters (total / active).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import (ConfigError, DataConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig,
                     ScheduleConfig, TrainConfig, apply_overrides)

OLMOE_VOCAB = 50280  # gpt-neox-olmo-dolma-v1_5; padded to 50304 in the embedding
LAPTOP_VOCAB = 4096  # the byte-level BPE `optimus tokenize` trains on the embedded corpus
# The scale-up proxies' width, depth and heads (head dim 32, as every laptop proxy): module doc.
LAPTOP_SCALEUP = {
    "mula-20b-a2b": dict(d_model=128, n_layers=5, n_heads=4),
    "mula-100b-a7b": dict(d_model=160, n_layers=5, n_heads=5),
    "mula-220b-a10b": dict(d_model=160, n_layers=8, n_heads=5),
}


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    seq_len: int = 4096
    global_batch: int = 1024  # sequences
    summary: str = ""

    def run_config(self, **overrides: Any) -> RunConfig:
        """The RunConfig this preset trains with, with dotted-path ``overrides`` applied."""
        base = RunConfig(
            preset=self.name,
            model=self.model,
            optim=self.optim,
            schedule=self.schedule,
            train=TrainConfig(global_batch=self.global_batch),
            data=DataConfig(seq_len=self.seq_len),
        )
        return apply_overrides(base, overrides) if overrides else base


def _paper(name: str, model: ModelConfig, summary: str) -> Preset:
    # OLMoE's recipe: AdamW 4e-4, betas (0.9, 0.95), wd 0.1, clip 1.0, cosine after 2500
    # warmup steps, 1024 x 4096 tokens per step.
    return Preset(name, model, OptimConfig(), ScheduleConfig(kind="cosine", warmup_steps=2500), 4096, 1024, summary)


def _laptop(paper: Preset, model: ModelConfig) -> Preset:
    # Tiny models tolerate (and need, to learn in a few hundred steps) a larger learning rate.
    return Preset(
        f"{paper.name}@laptop", model,
        OptimConfig(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0),
        ScheduleConfig(kind="cosine", warmup_steps=20, min_lr_ratio=0.1),
        seq_len=128, global_batch=16, summary=f"laptop proxy of {paper.name}",
    )


def _moe(n_experts: int, top_k: int, d_expert: int) -> MoEConfig:
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_expert=d_expert)


def _build() -> dict[str, Preset]:
    paper = [
        _paper("mula-1b", ModelConfig(vocab_size=OLMOE_VOCAB, d_model=2048, n_layers=16, n_heads=16, d_ff=8192),
               "dense reference, OLMo-1B shape"),
        _paper("mula-7b-a1b", ModelConfig(vocab_size=OLMOE_VOCAB, d_model=2048, n_layers=16, n_heads=16,
                                          moe=_moe(64, 8, 1024)), "OLMoE-1B-7B"),
        _paper("mula-20b-a2b", ModelConfig(vocab_size=OLMOE_VOCAB, d_model=2048, n_layers=24, n_heads=16,
                                           moe=_moe(128, 8, 1024)), "24 layers, 128 experts"),
        _paper("mula-100b-a7b", ModelConfig(vocab_size=OLMOE_VOCAB, d_model=4096, n_layers=32, n_heads=32,
                                            moe=_moe(128, 8, 2048)), "width 4096, 128 experts"),
        _paper("mula-220b-a10b", ModelConfig(vocab_size=OLMOE_VOCAB, d_model=4096, n_layers=60, n_heads=32,
                                             moe=_moe(256, 8, 1152)), "60 layers, 256 experts"),
    ]
    out = {p.name: p for p in paper}
    for p in paper:
        tiny = ModelConfig(vocab_size=LAPTOP_VOCAB, d_model=128, n_layers=4, n_heads=4, d_ff=512, max_seq_len=512)
        tiny = tiny.replace(**LAPTOP_SCALEUP.get(p.name, {}))
        if p.model.moe is not None:
            ratio = p.model.moe.d_expert / p.model.d_model  # keep expert hidden / width
            tiny = tiny.replace(moe=p.model.moe.replace(d_expert=max(16, int(tiny.d_model * ratio))))
        lp = _laptop(p, tiny)
        out[lp.name] = lp
    return out


PRESETS: dict[str, Preset] = _build()


def names() -> list[str]:
    return list(PRESETS)


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"preset = {name!r}: unknown; known presets: {', '.join(PRESETS)}") from None
