"""The global load-balancing statistic (optimus_core.train.load_balance) on one process: the
shares after each micro-batch are those of the counts seen so far, and a step with one
micro-batch optimises what the per-forward statistic does (the counts are the same)."""
import torch

from optimus_core.config import ModelConfig, MoEConfig
from optimus_core.model.transformer import Transformer
from optimus_core.train.load_balance import GlobalShares
from optimus_core.train.step import train_step


def test_shares_are_those_of_every_micro_batch_so_far():
    shares = GlobalShares()
    first = torch.tensor([[3, 1, 0, 0], [0, 0, 2, 2]])
    second = torch.tensor([[1, 1, 1, 1], [4, 0, 0, 0]])
    torch.testing.assert_close(shares.add(first), torch.tensor([[0.75, 0.25, 0, 0], [0, 0, 0.5, 0.5]]))
    torch.testing.assert_close(shares.add(second), torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.5, 0, 0.25, 0.25]]))


def _step(scope: str, micro_batch: int):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(n_experts=4, top_k=2, d_expert=8, lb_loss_coef=0.5, lb_loss_scope=scope))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(2))
    stats = train_step(model, optimizer, batch, micro_batch=micro_batch, grad_clip=None, lr=0.1, dtype="float32")
    return stats, model


def test_one_micro_batch_on_one_process_is_the_per_forward_loss():
    (forward, m1), (global_, m2) = _step("forward", 4), _step("global", 4)
    assert global_.loss == forward.loss and abs(global_.aux_loss - forward.aux_loss) < 1e-7
    assert abs(global_.lb_loss - forward.lb_loss) < 1e-7
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)


def test_later_micro_batches_use_the_running_counts():
    """Two micro-batches: the second's load-balancing loss uses the counts of both, so the step
    differs from the per-forward statistic's (which uses its own)."""
    (forward, _), (global_, _) = _step("forward", 2), _step("global", 2)
    assert global_.loss == forward.loss  # the first forward is the same; the losses are of it and the second's
    assert abs(global_.lb_loss - forward.lb_loss) > 1e-6


def test_a_step_leaves_no_routing_tensors_on_the_layers():
    """Read (both scopes: "global" reads the mean probabilities after the backward) and then
    dropped: kept, they would hold the micro-batch's graph (MoEFeedForward.clear_routing)."""
    for scope in ("forward", "global"):
        stats, model = _step(scope, 2)
        assert stats.tokens_per_expert_LE.sum() == 2 * 4 * 8 * 2  # layers x tokens x top_k, both micro-batches
        for layer in model.moe_layers():
            assert layer.last_z_loss is None and layer.last_mean_probs_E is None and layer.last_tokens_per_expert_E is None
