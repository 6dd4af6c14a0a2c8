"""The LM head and its cross-entropy in one pass over row chunks: no (tokens x vocab) tensor.

    loss = linear_cross_entropy(h_ND, model.lm_head.weight, targets_N, chunk_rows=4096)
    loss.backward()        # == F.cross_entropy((h_ND @ W_VD.T).float(), targets_N), same grads

Per chunk of rows: the logits in the matmul dtype (bf16 under autocast, like nn.Linear's), their
log-softmax in float32, the loss of the targets, and -- the loss being a scalar, its gradient is
known before backward -- the gradients of h and W right there, so no chunk's logits outlive its
iteration. What is kept for backward is dh (N x D) and dW (V x D, float32); backward only scales
them by the incoming gradient. Every vocabulary row of W takes part in the softmax, the padded
ones included, exactly as the logits of ``Transformer.forward`` do (the padded rows are trained
towards -inf like any never-seen token), so losses equal those of the logits path.

Versus logits -> .float() -> F.cross_entropy (bf16 autocast), the logits see three elementwise
passes besides the matmuls (the cast to float32 that log_softmax(dtype=float32) makes on a GPU,
the float32 log-softmax, its exp into bf16: ~20 bytes per logit) instead of five (to float32,
log-softmax, the zero-filled loss gradient, log-softmax backward, back to bf16: ~36 bytes), and
only one chunk's logits live at a time (~6 bytes each) instead of the whole micro-batch's in
bf16 and float32 and their gradients.

``kernel=True`` (the execution plan's lm_loss, optimus_core.execution): the log-softmax, the
loss and the gradient of a chunk in one Triton kernel that overwrites the logits with their
gradient (optimus_kernels.cross_entropy): each logit read twice and written once in the compute dtype (6
bytes for bf16) instead of the cast, the float32 log-softmax and the exp (20 bytes); the same
arithmetic in float32, rounded once.
"""
from __future__ import annotations

import torch

import optimus_kernels.cross_entropy

# Rows per chunk. Transient memory is ~6 bytes per logit of a chunk (bf16 logits + float32
# log-probabilities): 1.2 GB at 4096 rows and V = 50,304; the logits path holds ~10 bytes
# per logit of the whole micro-batch at once (8192 tokens: ~4 GB). Each matmul of a chunk
# (4096 x 2048 x 50,304, 0.84 TFLOP) is still large enough to run at the full matmul rate; a
# chunk more costs one more float32 read and write of dW (V x D), in its GEMM on CUDA.
DEFAULT_CHUNK_ROWS = 4096


def linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                         chunk_rows: int = DEFAULT_CHUNK_ROWS, ignore_index: int = -100,
                         kernel: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``h_ND @ weight_VD.T`` against ``targets_N`` (a float32 0-d tensor).

    The mean runs over the targets that are not ``ignore_index`` (NaN if there are none, as
    F.cross_entropy). Inside ``torch.autocast`` the matmuls run in the autocast dtype, as
    ``nn.Linear`` would, and the gradients come back in the inputs' own dtypes (float32 for a
    float32 master weight); outside it, in ``h_ND``'s dtype. The gradients are computed in the
    forward: backward may run once. ``kernel``: the softmax part in one Triton kernel (module
    doc; a CUDA / XPU device, or TRITON_INTERPRET=1 with float32).
    """
    if h_ND.ndim != 2 or weight_VD.ndim != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"h_ND {tuple(h_ND.shape)} and weight_VD {tuple(weight_VD.shape)}: need (N, D) and (V, D)")
    if targets_N.shape != h_ND.shape[:1]:
        raise ValueError(f"targets_N {tuple(targets_N.shape)} must be ({h_ND.shape[0]},), one per row of h_ND")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows = {chunk_rows}: must be >= 1")
    device_type = h_ND.device.type
    compute_dtype = h_ND.dtype
    if torch.is_autocast_enabled(device_type) and h_ND.dtype != torch.float64:  # autocast leaves float64 alone
        compute_dtype = torch.get_autocast_dtype(device_type)
    grads = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h_ND, weight_VD, targets_N, compute_dtype, chunk_rows, ignore_index,
                                     grads and h_ND.requires_grad, grads and weight_VD.requires_grad, kernel)


def accumulate_dw(dw_VD: torch.Tensor | None, dlogits_CV: torch.Tensor, h_CD: torch.Tensor) -> torch.Tensor:
    """``dw_VD + dlogits_CV.T @ h_CD`` in float32 (``dw_VD`` None before the first chunk), what
    the float32 master weight receives. Where the GEMM can write float32 from 16-bit inputs
    (torch's mm / addmm ``out_dtype``: CUDA), it adds each chunk into the sum itself: no 16-bit
    product written and read back, no pass of its own for the add (a shorter step, measured on an
    H200), and the product is not rounded to bf16 first; elsewhere the chunk's product in the
    compute dtype, then added."""
    if dlogits_CV.dtype != torch.float32 and _gemm_writes_float32(dlogits_CV.device):
        if dw_VD is None:
            return torch.mm(dlogits_CV.T, h_CD, out_dtype=torch.float32)
        return torch.addmm(dw_VD, dlogits_CV.T, h_CD, out_dtype=torch.float32, out=dw_VD)
    part_VD = dlogits_CV.T @ h_CD
    return part_VD.float() if dw_VD is None else dw_VD.add_(part_VD)


_GEMM_WRITES_FLOAT32: dict[str, bool] = {}  # device type -> whether mm / addmm take out_dtype there


def _gemm_writes_float32(device: torch.device) -> bool:
    """Whether torch's mm and addmm take ``out_dtype=float32`` for bf16 inputs on ``device``'s
    type: CUDA in the torch versions that have the overloads, asked once per process."""
    if device.type != "cuda":
        return False
    if device.type not in _GEMM_WRITES_FLOAT32:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        try:
            c = torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            _GEMM_WRITES_FLOAT32[device.type] = bool(c.dtype == torch.float32 and (c == 32).all())
        except (TypeError, RuntimeError, NotImplementedError):
            _GEMM_WRITES_FLOAT32[device.type] = False
    return _GEMM_WRITES_FLOAT32[device.type]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, compute_dtype, chunk_rows, ignore_index, need_dh, need_dw,
                kernel):
        with torch.autocast(h_ND.device.type, enabled=False):  # the dtypes below are chosen, not cast
            w_VD = weight_VD.to(compute_dtype)  # once, not per chunk
            valid_N = targets_N != ignore_index
            safe_N = torch.where(valid_N, targets_N, 0)  # a gatherable index on ignored rows
            count = valid_N.sum()
            nll = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            dh_ND = torch.empty_like(h_ND) if need_dh else None
            dw_VD = None
            grad = need_dh or need_dw
            for start in range(0, h_ND.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                h_CD, t_C1, valid_C1 = h_ND[rows].to(compute_dtype), safe_N[rows, None], valid_N[rows, None]
                logits_CV = h_CD @ w_VD.T
                if kernel:  # loss and gradient in one pass, over the logits; ignored rows' gradient is zero
                    nll += optimus_kernels.cross_entropy.softmax_cross_entropy_(logits_CV, safe_N[rows], valid_N[rows],
                                                                        grad=grad).sum()
                    dlogits_CV, keep_C1 = logits_CV, None
                else:
                    # float32 log-softmax of the compute-dtype logits: F.cross_entropy(logits.float())
                    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
                    del logits_CV
                    logp_C1 = logp_CV.gather(1, t_C1)
                    nll -= torch.where(valid_C1, logp_C1, 0.0).sum()
                    if grad:
                        # d(sum of row losses)/d(logits) = softmax - one_hot(target): exp of the
                        # log-probs straight into the compute dtype, then the target entries,
                        # rounded from float32.
                        if compute_dtype == torch.float32:
                            dlogits_CV = logp_CV.exp_()
                        else:
                            dlogits_CV = torch.exp(logp_CV, out=torch.empty_like(logp_CV, dtype=compute_dtype))
                        del logp_CV
                        dlogits_CV.scatter_(1, t_C1, (logp_C1.exp() - valid_C1.float()).to(compute_dtype))
                        # Ignored rows: zero in h and in dh instead of a pass over their logits.
                        keep_C1 = valid_C1.to(compute_dtype)
                if need_dh:
                    dh_CD = dlogits_CV @ w_VD
                    dh_ND[rows] = dh_CD if keep_C1 is None else dh_CD * keep_C1
                if need_dw:
                    dw_VD = accumulate_dw(dw_VD, dlogits_CV, h_CD if keep_C1 is None else h_CD * keep_C1)
                # This chunk's logits go before the next chunk's are made: held over, with the dW
                # part, they would sit on top of the forward's activations, where the step peaks.
                logits_CV = dlogits_CV = None
            loss = nll / count  # NaN when every target is ignored, as F.cross_entropy
            inv_count = 1.0 / count.clamp(min=1).float()
        ctx.save_for_backward(dh_ND, dw_VD, inv_count)
        ctx.weight_dtype = weight_VD.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError("linear_cross_entropy computes its gradients in the forward and scales them in "
                               "place: backward can run only once (no retain_graph)")
        ctx.backward_done = True
        dh_ND, dw_VD, inv_count = ctx.saved_tensors
        scale = grad_loss.float() * inv_count
        # In place: these buffers are ours alone, and a second copy of dW (V x D) is 400 MB at scale.
        grad_h = dh_ND.mul_(scale) if dh_ND is not None else None
        grad_w = dw_VD.mul_(scale).to(ctx.weight_dtype) if dw_VD is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None
