"""The EP-aware sharded AdamW: torch's AdamW arithmetic, the right shard sizes, and on several
ranks the same parameters as one process training on the whole batch."""
import copy
import dataclasses
import json
import os

import pytest
import torch

from optimus_core.config import ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from optimus_core.model.transformer import Transformer
from optimus_core.parallel import Mesh, ShardedAdamW, full_model_state, init_distributed, parallelize, shutdown
from optimus_core.parallel.launch import spawn_local
from optimus_core.train.optim import build_optimizer
from optimus_core.train.step import train_step

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))
GLOBAL_BATCH, SEQ, STEPS = 8, 8, 10


def _model():
    model = Transformer(MODEL)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def _batch(step):
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("clip, micro_batch", [(None, 0), (1e-2, 0), (1e-2, 4)])  # 4: two micro-batches
@pytest.mark.parametrize("mode, implementation", [("ep_aware", "torch"), ("ep_unaware", "torch"),
                                                  pytest.param("ep_aware", "triton", marks=TRITON_ON_CPU)])
def test_one_process_equals_torch_adamw(clip, micro_batch, mode, implementation):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=clip, implementation=implementation)
    ref, mine = _model(), _model()
    ref_opt = build_optimizer(ref, dataclasses.replace(cfg, implementation="torch"))
    opt = ShardedAdamW(mine, Mesh.single(), cfg, mode=mode)
    norms = []
    for step in range(STEPS):
        a = train_step(ref, ref_opt, _batch(step), micro_batch=micro_batch, grad_clip=clip, lr=cfg.lr, dtype="float32")
        b = train_step(mine, opt, _batch(step), micro_batch=micro_batch, grad_clip=clip, lr=cfg.lr, dtype="float32")
        norms.append((a.grad_norm, b.grad_norm))
    if clip is not None:
        assert all(n > clip for n, _ in norms)  # the clip really cut every step
    for (n_ref, n_mine) in norms:
        assert abs(n_ref - n_mine) <= 1e-5 * n_ref
    for name, p in _params(ref).items():
        torch.testing.assert_close(dict(mine.named_parameters())[name].detach(), p, rtol=0, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_parameters_stay_views_of_the_flat_buffer():
    model = _model()
    opt = ShardedAdamW(model, Mesh.single(), OptimConfig())
    names = [b.name for b in opt.buckets]
    assert names == ["dense.decay", "dense.no_decay", "expert.decay"]  # experts are matrices only
    for b in opt.buckets:
        for p in b.params:
            assert p.untyped_storage().data_ptr() == b.flat_N.untyped_storage().data_ptr()


def test_local_buckets_take_fresh_gradients():
    """A group of one rank reduces nothing: no flat gradient buffer; backward's gradients are
    the parameters' own tensors, dropped by zero_grad (what one process would do)."""
    model = _model()
    opt = ShardedAdamW(model, Mesh.single(), OptimConfig())
    assert all(b.local and b.grad_N is None for b in opt.buckets)
    assert all(p.grad is None for p in model.parameters())
    tokens = _batch(0)
    model(tokens[:, :-1]).square().mean().backward()
    grads = [p.grad for b in opt.buckets for p in b.params]
    flats = {b.flat_N.untyped_storage().data_ptr() for b in opt.buckets}
    assert all(g is not None for g in grads)
    assert not flats & {g.untyped_storage().data_ptr() for g in grads}
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)  # stolen, not views of one buffer
    before = [p.detach().clone() for b in opt.buckets for p in b.params]
    opt.clip_and_step(1.0)
    assert all(not torch.equal(p, q) for p, q in zip((p for b in opt.buckets for p in b.params), before))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def _dense_and_expert_numel(model):
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()) - experts, experts


def _worker(ep, mode, out_dir, overlap=False):
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(ep=ep), n_experts=4, device="cpu")
    try:
        cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.05)
        ref = _model()
        dense_numel, expert_numel = _dense_and_expert_numel(ref)
        model = parallelize(copy.deepcopy(ref), mesh)
        opt = ShardedAdamW(model, mesh, cfg, mode=mode, overlap=overlap, chunk_mb=1e-3)  # ~260 floats a chunk
        ref_opt = build_optimizer(ref, cfg)
        local = GLOBAL_BATCH // mesh.world_size
        for step in range(STEPS):
            batch = _batch(step)
            # one process, the global batch in micro-batches of a rank's share (the same
            # per-forward load-balancing loss as the ranks compute)
            a = train_step(ref, ref_opt, batch, micro_batch=local, grad_clip=cfg.grad_clip, lr=cfg.lr,
                           dtype="float32")
            b = train_step(model, opt, batch[mesh.rank * local:(mesh.rank + 1) * local], micro_batch=0,
                           grad_clip=cfg.grad_clip, lr=cfg.lr, dtype="float32", mesh=mesh)
            assert abs(a.loss - b.loss) < 1e-5 and abs(a.grad_norm - b.grad_norm) < 1e-5 * a.grad_norm
        full = full_model_state(model, mesh)
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(full[name], p, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
        numel = opt.state_numel()
        if mesh.rank == 0:
            (out_dir / f"{mode}.json").write_text(json.dumps({"state": numel, "dense": dense_numel,
                                                               "expert": expert_numel}))
    finally:
        shutdown(mesh)


@pytest.mark.parametrize("mode, overlap", [("ep_aware", False), ("ep_unaware", False), ("ep_aware", True)])
def test_four_ranks_ep2_match_one_process_and_shard_the_state(tmp_path, mode, overlap):
    spawn_local(_worker, 4, (2, mode, tmp_path, overlap), start_method="fork")
    got = json.loads((tmp_path / f"{mode}.json").read_text())
    world, ep = 4, 2
    # flat buffers pad each bucket to shards of whole 16-element blocks: under 16 extra per shard and bucket
    assert got["dense"] / world <= got["state"]["dense"] <= got["dense"] / world + 2 * 16
    local_experts = got["expert"] // ep  # this rank's experts
    if mode == "ep_aware":
        assert local_experts / (world // ep) <= got["state"]["expert"] <= local_experts / (world // ep) + 16
    else:  # the baseline replicates the expert state over the expert-dp group
        assert local_experts <= got["state"]["expert"] < local_experts + 16

