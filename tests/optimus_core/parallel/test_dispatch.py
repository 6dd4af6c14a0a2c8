"""Expert parallelism: either exchange (the all-to-all, the paper's all-gather / reduce-scatter)
gives the single-process layer's outputs and gradients, also when routing is uneven (EP ranks
that receive no tokens for their experts), every token goes to one expert, a token names an
expert twice, and tokens are dropped over capacity."""
import copy
import os

import pytest
import torch
from torch import nn

from optimus_core.config import MoEConfig, ParallelConfig
from optimus_core.model.experts import Experts
from optimus_core.model.moe import MoEFeedForward
from optimus_core.parallel import expert_parallel, init_distributed, shutdown
from optimus_core.parallel.expert_parallel import ExpertParallelExperts
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


def _check_layer(mesh, capacity, skew, backend="loop", exchange="all_to_all", top_k=2):
    cfg = MoEConfig(n_experts=E, top_k=top_k, d_expert=8, capacity_factor=capacity)
    ref = _layer(cfg, skew, backend)
    assert ref.experts.backend == backend
    ep_model = expert_parallel(_Holder(copy.deepcopy(ref)), mesh, exchange)
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
            assert ref.last_tokens_per_expert_E[top_k:].sum() == 0  # only the first experts get tokens

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


def _check_routed(mesh, exchange):
    """apply_routed on routings a router never makes, against the one-process experts: a token
    naming one expert in both slots, every token on expert 0, a rank with no tokens for any of
    its experts (the last rank's experts, the first's here, never chosen)."""
    whole = Experts(E, D, 8)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    T = ROWS_PER_RANK * SEQ
    routings = {
        "repeated": torch.tensor([[1, 1], [2, 3], [3, 3], [0, 2], [1, 0]] * 2)[:T],
        "one expert": torch.zeros(T, 2, dtype=torch.long),
        "empty ranks": torch.full((T, 2), E - 1, dtype=torch.long),
    }
    for name, idx in routings.items():
        experts = ExpertParallelExperts(copy.deepcopy(whole), mesh, exchange)
        x_all = torch.randn(mesh.world_size, T, D, generator=g)
        w_all = torch.rand(mesh.world_size, T, 2, generator=g)
        out_grad = torch.randn(mesh.world_size, T, D, generator=g)
        ref = copy.deepcopy(whole)
        ref_out, ref_dx, ref_dw = [], [], []
        for r in range(mesh.world_size):
            x, w = x_all[r].clone().requires_grad_(), w_all[r].clone().requires_grad_()
            out = ref.apply_routed(x, idx, w, E)
            (out * out_grad[r]).sum().backward()
            ref_out.append(out.detach()), ref_dx.append(x.grad), ref_dw.append(w.grad)
        me = mesh.rank
        x, w = x_all[me].clone().requires_grad_(), w_all[me].clone().requires_grad_()
        out = experts.apply_routed(x, idx, w, E)
        (out * out_grad[me]).sum().backward()
        for got, want in ((out, ref_out[me]), (x.grad, ref_dx[me]), (w.grad, ref_dw[me])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for p_name in ("w_up", "w_down"):
            grad = getattr(experts, p_name).grad.clone()
            torch.distributed.all_reduce(grad, group=mesh.expert_dp_group)
            first = experts.first_row(p_name)
            want = getattr(ref, p_name).grad[first:first + grad.shape[0]]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {p_name}: {m}")


def _worker(ep, backend="loop", exchange="all_to_all"):
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(ep=ep), n_experts=E, device="cpu")
    try:
        for capacity, skew in ((None, False), (None, True), (1.0, False), (0.5, True)):
            _check_layer(mesh, capacity, skew, backend, exchange)
        _check_layer(mesh, None, True, backend, exchange, top_k=1)  # every token to expert 0
        _check_routed(mesh, exchange)
    finally:
        shutdown(mesh)


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_paper_exchange_matches_single_process(world, ep):
    spawn_local(_worker, world, (ep, "loop", "all_gather"), start_method="fork")


def test_all_to_all_matches_single_process_4_ranks_ep2():
    spawn_local(_worker, 4, (2,), start_method="fork")


def test_all_to_all_matches_single_process_2_ranks_ep2():
    spawn_local(_worker, 2, (2,), start_method="fork")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("exchange", ["all_to_all", "all_gather"])
def test_ep_layer_with_the_triton_kernels_2_ranks_ep2(exchange):
    """The receiving rank makes rows only for its own experts' assignments (permute's n_rows):
    the kernels' path through that, against the same single-process reference."""
    spawn_local(_worker, 2, (2, "triton", exchange), start_method="fork")
