"""optimus_kernels.softmax_cross_entropy_: per-row losses and the in-place gradient against
F.cross_entropy and autograd, on odd vocabulary sizes that cross the interpreter's block edges,
with ignored rows, huge and tied logits; the reference; and the argument checks."""
import pytest
import torch
import torch.nn.functional as F

from optimus_kernels.cross_entropy import softmax_cross_entropy_, softmax_cross_entropy_reference_

def _case(C, V, seed=0, scale=3.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(C, V, generator=g) * scale
    targets = torch.randint(0, V, (C,), generator=g)
    valid = torch.rand(C, generator=g) > 0.25
    return logits.to(device), targets.to(device), valid.to(device)


def _autograd(logits, targets, valid):
    """The dumb truth: F.cross_entropy per row and autograd's gradient of the valid rows' sum."""
    x = logits.double().requires_grad_(True)
    per_row = F.cross_entropy(x, targets, reduction="none") * valid
    per_row.sum().backward()
    return per_row.detach(), x.grad


@pytest.fixture(params=["triton", "reference"])
def impl_device(request):
    if request.param == "reference":
        return softmax_cross_entropy_reference_, torch.device("cpu")
    return softmax_cross_entropy_, request.getfixturevalue("triton_device")


@pytest.mark.parametrize("C, V", [(1, 1), (3, 31), (5, 32), (7, 33), (4, 97)])
def test_losses_and_gradient_match_autograd(impl_device, C, V):
    impl, device = impl_device
    logits, targets, valid = _case(C, V, seed=C * V, device=device)
    want_loss, want_grad = _autograd(logits, targets, valid)
    work = logits.clone()
    loss = impl(work, targets, valid)
    assert loss.dtype == torch.float32 and loss.shape == (C,)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work.double(), want_grad, rtol=1e-5, atol=1e-6)
    assert torch.all(work[~valid] == 0) and torch.all(loss[~valid] == 0)


def test_huge_and_tied_logits_stay_finite(triton_device):
    logits = torch.tensor([[1e4, 1e4, -1e4, 0.0], [-1e30, -1e30, -1e30, -1e30], [88.0, -88.0, 0.0, 50.0]],
                          device=triton_device)
    targets, valid = torch.tensor([0, 2, 3], device=triton_device), torch.ones(3, dtype=torch.bool, device=triton_device)
    want_loss, want_grad = _autograd(logits, targets, valid)
    work = logits.clone()
    loss = softmax_cross_entropy_(work, targets, valid)
    assert torch.isfinite(loss).all() and torch.isfinite(work).all()
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_grad_false_leaves_the_logits_and_a_strided_row_view_works(triton_device):
    logits, targets, valid = _case(4, 45, seed=1, device=triton_device)
    wide = torch.zeros(4, 50, device=triton_device)
    wide[:, :45] = logits
    view = wide[:, :45]  # rows of stride 50: the kernel steps by the row stride
    loss = softmax_cross_entropy_(view, targets, valid, grad=False)
    assert torch.equal(view, logits)
    torch.testing.assert_close(loss, softmax_cross_entropy_reference_(logits.clone(), targets, valid))
    softmax_cross_entropy_(view, targets, valid)
    _, want_grad = _autograd(logits, targets, valid)
    torch.testing.assert_close(view.double(), want_grad, rtol=1e-5, atol=1e-6)
    assert torch.all(wide[:, 45:] == 0)  # nothing written past V


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool)), "2-D"),
    ((torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool)), "float32"),
    ((torch.zeros(4, 3).T, torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool)), "contiguous"),
    ((torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), torch.ones(3, dtype=torch.bool)), "targets_C"),
    ((torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.ones(3)), "valid_C"),
])
def test_bad_arguments_are_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        softmax_cross_entropy_reference_(*args)


@pytest.mark.gpu
def test_bf16_logits_on_gpu(gpu_device):
    """bf16 logits of the LM loss's size class: losses to float32 rounding of the same bf16
    inputs, each gradient entry within one bf16 rounding of the float64 truth."""
    logits, targets, valid = _case(64, 50_304, seed=5, scale=4.0, device=gpu_device)
    logits = logits.to(torch.bfloat16)
    want_loss, want_grad = _autograd(logits.float(), targets, valid)
    work = logits.clone()
    loss = softmax_cross_entropy_(work, targets, valid)
    assert work.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(work.double(), want_grad, rtol=2 ** -8, atol=1e-7)
