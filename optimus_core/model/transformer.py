"""The Mula decoder-only transformer (dense or MoE), built from a ModelConfig.

    model = Transformer(cfg); model.init_weights(seed=0)
    logits_BSV = model(tokens_BS)          # V = cfg.padded_vocab_size
    aux = model.aux_loss()                 # MoE: the lb/z losses of the last forward, as the loss adds them
    h_BSD = model.hidden(tokens_BS)        # final-normed hidden states: logits = lm_head(h)
    loss = model.lm_loss(tokens_BS, targets_BS)  # mean cross-entropy, no (tokens x vocab) logits

The model knows nothing of how it executes or is parallelised: the execution plan
(optimus_core.execution) sets its kernels, precision and recomputation from outside
(``parallelize``), through the plain attributes each module documents. Its blocks are keyed by
layer index (``blocks["3"]``, parameter names ``blocks.3.*``); a part of the model (a pipeline
stage: some blocks, the embedding absent on all but the first, the final norm and the LM head
on all but the last) computes its share with the same methods, hidden states in where it has no
embedding (optimus_core.parallel.pipeline).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .attention import Attention
from .init import init_parameter_
from .layers import RotaryEmbedding, SwiGLU, make_norm
from .linear_cross_entropy import DEFAULT_CHUNK_ROWS, linear_cross_entropy
from .moe import MoEFeedForward


class Block(nn.Module):
    # What the backward recomputes of this block when training, set by optimus_core.execution
    # (the authors' recompute levels): the attention (its projections, QK-norm, RoPE and scores:
    # the normed input is what it keeps) and the two norms (their inputs are kept anyway).
    recompute_attention: bool = False
    recompute_norms: bool = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.ffn = MoEFeedForward(cfg.d_model, cfg.moe) if cfg.moe else SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x_BSD, cos_SDh, sin_SDh):
        h_BSD = x_BSD + _maybe_recomputed(self.attn, self.recompute_attention and self.training,
                                          _maybe_recomputed(self.attn_norm, self.recompute_norms and self.training,
                                                            x_BSD), cos_SDh, sin_SDh)
        return h_BSD + self.ffn(_maybe_recomputed(self.ffn_norm, self.recompute_norms and self.training, h_BSD))


def _maybe_recomputed(module: nn.Module, recompute: bool, *args):
    """``module(*args)``, its activations recomputed in the backward where ``recompute``."""
    return checkpoint(module, *args, use_reentrant=False) if recompute else module(*args)


class Transformer(nn.Module):
    # How it executes, set by optimus_core.execution.parallelize (these defaults: plain torch):
    # the blocks the backward recomputes (activation checkpointing "full"),
    recompute_blocks: frozenset[int] = frozenset()
    # lm_loss's softmax part in one Triton kernel (execution.lm_loss),
    lm_loss_kernel: bool = False
    # and, under autocast, the residual stream (the embeddings, every block's input and output)
    # in float32 (execution.fp32_residual) instead of the autocast dtype. Either way the norms
    # compute in float32 and every matmul reads the autocast dtype.
    fp32_residual: bool = False
    # and the final norm recomputed in the backward (the authors' recompute level's norms bit)
    recompute_final_norm: bool = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # padding_idx: the padding row's gradient is zero, so it stays the zero the init gives it
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_seq_len)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.final_norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)  # untied

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """The init of a whole (unsharded) model: every matrix N(0, init_std), truncated as
        ``model.init_truncation`` says, norm scales 1, the padding row zero, drawn per parameter
        name and row block (optimus_core.model.init), so that a rank holding some rows of a
        parameter draws exactly those (optimus_core.parallel.sharding.materialize); then the
        buffers (reset_buffers)."""
        for name, p in self.named_parameters():
            init_parameter_(p, name, seed=seed, cfg=self.cfg)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The buffers' initial values: no balancing bias, RoPE's frequencies."""
        for m in self.moe_layers():
            m.router.balance_bias.zero_()
        self.rope.reset_parameters()

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.ffn for b in self.blocks.values() if isinstance(b.ffn, MoEFeedForward)]

    def clear_routing(self) -> None:
        """Drop every MoE layer's losses and statistics of the last forward (MoEFeedForward.
        clear_routing: once read and back-propagated, they only keep the graph alive)."""
        for layer in self.moe_layers():
            layer.clear_routing()

    def aux_loss(self, share_LE: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MoE auxiliary losses of the last forward as the objective adds them:
        ``lb_loss_coef`` x the load-balancing loss (``lb_loss``) + ``z_loss_coef`` x the router
        z-loss averaged over the layers (OLMo-core's convention). None for a dense model or
        before a forward. ``share_LE``: as for ``lb_loss``."""
        layers = [m for m in self.moe_layers() if m.last_mean_probs_E is not None]
        if not layers:
            return None
        cfg = self.cfg.moe
        z = torch.stack([m.last_z_loss for m in layers]).mean()
        return cfg.lb_loss_coef * self.lb_loss(share_LE) + cfg.z_loss_coef * z

    def routing_shares(self) -> torch.Tensor:
        """(L, E) float32: each MoE layer's share of the last forward's top-k assignments per expert."""
        counts_LE = torch.stack([m.last_tokens_per_expert_E for m in self.moe_layers()]).float()
        return counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1)

    def lb_loss(self, share_LE: torch.Tensor | None = None) -> torch.Tensor:
        """The unscaled load-balancing loss of the last forward, as ``model.moe.lb_loss_form``
        defines it, with P_le each layer's mean router probability per expert (graph-connected)
        and f_le its share of assignments (``share_LE``; default this forward's own, else counted
        elsewhere: over the ranks under lb_loss_scope "global", optimus_core.train.load_balance):

            all_layers  E k sum_e F_e P_e, F_e = mean_l f_le, P_e = mean_l P_le: transformers'
                        load_balancing_loss_func of every layer's router logits together (k at balance)
            per_layer   mean_l E sum_e f_le P_le (1 at balance)
        """
        probs_LE = torch.stack([m.last_mean_probs_E for m in self.moe_layers()])
        share_LE = (self.routing_shares() if share_LE is None else share_LE).to(probs_LE.dtype)
        moe = self.cfg.moe
        if moe.lb_loss_form == "all_layers":
            return moe.n_experts * moe.top_k * (share_LE.mean(0) * probs_LE.mean(0)).sum()
        return (moe.n_experts * (share_LE * probs_LE).sum(-1)).mean()

    def forward(self, tokens_BS: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(tokens_BS, layers=layers))

    def lm_loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, *,
                chunk_rows: int = DEFAULT_CHUNK_ROWS, layers: range | None = None) -> torch.Tensor:
        """Mean cross-entropy of the next-token logits against ``targets_BS`` (float32, 0-d).

        The same value and gradients as F.cross_entropy(self(tokens_BS).float(), targets), with
        the LM head fused into the loss chunk by chunk (optimus_core.model.linear_cross_entropy).
        ``layers``: as for ``hidden``.
        """
        h_BSD = self.hidden(tokens_BS, layers=layers)
        return linear_cross_entropy(h_BSD.flatten(0, 1), self.lm_head.weight, targets_BS.flatten(),
                                    chunk_rows=chunk_rows, kernel=self.lm_loss_kernel)

    def hidden(self, tokens_BS: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        """The final-normed hidden states h_BSD, the LM head's input. A part of the model without
        the embedding takes the hidden states x_BSD of the blocks before it instead of tokens;
        one without the final norm returns its last block's output. ``layers``: only the blocks of
        these layers (which this part holds), the embedding first where they start at layer 0,
        the final norm last where they end at the last layer (one of the stages a rank holds)."""
        S = tokens_BS.shape[1]
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        cos_SDh, sin_SDh = self.rope(S)
        embeds = self.embed is not None and (layers is None or layers.start == 0)
        x_BSD = self.embed(tokens_BS) if embeds else tokens_BS
        device_type = x_BSD.device.type
        if embeds and not self.fp32_residual and torch.is_autocast_enabled(device_type):
            x_BSD = x_BSD.to(torch.get_autocast_dtype(device_type))
        for i, block in self.blocks.items():
            if layers is not None and int(i) not in layers:
                continue
            if int(i) in self.recompute_blocks and self.training:
                x_BSD = checkpoint(block, x_BSD, cos_SDh, sin_SDh, use_reentrant=False)
            else:
                x_BSD = block(x_BSD, cos_SDh, sin_SDh)
        if self.final_norm is None or (layers is not None and layers.stop != self.cfg.n_layers):
            return x_BSD
        return _maybe_recomputed(self.final_norm, self.recompute_final_norm and self.training, x_BSD)
