"""Analytic parameter and FLOP counts of a ModelConfig (tested against the real model).

Conventions (as PaLM appendix B / Megatron / torchtitan):
- ``num_params`` counts every parameter of the instantiated model, the padded embedding and
  the untied output layer included; ``num_active_params`` counts what one token touches: the
  same, with only ``top_k`` of the ``n_experts`` experts of each MoE layer.
- ``flops_per_token(seq_len)`` is forward + backward of one token: 6 x the active matmul
  parameters (every weight matrix except the embedding lookup; router and output layer
  included) + the attention term 12 x n_layers x d_model x seq_len (QK^T and AV, forward 2 x 2
  FLOPs per (query, key, dim), x3 for backward, no discount for the causal mask). Norms,
  softmax and activations are not counted. Activation recomputation is not counted either:
  MFU measures useful work.
- ``recompute_flops_per_token(seq_len, mode, every)`` is what activation checkpointing adds to
  a step's work, not to its useful work: the forward FLOPs the backward repeats, one third of
  the checkpointed blocks' share of the count above ("full": every ``every``-th block whole,
  attention included; "moe": the experts' GEMMs of every MoE layer; the authors' "level<N>"
  (RECOMPUTE_LEVELS): of every layer the experts' GEMMs where N has bit 1 (the MoE block after
  its routing: the exchange runs again too, which is no FLOPs), the attention's projections and
  scores where it has bit 2, nothing countable for the norms (bit 4); "none": 0).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ModelConfig's count methods call these: config imports this module, not back
    from .config import ModelConfig


def _attention_params(cfg: ModelConfig) -> int:
    kv_dim = cfg.kv_heads * cfg.head_dim
    proj = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv_dim  # q, o + k, v
    qk_norm = (cfg.d_model + kv_dim) if cfg.qk_norm else 0
    return proj + qk_norm


def _ffn_params(cfg: ModelConfig, active: bool) -> int:
    if cfg.moe is None:
        return 3 * cfg.d_model * cfg.d_ff
    experts = cfg.moe.top_k if active else cfg.moe.n_experts
    return cfg.d_model * cfg.moe.n_experts + experts * 3 * cfg.d_model * cfg.moe.d_expert


def embedding_params(cfg: ModelConfig) -> int:
    """Input embedding + untied output layer, both over the padded vocabulary."""
    return 2 * cfg.padded_vocab_size * cfg.d_model


def _norm_params(cfg: ModelConfig) -> int:
    """One pre-norm's (or the final norm's) parameters: RMSNorm's scale, none for OLMo's LayerNorm."""
    return cfg.d_model if cfg.norm == "rmsnorm" else 0


def _layer_params(cfg: ModelConfig, active: bool) -> int:
    return 2 * _norm_params(cfg) + _attention_params(cfg) + _ffn_params(cfg, active)


def num_params(cfg: ModelConfig) -> int:
    return embedding_params(cfg) + _norm_params(cfg) + cfg.n_layers * _layer_params(cfg, active=False)


def num_active_params(cfg: ModelConfig) -> int:
    return embedding_params(cfg) + _norm_params(cfg) + cfg.n_layers * _layer_params(cfg, active=True)


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies with: attention, router, top_k experts (or dense MLP), output."""
    kv_dim = cfg.kv_heads * cfg.head_dim
    attn = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv_dim
    per_layer = attn + _ffn_params(cfg, active=True)
    return cfg.n_layers * per_layer + cfg.padded_vocab_size * cfg.d_model


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at ``seq_len``; see the module docstring."""
    return 6 * active_matmul_params(cfg) + 12 * cfg.n_layers * cfg.d_model * seq_len


# The authors' recompute levels (GitHub IntelLabs/Optimus-LM, their activation checkpointing
# level): a bitmask over every layer of what the backward recomputes.
LEVEL_BITS = {1: "the MoE block after its routing (exchange, experts, combine)", 2: "the attention",
              4: "the norms"}
RECOMPUTE_LEVELS = tuple(f"level{n}" for n in range(1, 8))


def level_bits(mode: str) -> int:
    """The bitmask of an activation-checkpointing mode: N for "level<N>", 0 for our own modes."""
    return int(mode[len("level"):]) if mode in RECOMPUTE_LEVELS else 0


def checkpointed_blocks(n_layers: int, mode: str, every: int = 1) -> set[int]:
    """The blocks the backward recomputes whole: under "full", every ``every``-th from the
    ``every``-th on; none otherwise. The rule optimus_core.execution.recompute applies, here
    because both this module's and optimus_core.memory's counts follow it."""
    return set(range(every - 1, n_layers, every)) if mode == "full" else set()


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, mode: str, every: int = 1) -> int:
    """Forward FLOPs per token the backward repeats under execution.activation_checkpointing
    ``mode`` (resolved: none | full | moe) with every ``every``-th block checkpointed ("full"),
    as checkpointed_blocks picks them; see the module docstring."""
    if mode == "none":
        return 0
    kv_dim = cfg.kv_heads * cfg.head_dim
    bits = level_bits(mode)
    if mode == "moe" or bits & 1:
        if cfg.moe is None:
            raise ValueError(f"activation checkpointing {mode!r} recomputes the MoE block: it needs an MoE model")
    if bits:
        experts = 2 * cfg.moe.top_k * 3 * cfg.d_model * cfg.moe.d_expert if bits & 1 else 0
        attention = 2 * (2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv_dim) + 4 * cfg.d_model * seq_len
        return cfg.n_layers * (experts + (attention if bits & 2 else 0))
    if mode == "moe":
        return cfg.n_layers * 2 * cfg.moe.top_k * 3 * cfg.d_model * cfg.moe.d_expert
    if mode != "full" or every < 1:
        raise ValueError(f"activation checkpointing ({mode!r}, every {every}): mode must be none, full, moe or "
                         f"level1..level7, every >= 1")
    block = 2 * (2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv_dim + _ffn_params(cfg, active=True))
    return len(checkpointed_blocks(cfg.n_layers, "full", every)) * (block + 4 * cfg.d_model * seq_len)
