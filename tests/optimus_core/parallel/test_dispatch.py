"""Expert parallelism: the all-to-all dispatch / combine gives the single-process layer's outputs
and gradients, also when routing is uneven (EP ranks that receive no tokens for their experts)
and when tokens are dropped over capacity."""
import copy
import os

import pytest
import torch
from torch import nn

from optimus_core.config import MoEConfig, ParallelConfig
from optimus_core.model.moe import MoEFeedForward
from optimus_core.parallel import expert_parallel, init_distributed, shutdown
from optimus_core.parallel.launch import spawn_local

D, E, ROWS_PER_RANK, SEQ = 16, 4, 2, 5


def _layer(cfg: MoEConfig, skew: bool, backend: str = "loop") -> MoEFeedForward:
    layer = MoEFeedForward(D, cfg)
    layer.experts.backend = backend
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if skew:  # positive inputs + these rows: every token picks experts 0 and 1 (EP rank 0)
            layer.router.gate.weight.copy_(torch.tensor([1.0, 0.9, -1.0, -1.1])[:, None].expand(E, D))
    return layer


class _Holder(nn.Module):  # expert_parallel walks a model; any module holding the layer will do
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def _check_layer(mesh, capacity, skew, backend="loop", dispatch="all_to_all"):
    cfg = MoEConfig(n_experts=E, top_k=2, d_expert=8, capacity_factor=capacity)
    ref = _layer(cfg, skew, backend)
    assert ref.experts.backend == backend
    ep_model = expert_parallel(_Holder(copy.deepcopy(ref)), mesh, dispatch)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(mesh.world_size * ROWS_PER_RANK, SEQ, D, generator=g)
    x_all = x_all.abs() if skew else x_all
    w_all = torch.randn(x_all.shape, generator=g)
    mine = slice(mesh.rank * ROWS_PER_RANK, (mesh.rank + 1) * ROWS_PER_RANK)

    # Reference: the whole layer on each rank's slice in turn (capacity is per forward, as in EP).
    ref_out, ref_dx = [], []
    for r in range(mesh.world_size):
        x = x_all[r * ROWS_PER_RANK:(r + 1) * ROWS_PER_RANK].clone().requires_grad_()
        out = ref(x)
        (out * w_all[r * ROWS_PER_RANK:(r + 1) * ROWS_PER_RANK]).sum().backward()
        ref_out.append(out.detach()), ref_dx.append(x.grad)
        if skew:
            assert ref.last_tokens_per_expert_E[2:].sum() == 0  # EP rank 1 gets nothing

    x = x_all[mine].clone().requires_grad_()
    out = ep_model.layer(x)
    (out * w_all[mine]).sum().backward()
    torch.testing.assert_close(out, ref_out[mesh.rank], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_dx[mesh.rank], rtol=1e-5, atol=1e-6)

    gate_grad = ep_model.layer.router.gate.weight.grad.clone()
    torch.distributed.all_reduce(gate_grad)
    torch.testing.assert_close(gate_grad, ref.router.gate.weight.grad, rtol=1e-5, atol=1e-6)
    experts = ep_model.layer.experts
    assert experts.w_up.shape[0] == E // mesh.ep * ref.experts.w_up.shape[0] // E  # its experts' rows
    for name in ("w_up", "w_down"):
        grad = getattr(experts, name).grad.clone()
        torch.distributed.all_reduce(grad, group=mesh.expert_dp_group)  # the other EP groups' tokens
        first = experts.first_row(name)
        want = getattr(ref.experts, name).grad[first:first + grad.shape[0]]
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def _worker(ep, backend="loop", dispatch="all_to_all"):
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(ep=ep), n_experts=E, device="cpu")
    try:
        for capacity, skew in ((None, False), (None, True), (1.0, False), (0.5, True)):
            _check_layer(mesh, capacity, skew, backend, dispatch)
    finally:
        shutdown(mesh)


def _same_results_either_dispatch(ep):
    """all_gather's outputs and gradients are all_to_all's, bit for bit (skewed and dropped routing)."""
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(ep=ep), n_experts=E, device="cpu")
    try:
        for capacity, skew in ((None, True), (0.5, False)):
            cfg = MoEConfig(n_experts=E, top_k=2, d_expert=8, capacity_factor=capacity)
            ref = _layer(cfg, skew)
            g = torch.Generator().manual_seed(2 + mesh.rank)
            x0 = torch.randn(ROWS_PER_RANK, SEQ, D, generator=g)
            x0 = x0.abs() if skew else x0
            got = []
            for dispatch in ("all_to_all", "all_gather"):
                model = expert_parallel(_Holder(copy.deepcopy(ref)), mesh, dispatch)
                x = x0.clone().requires_grad_()
                out = model.layer(x)
                (out * out).sum().backward()
                got.append((out.detach(), x.grad, model.layer.experts.w_up.grad))
            for a, b in zip(*got):
                assert torch.equal(a, b)
    finally:
        shutdown(mesh)


def test_all_gather_dispatch_matches_single_process_and_all_to_all_4_ranks_ep4():
    spawn_local(_worker, 4, (4, "loop", "all_gather"), start_method="fork")
    spawn_local(_same_results_either_dispatch, 4, (4,), start_method="fork")


def test_ep_layer_matches_single_process_4_ranks_ep2():
    spawn_local(_worker, 4, (2,), start_method="fork")


def test_ep_layer_matches_single_process_2_ranks_ep2():
    spawn_local(_worker, 2, (2,), start_method="fork")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
def test_ep_layer_with_the_triton_kernels_2_ranks_ep2():
    """The receiving rank makes rows only for its own experts' assignments (permute's n_rows):
    the kernels' path through that, against the same single-process reference."""
    spawn_local(_worker, 2, (2, "triton"), start_method="fork")
