"""The model against a straightforward reference written here, with the same weights."""
import math
import os

import pytest
import torch

from optimus_core import presets
from optimus_core.config import ModelConfig, MoEConfig
from optimus_core.execution import compile_blocks, recompute, use_kernels
from optimus_core.model.moe import capacity_keep_mask
from optimus_core.model.transformer import Transformer


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def layer_norm(x, eps):  # OLMo-1B's: no scale, no bias
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)


def rope(x, theta):  # x (S, H, Dh): rotate pairs (i, i + Dh/2) by pos * theta^(-2i/Dh)
    S, _, Dh = x.shape
    out = torch.empty_like(x)
    for pos in range(S):
        for i in range(Dh // 2):
            angle = pos / theta ** (2 * i / Dh)
            a, b = x[pos, :, i], x[pos, :, i + Dh // 2]
            out[pos, :, i] = a * math.cos(angle) - b * math.sin(angle)
            out[pos, :, i + Dh // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def reference_forward(model: Transformer, tokens):
    """One sequence at a time, one token at a time through the experts: no shared code."""
    cfg = model.cfg
    raw = model.state_dict()
    sd = {k: v.double() for k, v in raw.items() if "experts" not in k}  # experts: cast per use
    H, G, Dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    outs = []
    for seq in tokens:
        x = sd["embed.weight"][seq]
        S = x.shape[0]
        for i in range(cfg.n_layers):
            p = lambda n: sd[f"blocks.{i}.{n}"]  # noqa: E731
            norm = (lambda y, n: layer_norm(y, cfg.norm_eps)) if cfg.norm == "nonparametric_layernorm" else (
                lambda y, n: rms(y, p(n), cfg.norm_eps))  # noqa: E731
            h = norm(x, "attn_norm.weight")
            q, k, v = h @ p("attn.w_q.weight").T, h @ p("attn.w_k.weight").T, h @ p("attn.w_v.weight").T
            if cfg.qk_norm:
                q, k = rms(q, p("attn.q_norm.weight"), cfg.norm_eps), rms(k, p("attn.k_norm.weight"), cfg.norm_eps)
            q, k, v = q.view(S, H, Dh), k.view(S, G, Dh), v.view(S, G, Dh)
            q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
            att = torch.zeros(S, H, Dh, dtype=torch.float64)
            for head in range(H):
                g = head // (H // G)
                scores = q[:, head] @ k[:, g].T / math.sqrt(Dh)
                scores = scores.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf"))
                att[:, head] = scores.softmax(-1) @ v[:, g]
            x = x + att.reshape(S, H * Dh) @ p("attn.w_o.weight").T
            h = norm(x, "ffn_norm.weight")
            if cfg.moe is None:
                gate, up = h @ p("ffn.w_gate.weight").T, h @ p("ffn.w_up.weight").T
                x = x + (torch.nn.functional.silu(gate) * up) @ p("ffn.w_down.weight").T
            else:
                probs = (h @ p("ffn.router.gate.weight").T).softmax(-1)
                E = cfg.moe.n_experts  # the weights' rows, expert after expert: (E, D, 2F) and (E, F, D)
                w_up = raw[f"blocks.{i}.ffn.experts.w_up"].view(E, cfg.d_model, -1)
                w_down = raw[f"blocks.{i}.ffn.experts.w_down"].view(E, -1, cfg.d_model)
                y = torch.zeros_like(x)
                for t in range(S):
                    top = probs[t].topk(cfg.moe.top_k)
                    for weight, e in zip(top.values, top.indices):
                        gate, up = (h[t] @ w_up[e].double()).chunk(2)
                        y[t] += weight * (torch.nn.functional.silu(gate) * up) @ w_down[e].double()
                x = x + y
        final = (layer_norm(x, cfg.norm_eps) if cfg.norm == "nonparametric_layernorm"
                 else rms(x, sd["final_norm.weight"], cfg.norm_eps))
        outs.append(final @ sd["lm_head.weight"].T)
    return torch.stack(outs)


def forward_router_logits(model, tokens) -> list[torch.Tensor]:
    """A forward of ``tokens``, and each MoE layer's router logits (T, E) in float32, layer by layer."""
    logits = []
    hooks = [b.ffn.router.gate.register_forward_hook(lambda m, i, out: logits.append(out.detach().float()))
             for b in model.blocks.values()]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return logits


def build(cfg, seed=0):
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    return model


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48),
    ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, qk_norm=False),
    ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, moe=MoEConfig(n_experts=8, top_k=3, d_expert=16)),
    ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, qk_norm=False,
                norm="nonparametric_layernorm", pad_token_id=1, init_truncation=None),
], ids=["dense", "gqa-no-qknorm", "moe", "olmo-1b-shaped"])
def test_forward_matches_reference(cfg):
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(tokens).double()
    torch.testing.assert_close(got, reference_forward(model, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_mula_7b_a1b_two_layers_matches_reference():
    """The real OLMoE widths (2048, 16 heads, 64 experts top-8, hidden 1024), 2 layers, float32."""
    cfg = presets.get("mula-7b-a1b").model.replace(n_layers=2)
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(tokens).double()
    torch.testing.assert_close(got, reference_forward(model, tokens), rtol=1e-5, atol=1e-5)


def test_init_is_truncated_normal_and_deterministic():
    cfg = presets.get("mula-7b-a1b@laptop").model.replace(init_truncation=3.0)
    a, b = build(cfg, seed=3), build(cfg, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if p.ndim >= 2:
            assert p.abs().max() <= 3 * cfg.init_std + 1e-7, name
    w = a.blocks["0"].ffn.experts.w_up
    assert abs(w.std().item() - 0.02 * 0.9866) < 0.0005  # std of N(0, .02) truncated at 3 sigma
    assert not torch.equal(build(cfg, seed=4).embed.weight, a.embed.weight)


def test_the_papers_init_is_untruncated_with_a_zero_padding_row():
    """transformers' init, which the paper's runs used: N(0, 0.02) with no cut (about 0.27% of
    the values beyond 3 sigma), the padding token's embedding row zero."""
    cfg = presets.get("mula-7b-a1b@laptop").model
    assert cfg.init_truncation is None and cfg.pad_token_id == 1
    model = build(cfg, seed=3)
    w = model.blocks["0"].ffn.experts.w_up
    beyond = (w.abs() > 3 * cfg.init_std).float().mean().item()
    assert 0.0015 < beyond < 0.004 and abs(w.std().item() - 0.02) < 0.0005
    embed = model.embed.weight
    assert torch.count_nonzero(embed[1]) == 0 and torch.count_nonzero(embed[0]) == cfg.d_model
    assert torch.count_nonzero(embed[2:]) == embed[2:].numel()


def test_the_padding_row_is_never_updated():
    """Its gradient is zero (padding_idx), so AdamW with weight decay leaves it zero, even where
    the padding id is in the batch."""
    from optimus_core.train.optim import param_groups
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=24, pad_token_id=1,
                      norm="nonparametric_layernorm", qk_norm=False)
    model = build(cfg)
    opt = torch.optim.AdamW(param_groups(model, 0.1, decay_norms=True), lr=1e-2)
    tokens = torch.tensor([[3, 1, 1, 7, 9, 1]])
    for _ in range(3):
        model(tokens).float().pow(2).mean().backward()
        assert torch.count_nonzero(model.embed.weight.grad[1]) == 0
        opt.step()
        opt.zero_grad()
    assert torch.count_nonzero(model.embed.weight[1]) == 0


def test_init_of_any_rows_is_the_init_of_the_whole():
    """A rank holding rows [lo, hi) of a parameter draws exactly the whole init's rows there,
    however the range falls on the draw blocks, and another name draws other values; the same
    for the embedding's padding row."""
    from optimus_core.model.init import ROWS_PER_DRAW, draw_rows, init_parameter_

    cfg = ModelConfig(init_std=0.02, init_truncation=3.0, pad_token_id=70)
    for name in ("blocks.0.ffn.experts.w_up", "embed.weight"):
        whole = torch.empty(5 * ROWS_PER_DRAW + 7, 13)
        init_parameter_(whole, name, seed=2, cfg=cfg)
        for lo, hi in ((0, 1), (3, ROWS_PER_DRAW + 5), (ROWS_PER_DRAW, 2 * ROWS_PER_DRAW), (200, whole.shape[0])):
            part = torch.empty(hi - lo, 13)
            init_parameter_(part, name, first_row=lo, seed=2, cfg=cfg)
            assert torch.equal(part, whole[lo:hi]), (name, lo, hi)
        assert whole.abs().max() <= 3 * 0.02
        assert (torch.count_nonzero(whole[70]) == 0) == (name == "embed.weight")
    other = draw_rows("blocks.1.ffn.experts.w_up", 0, 10, 13, seed=2, std=0.02)
    assert not torch.equal(other, whole[:10])


def test_moe_aux_losses_match_hand_computed_values():
    cfg = MoEConfig(n_experts=4, top_k=2, d_expert=8)
    model = Transformer(ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, moe=cfg))
    router = model.blocks["0"].ffn.router
    x = torch.eye(8)[:4]  # 4 tokens; logits = rows of the gate weight's transpose
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [0, 2.0, 0, 0, 0, 0, 0, 0],
                                               [0, 0, 3.0, 0, 0, 0, 0, 0], [0, 0, 0, 4.0, 0, 0, 0, 0]]))
    r = router(x)
    logits = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # token t's logit t+1 on expert t
    probs = logits.softmax(-1)
    # token t picks expert t (its largest) and, for the tie of the other three at 0, the lowest id
    counts = torch.bincount(r.topk_idx_TK.flatten(), minlength=4).float()
    expected_z = torch.logsumexp(logits, -1).pow(2).mean()
    assert torch.equal(r.tokens_per_expert_E.float(), counts) and torch.allclose(r.mean_probs_E, probs.mean(0))
    assert torch.allclose(r.z_loss, expected_z)
    assert r.topk_idx_TK[:, 0].tolist() == [0, 1, 2, 3]
    assert counts.sum() == 8


def test_aux_loss_is_the_layer_mean_as_olmoes_trainer_computes_it():
    """Four MoE layers: the total auxiliary loss is OLMoE's, written here from its formula and not
    from our router -- megablocks' batched load-balancing loss, lb_coef * E / (L * T * k) *
    sum over layers and experts of (assignments to e) * (mean router probability of e), plus
    OLMo-core's router z-loss, z_coef * (sum over layers of mean_t logsumexp^2) / L."""
    E, k, L, coef_lb, coef_z = 4, 2, 4, 0.01, 0.001
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=L, n_heads=2,
                      moe=MoEConfig(n_experts=E, top_k=k, d_expert=8, lb_loss_coef=coef_lb, z_loss_coef=coef_z,
                                    lb_loss_form="per_layer"))
    model = build(cfg)
    tokens = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(0))
    logits = forward_router_logits(model, tokens)
    T = tokens.numel()
    assignments = sum_probs = 0.0
    z = 0.0
    for layer_logits in logits:  # (T, E), one per layer
        chosen = layer_logits.topk(k, dim=-1).indices
        counts = torch.zeros(E).scatter_add_(0, chosen.flatten(), torch.ones(T * k))
        assignments = assignments + (counts * layer_logits.softmax(-1).mean(0)).sum()
        z = z + torch.logsumexp(layer_logits, -1).square().mean()
    expected = coef_lb * E / (L * T * k) * assignments + coef_z * z / L
    assert len(logits) == L
    torch.testing.assert_close(model.aux_loss().detach(), expected, rtol=1e-5, atol=1e-7)
    # the logged unscaled values are the per-layer means of the same terms
    lb = model.lb_loss()
    torch.testing.assert_close(lb, E / (L * T * k) * assignments, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(coef_lb * lb + coef_z * torch.stack([m.last_z_loss for m in model.moe_layers()]).mean(),
                               model.aux_loss().detach())


def test_all_layers_lb_loss_is_transformers_over_every_layers_logits():
    """The paper's load-balancing loss: 0.01 x transformers' load_balancing_loss_func of the router
    logits of every layer concatenated (written out here; and transformers' own where installed),
    k at perfect balance, and no z-loss."""
    E, k, L = 6, 2, 3
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=L, n_heads=2,
                      moe=MoEConfig(n_experts=E, top_k=k, d_expert=8, lb_loss_coef=0.01, z_loss_coef=0.0,
                                    lb_loss_form="all_layers"))
    model = build(cfg)
    logits = forward_router_logits(model, torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(3)))
    every = torch.cat(logits)  # (L * T, E)
    probs = every.softmax(-1)
    chosen = probs.topk(k, dim=-1).indices
    tokens_per_expert_KE = torch.nn.functional.one_hot(chosen, E).float().mean(0)  # (k, E)
    expected = E * (tokens_per_expert_KE * probs.mean(0)).sum()
    torch.testing.assert_close(model.lb_loss(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.aux_loss(), 0.01 * expected, rtol=1e-6, atol=1e-8)
    transformers = pytest.importorskip("transformers.models.olmoe.modeling_olmoe")
    torch.testing.assert_close(model.lb_loss(), transformers.load_balancing_loss_func(tuple(logits), E, k),
                               rtol=1e-6, atol=1e-7)
    # at perfect balance (every expert's share and mean probability 1/E) the loss is k
    for m in model.moe_layers():
        m.last_tokens_per_expert_E = torch.full((E,), 3)
        m.last_mean_probs_E = torch.full((E,), 1 / E)
    torch.testing.assert_close(model.lb_loss(), torch.tensor(float(k)))


def test_capacity_drops_overflow_in_token_order():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    keep = capacity_keep_mask(idx, 4, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_capacity_factor_zeroes_dropped_assignments():
    base = ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2,
                       moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))
    dropless, capped = build(base), build(base.replace(moe=base.moe.replace(capacity_factor=100.0)))
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.allclose(dropless(tokens), capped(tokens), atol=1e-6)  # huge capacity: nothing dropped
        tight = build(base.replace(moe=base.moe.replace(capacity_factor=0.25)))
        assert not torch.allclose(dropless(tokens), tight(tokens), atol=1e-4)


def test_aux_loss_free_bias_balances_a_skewed_router():
    """No auxiliary loss, no gradient: the per-expert bias alone evens out a skewed router."""
    from optimus_core.model.router import TopKRouter
    cfg = MoEConfig(n_experts=16, top_k=2, d_expert=8, lb_loss_coef=0.0, bias_update_rate=0.002)
    router = TopKRouter(32, cfg)
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        router.gate.weight[:4, 0] += 2.0  # feature 0 is always on: experts 0-3 attract most tokens
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1.0

    def imbalance():
        load = router(x).tokens_per_expert_E.float()
        return (load.max() / load.mean()).item(), load

    start, _ = imbalance()
    for _ in range(300):
        router.update_balance_bias(imbalance()[1])
    end, _ = imbalance()
    assert start > 3 and end < 1.5


@pytest.mark.parametrize("mode, every", [("full", 1), ("full", 2), ("moe", 1)])
def test_activation_checkpointing_gives_the_same_gradients(mode, every):
    cfg = presets.get("mula-7b-a1b@laptop").model
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, saved = [], []
    for m in ("none", mode):
        model = build(cfg)
        recompute(model, m, every)
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t.numel()) or t, lambda t: t):
            loss = model(tokens).float().pow(2).mean().add(model.aux_loss())
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        saved.append(sum(count))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert saved[1] < saved[0]  # it keeps less for the backward
    if mode == "full":
        assert model.recompute_blocks == set(range(every - 1, cfg.n_layers, every))


def test_compiled_blocks_and_final_norm_are_the_same_model(monkeypatch):
    """compile_blocks compiles every block and the final norm (traced here by AOTAutograd with
    eager kernels: the graphs and their backward, without Inductor's C++ build): same loss and
    gradients as the eager model, the final norm among the graphs."""
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    traced = []

    def counting_backend(gm, example_inputs):
        traced.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: real_compile(fn, backend=counting_backend))
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model = build(cfg)
        if compiled:
            compile_blocks(model)
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    final_norm = [gm for gm in traced if len(gm.graph.find_nodes(op="placeholder")) == 2]  # x and the scale
    assert len(final_norm) == 1 and any("rsqrt" in m.code for m in final_norm[0].modules())  # the norm's autograd.Function


def test_activation_checkpointing_modes_are_checked():
    with pytest.raises(ValueError, match="'moe' needs MoE layers"):
        recompute(build(presets.get("mula-1b@laptop").model), "moe")
    with pytest.raises(ValueError, match="must be one of none, full, moe"):
        recompute(build(presets.get("mula-7b-a1b@laptop").model), "selective")


def test_router_counts_need_no_host_sync_and_trace_as_one_graph():
    """The routing counts equal bincount's, but come from a fixed-size scatter: bincount sizes its
    output from the data, which on a GPU waits for the device and splits torch.compile's graph
    (measured: the forward of every layer left host-bound). fullgraph=True fails on any break."""
    from optimus_core.model.router import TopKRouter
    cfg = MoEConfig(n_experts=8, top_k=3, d_expert=8)
    router = TopKRouter(16, cfg)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(0))
    routing = router(x)
    assert routing.tokens_per_expert_E.tolist() == torch.bincount(routing.topk_idx_TK.flatten(),
                                                                  minlength=8).tolist()
    torch._dynamo.reset()
    compiled = torch.compile(router, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x).tokens_per_expert_E, routing.tokens_per_expert_E)


def test_aux_loss_with_shares_counted_elsewhere_uses_them_and_the_forwards_probabilities():
    """lb_loss_scope "global": each layer's term E * sum_e share_e * P_e with the shares given (the
    ranks' counts) and this forward's mean probabilities; with this forward's own shares it is
    the forward's own loss, and only P_e carries a gradient."""
    E, k, L = 4, 2, 3
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=L, n_heads=2,
                      moe=MoEConfig(n_experts=E, top_k=k, d_expert=8, lb_loss_coef=0.3, z_loss_coef=0.01))
    model = build(cfg)
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    model(tokens)
    layers = model.moe_layers()
    own_LE = torch.stack([m.last_tokens_per_expert_E.float() / (tokens.numel() * k) for m in layers])
    torch.testing.assert_close(model.aux_loss(own_LE), model.aux_loss())
    torch.testing.assert_close(own_LE, model.routing_shares())
    share_LE = torch.tensor([[1.0, 0, 0, 0], [0.25] * 4, [0, 0.5, 0.5, 0]])
    probs_LE = torch.stack([m.last_mean_probs_E for m in layers])
    expected = (0.3 * E * (share_LE * probs_LE).sum(-1) + 0.01 * torch.stack([m.last_z_loss for m in layers])).mean()
    got = model.aux_loss(share_LE)
    # the paper's form from the same shares: E k sum_e (mean_l share) (mean_l P)
    together = model.cfg.replace(moe=model.cfg.moe.replace(lb_loss_form="all_layers"))
    model.cfg = together
    torch.testing.assert_close(model.lb_loss(share_LE), E * k * (share_LE.mean(0) * probs_LE.mean(0)).sum())
    model.cfg = cfg
    torch.testing.assert_close(got, expected)
    got.backward()
    assert model.blocks["0"].ffn.router.gate.weight.grad.abs().sum() > 0


KERNEL_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (float32 only)")


@KERNEL_ON_CPU
@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=97, d_model=30, n_layers=2, n_heads=5, moe=MoEConfig(n_experts=4, top_k=2, d_expert=8)),
    ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48),
], ids=["moe-5-heads-of-6", "gqa"])
def test_the_qk_norm_rope_kernel_is_the_same_model(cfg):
    """execution.qk_norm_rope = triton: the reference forward above, and every gradient of the
    torch path (float32: the two differ by float32 rounding only)."""
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    grads = []
    for kernel in (False, True):
        model = build(cfg)
        use_kernels(model, qk_norm_rope=kernel)
        logits = model(tokens)
        if kernel:
            torch.testing.assert_close(logits.detach().double(), reference_forward(model, tokens), rtol=1e-5, atol=1e-5)
        logits.float().square().mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert grads[1]["blocks.0.attn.q_norm.weight"].abs().sum() > 0


def test_the_qk_norm_rope_kernel_needs_qk_norm():
    model = build(ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=4, d_ff=48, qk_norm=False))
    use_kernels(model, qk_norm_rope=False)
    with pytest.raises(ValueError, match="needs a model with QK-norm"):
        use_kernels(model, qk_norm_rope=True)


@pytest.mark.parametrize("fp32_residual, want", [(False, torch.bfloat16), (True, torch.float32)])
def test_the_residual_stream_is_in_the_autocast_dtype_unless_asked_for_float32(fp32_residual, want):
    """Under autocast every block's input and output, and the final norm's output, are bf16 (or
    float32 with fp32_residual); the gradients reach the float32 parameters either way."""
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, moe=MoEConfig(n_experts=4, top_k=2, d_expert=16),
                      max_seq_len=16)
    model = build(cfg)
    model.fp32_residual = fp32_residual
    seen = []
    for block in model.blocks.values():
        block.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden(tokens)
        loss = model.lm_loss(tokens, tokens)
    assert seen == [(want, want)] * 4 and h.dtype == want  # two blocks, two forwards
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in model.parameters())
    seen.clear()
    model(tokens)  # outside autocast: float32 throughout
    assert seen == [(torch.float32, torch.float32)] * 2
