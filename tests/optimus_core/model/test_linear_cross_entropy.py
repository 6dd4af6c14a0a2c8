"""The chunked LM head + cross-entropy against logits -> F.cross_entropy: values, gradients, memory.

Tolerances. float32: the same sums in another order (1e-5 relative). bf16 autocast: the logits,
log-probabilities and loss are the same numbers (bf16 logits, float32 softmax), so the loss
agrees to float32 rounding; each gradient entry is rounded to bf16 once on both paths, but the
reference rounds grad/N, the fused path the unscaled grad and scales afterwards, so entries may
differ by one bf16 ulp (2^-8 relative), and the per-chunk float32 sum of dW by a few.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from optimus_core.config import ModelConfig, MoEConfig
from optimus_core.execution import recompute
from optimus_core.model.linear_cross_entropy import linear_cross_entropy
from optimus_core.model.transformer import Transformer
from optimus_core.train.step import autocast_context, lm_loss, micro_batch_loss

N, D, V = 37, 24, 150  # N x V is larger than any N x D or V x D tensor


def inputs(dtype=torch.float32, ignored=(3, 20, 21)):
    g = torch.Generator().manual_seed(0)
    h_ND = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w_VD = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    t_N = torch.randint(0, V, (N,), generator=g)
    t_N[list(ignored)] = -100
    return h_ND, w_VD, t_N


def autocast(enabled):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def reference(h_ND, w_VD, t_N, *, bf16, grad_scale=1.0):
    with autocast(bf16):
        logits_NV = F.linear(h_ND, w_VD)
    loss = F.cross_entropy(logits_NV.float(), t_N)
    return (loss.detach(), *torch.autograd.grad(loss * grad_scale, (h_ND, w_VD)))


def fused(h_ND, w_VD, t_N, *, bf16, chunk_rows, grad_scale=1.0):
    with autocast(bf16):
        loss = linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=chunk_rows)
    return (loss.detach(), *torch.autograd.grad(loss * grad_scale, (h_ND, w_VD)))


BF16 = dict(rtol=2e-2, atol=1e-3)  # atol: ~2^-8 of the largest gradient entry here (~0.1-0.3)


@pytest.mark.parametrize("chunk_rows", [1, 8, N, 100])  # 8 does not divide 37; 100 > N
def test_float32_matches_cross_entropy_of_the_logits(chunk_rows):
    h_ND, w_VD, t_N = inputs()
    want = reference(h_ND, w_VD, t_N, bf16=False, grad_scale=0.37)
    got = fused(h_ND, w_VD, t_N, bf16=False, chunk_rows=chunk_rows, grad_scale=0.37)
    assert got[0].dtype == torch.float32 and got[0].ndim == 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_rows", [5, 16, 100])
def test_bf16_autocast_matches_and_the_float32_weight_gets_a_float32_grad(chunk_rows):
    h_ND, w_VD, t_N = inputs()
    want = reference(h_ND, w_VD, t_N, bf16=True, grad_scale=0.37)
    got = fused(h_ND, w_VD, t_N, bf16=True, chunk_rows=chunk_rows, grad_scale=0.37)
    assert got[1].dtype == want[1].dtype == torch.float32 and got[2].dtype == want[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], **BF16)
    torch.testing.assert_close(got[2], want[2], **BF16)
    # and it is really bf16 arithmetic: the float32 loss differs by more than float32 rounding
    assert abs(got[0].item() - reference(h_ND, w_VD, t_N, bf16=False)[0].item()) > 1e-5


def test_bf16_inputs_outside_autocast_compute_in_bf16_and_return_bf16_grads():
    h_ND, w_VD, t_N = inputs(torch.bfloat16)
    want = reference(h_ND, w_VD, t_N, bf16=False)
    got = fused(h_ND, w_VD, t_N, bf16=False, chunk_rows=16)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], **BF16)
    torch.testing.assert_close(got[2], want[2], **BF16)


def test_ignored_targets_do_not_count():
    h_ND, w_VD, t_N = inputs(ignored=range(0, N, 2))
    loss, dh_ND, _ = fused(h_ND, w_VD, t_N, bf16=False, chunk_rows=8)
    kept = t_N != -100
    want = F.cross_entropy(h_ND[kept] @ w_VD.T, t_N[kept])  # the mean over the kept rows only
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    assert dh_ND[~kept].abs().max() == 0 and dh_ND[kept].abs().min() > 0
    everything_ignored = torch.full((N,), -100)
    loss, dh_ND, dw_VD = fused(h_ND, w_VD, everything_ignored, bf16=False, chunk_rows=8)
    assert loss.isnan() and F.cross_entropy(h_ND @ w_VD.T, everything_ignored).isnan()  # as the reference
    assert dh_ND.abs().max() == 0 and dw_VD.abs().max() == 0


def test_only_the_needed_gradient_is_computed_and_no_grad_gives_the_loss():
    h_ND, w_VD, t_N = inputs()
    frozen_VD = w_VD.detach()
    (dh_ND,) = torch.autograd.grad(linear_cross_entropy(h_ND, frozen_VD, t_N, chunk_rows=8), (h_ND,))
    torch.testing.assert_close(dh_ND, reference(h_ND, w_VD, t_N, bf16=False)[1], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        loss = linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(h_ND, w_VD, t_N, bf16=False)[0], rtol=1e-6, atol=1e-6)


def test_backward_runs_once():
    h_ND, w_VD, t_N = inputs()
    loss = linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_bad_shapes_are_refused():
    h_ND, w_VD, t_N = inputs()
    with pytest.raises(ValueError, match="need \\(N, D\\) and \\(V, D\\)"):
        linear_cross_entropy(h_ND, w_VD.T, t_N)
    with pytest.raises(ValueError, match="one per row"):
        linear_cross_entropy(h_ND, w_VD, t_N[:-1])
    with pytest.raises(ValueError, match="chunk_rows = 0"):
        linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=0)


# --- memory: no (N, V) tensor is saved for backward, none is even created -----------------------

def saved_numels(run):
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return numels


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("bf16", [False, True])
def test_nothing_of_n_by_v_elements_is_saved_or_created(bf16):
    h_ND, w_VD, t_N = inputs()

    def fused_loss():
        with autocast(bf16):
            return linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=8)

    def reference_loss():
        with autocast(bf16):
            logits_NV = F.linear(h_ND, w_VD)
        return F.cross_entropy(logits_NV.float(), t_N)

    assert max(saved_numels(fused_loss)) == V * D  # dW; dh is N x D
    assert max(saved_numels(reference_loss)) == N * V  # the test can fail: the logits path saves them
    for run, most in ((fused_loss, 8 * V), (reference_loss, N * V)):
        mode = LargestTensor()
        with mode:
            run().backward()
        assert mode.numel == max(most, V * D), run.__name__


# --- through a model --------------------------------------------------------------------------

def small_model(**overrides):
    cfg = ModelConfig(**{**dict(vocab_size=200, pad_vocab_to=128, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                                moe=MoEConfig(n_experts=4, top_k=2, d_expert=16)), **overrides})
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def logits_loss(model, batch_BS1, *, dtype):
    """The reference: the whole micro-batch's logits, then cross-entropy (no fusion)."""
    tokens_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with autocast_context(batch_BS1.device.type, dtype):
        logits_BSV = model(tokens_BS)
    return lm_loss(logits_BSV, targets_BS)


def param_grads(model, batch_BS1, *, fused=True, **loss_kwargs):
    """micro_batch_loss (fused: the model's chunked LM loss) or, not fused, ``logits_loss``."""
    model.zero_grad(set_to_none=True)
    loss = micro_batch_loss(model, batch_BS1, **loss_kwargs) if fused else logits_loss(model, batch_BS1, **loss_kwargs)
    aux = model.aux_loss()
    (loss + aux if aux is not None else loss).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_models_parameter_grads_are_those_of_the_logits_path(dtype):
    model = small_model()
    assert model.cfg.padded_vocab_size == 256 > model.cfg.vocab_size  # padded rows take part
    batch_BS1 = torch.randint(0, 200, (3, 17), generator=torch.Generator().manual_seed(1))
    loss_ref, want = param_grads(model, batch_BS1, dtype=dtype, fused=False)
    loss, got = param_grads(model, batch_BS1, dtype=dtype, chunk_rows=20)  # 48 tokens: 3 chunks
    assert got.keys() == want.keys() and "lm_head.weight" in got
    assert all(g.dtype == torch.float32 for g in got.values())
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == "float32" else BF16
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")


def test_activation_checkpointing_gives_the_same_grads():
    model = small_model()
    batch_BS1 = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(2))
    _, want = param_grads(model, batch_BS1, dtype="float32", fused=False)
    recompute(model, "full")
    model.train()
    _, got = param_grads(model, batch_BS1, dtype="float32", chunk_rows=7)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_model_lm_loss_equals_cross_entropy_of_its_logits_padded_vocab_included():
    model = small_model(n_layers=1)
    tokens_BS = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(3))
    targets_BS = torch.roll(tokens_BS, -1, 1)
    with torch.no_grad():
        logits_BSV = model(tokens_BS)
        want = F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())
        torch.testing.assert_close(model.lm_loss(tokens_BS, targets_BS, chunk_rows=5), want, rtol=1e-6, atol=1e-6)
        # the padded rows are in the softmax: over the real vocabulary alone the loss is lower
        real_only = F.cross_entropy(logits_BSV[..., :200].flatten(0, 1), targets_BS.flatten())
        assert real_only < want - 1e-3
        torch.testing.assert_close(model.lm_head(model.hidden(tokens_BS)), logits_BSV, rtol=0, atol=0)


KERNEL_ON_CPU = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                                   reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (float32 only)")


@KERNEL_ON_CPU
@pytest.mark.parametrize("chunk_rows", [8, 100])
def test_the_kernel_path_matches_cross_entropy_of_the_logits(chunk_rows):
    """execution.lm_loss = triton: loss and gradients as the logits path's, ignored rows included."""
    h_ND, w_VD, t_N = inputs()
    want = reference(h_ND, w_VD, t_N, bf16=False, grad_scale=0.37)
    loss = linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=chunk_rows, kernel=True)
    got = (loss.detach(), *torch.autograd.grad(loss * 0.37, (h_ND, w_VD)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h_ND, w_VD, t_N, chunk_rows=8, kernel=True), want[0],
                                   rtol=1e-6, atol=1e-6)


@KERNEL_ON_CPU
def test_a_model_with_the_kernel_trains_as_without():
    cfg = ModelConfig(vocab_size=150, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, pad_vocab_to=8)
    grads = []
    for kernel in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights(seed=0)
        model.lm_loss_kernel = kernel
        tokens = torch.randint(0, 150, (2, 9), generator=torch.Generator().manual_seed(1))
        micro_batch_loss(model, tokens, dtype="float32").backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lm_loss_resolves_per_device(monkeypatch):
    """execution.lm_loss: auto is the kernel on GPUs only (never the slow interpreter on a CPU
    run); triton where it cannot run is a clear error naming the choice, not a silent fallback;
    build_model turns the plan's choice into the model's lm_loss_kernel."""
    import optimus_kernels._triton as kt
    from optimus_core.config import DataConfig, ExecutionConfig, RunConfig
    from optimus_core.execution import ExecutionError, resolve_choices
    from optimus_core.train.build import build_model

    cfg = RunConfig(model=small_model().cfg, data=DataConfig(seq_len=16))
    asked = lambda choice: cfg.replace(execution=ExecutionConfig(lm_loss=choice))  # noqa: E731
    monkeypatch.setattr(kt, "INTERPRET", False)
    for device in ("cuda", torch.device("cuda", 0), "xpu"):
        assert resolve_choices(cfg, device, probe=False).lm_loss == "triton"
    assert resolve_choices(cfg, "cpu", probe=False).lm_loss == "torch"
    assert resolve_choices(asked("torch"), "cuda", probe=False).lm_loss == "torch"
    with pytest.raises(ExecutionError, match="execution.lm_loss = 'triton'.*cpu"):
        resolve_choices(asked("triton"), "cpu", probe=False)
    monkeypatch.setattr(kt, "INTERPRET", True)
    assert resolve_choices(asked("triton"), "cpu", probe=False).lm_loss == "triton"
    assert resolve_choices(cfg, "cpu", probe=False).lm_loss == "torch"  # auto: never the interpreter
    monkeypatch.setattr(kt, "INTERPRET", False)
    monkeypatch.setattr(kt, "triton", None)  # no Triton: auto falls back and says why, triton refuses
    plan = resolve_choices(cfg, "cuda")
    assert plan.lm_loss == "torch" and "cannot launch on cuda" in plan.why["lm_loss"]
    with pytest.raises(ExecutionError, match="execution.lm_loss = 'triton'.*cannot launch on cuda"):
        resolve_choices(asked("triton"), "cuda")
    monkeypatch.setattr(kt, "INTERPRET", True)
    for choice, on in (("triton", True), ("torch", False)):
        plan = resolve_choices(asked(choice), "cpu", probe=False)
        assert build_model(asked(choice), plan=plan).lm_loss_kernel is on


def test_dw_is_summed_by_the_gemm_only_where_it_writes_float32():
    from optimus_core.model import linear_cross_entropy as lce

    assert not lce._gemm_writes_float32(torch.device("cpu"))
    d, h = torch.randn(8, 5).bfloat16(), torch.randn(8, 3).bfloat16()
    dw = lce.accumulate_dw(None, d, h)
    assert dw.dtype == torch.float32 and torch.equal(dw, (d.T @ h).float())  # the product, then the sum
    assert torch.equal(lce.accumulate_dw(dw.clone(), d, h), dw + (d.T @ h).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dw_summed_by_the_gemm_is_at_least_as_close_to_float64_on_cuda():
    """Three bf16 chunks: the GEMM's float32 sum (the default on CUDA) against float64, no
    farther off than a bf16 product added to a float32 sum (what it replaced)."""
    from optimus_core.model import linear_cross_entropy as lce

    assert lce._gemm_writes_float32(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = [(torch.randn(256, 1000, device="cuda", generator=gen).bfloat16(),
               torch.randn(256, 128, device="cuda", generator=gen).bfloat16()) for _ in range(3)]
    ref = sum(d.double().T @ h.double() for d, h in chunks)
    dw = added = None
    for d, h in chunks:
        dw = lce.accumulate_dw(dw, d, h)
        part = (d.T @ h).float()
        added = part if added is None else added + part
    assert dw.dtype == torch.float32
    err, err_added = ((x.double() - ref).abs().max().item() for x in (dw, added))
    assert err <= err_added and err < 1e-3 * ref.abs().max().item()
