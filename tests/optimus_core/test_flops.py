"""Activation recomputation's FLOPs (optimus_core.flops.recompute_flops_per_token) against the
real model: the matmul FLOPs torch's FlopCounterMode counts in a forward + backward with the
checkpointing on, less those with it off, are the tokens times the count (attention by the math
SDPA, whose matmuls are counted; the experts by the loop backend, plain matmuls). Checkpoint's
early stop is off here: the loop's matmuls save their inputs before they run, so with it on the
recomputation ends before the last expert's down projection, which nothing saves; the triton
experts (custom ops) save after they run and are recomputed whole, as counted."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from optimus_core import presets
from optimus_core.execution import recompute, use_kernels
from optimus_core.model.transformer import Transformer


def counted_flops(model: Transformer, tokens_BS: torch.Tensor) -> int:
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(False), FlopCounterMode(display=False) as counter:
        model(tokens_BS).float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("mode,every", [("full", 1), ("full", 2), ("full", 3), ("moe", 1), ("level1", 1), ("level2", 1),
                                        ("level4", 1), ("level7", 1)])
def test_recompute_flops_are_what_the_backward_repeats(mode, every):
    cfg = presets.get("mula-7b-a1b@laptop").model.replace(n_layers=5)
    torch.manual_seed(0)
    model = use_kernels(Transformer(cfg), experts="loop")
    B, S = 2, 24
    tokens = torch.randint(0, cfg.vocab_size, (B, S))
    base = counted_flops(model, tokens)
    recompute(model, mode, every)
    assert counted_flops(model, tokens) - base == B * S * cfg.recompute_flops_per_token(S, mode, every)


def test_recompute_flops_conventions():
    cfg = presets.get("mula-7b-a1b").model  # 16 layers, d_model 2048, 64 experts top-8 of 1024
    assert cfg.recompute_flops_per_token(4096, "none") == 0
    block_fwd = 2 * (4 * 2048 * 2048 + 2048 * 64 + 8 * 3 * 2048 * 1024) + 4 * 2048 * 4096
    assert cfg.recompute_flops_per_token(4096, "full", 1) == 16 * block_fwd
    assert cfg.recompute_flops_per_token(4096, "full", 2) == 8 * block_fwd
    assert cfg.recompute_flops_per_token(4096, "full", 5) == 3 * block_fwd  # blocks 4, 9, 14
    assert cfg.recompute_flops_per_token(4096, "moe") == 16 * 2 * 8 * 3 * 2048 * 1024
    # every block recomputed: one more forward of the blocks, a third of their training FLOPs
    head = 6 * cfg.padded_vocab_size * 2048
    assert cfg.recompute_flops_per_token(4096, "full") * 3 == cfg.flops_per_token(4096) - head
    # the authors' levels: the experts of every layer (bit 1), the attention (bit 2), norms free
    attention = 2 * 4 * 2048 * 2048 + 4 * 2048 * 4096
    assert cfg.recompute_flops_per_token(4096, "level1") == cfg.recompute_flops_per_token(4096, "moe")
    assert cfg.recompute_flops_per_token(4096, "level6") == 16 * attention
    assert cfg.recompute_flops_per_token(4096, "level7") == 16 * attention + cfg.recompute_flops_per_token(4096, "moe")
    with pytest.raises(ValueError, match="must be none, full, moe or level1..level7"):
        cfg.recompute_flops_per_token(4096, "selective")
    for mode in ("moe", "level1"):
        with pytest.raises(ValueError, match="needs an MoE model"):
            presets.get("mula-1b").model.recompute_flops_per_token(4096, mode)
