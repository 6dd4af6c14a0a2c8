"""Gradient reduction overlapped with the backward (grad_sync.py): the chunks launch during the
backward, in one order on every rank, and the reduced gradients equal the reduce-scatter /
all-reduce path's; an unused parameter or a skipped step does not hang or leak into the next."""
import copy
import json

import pytest
import torch
from torch import nn

from optimus_core.config import ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from optimus_core.model.transformer import Transformer
from optimus_core.parallel import Mesh, ShardedAdamW, init_distributed, parallelize, shutdown
from optimus_core.parallel.grad_sync import split_into_chunks
from optimus_core.parallel.launch import spawn_local

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))
TINY_CHUNK_MB = 700 / 2**20  # ~175 float32 per chunk: most chunks straddle two ranks' shards


def _batch(rank, step=0):
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(model, tokens_BS1):
    logits = model(tokens_BS1[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens_BS1[:, 1:].flatten()) + model.aux_loss()


def _transformer_worker(ep, mode, out_dir):
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(ep=ep), n_experts=4, device="cpu")
    try:
        ref = Transformer(MODEL)
        ref.init_weights(torch.Generator().manual_seed(0))
        models = [parallelize(copy.deepcopy(ref), mesh) for _ in range(2)]
        plain = ShardedAdamW(models[0], mesh, OptimConfig(), mode=mode)
        overlapped = ShardedAdamW(models[1], mesh, OptimConfig(), mode=mode, overlap=True, chunk_mb=TINY_CHUNK_MB)
        sync = overlapped.grad_sync
        _loss(models[0], _batch(mesh.rank)).backward()
        overlapped.arm_grad_sync()
        _loss(models[1], _batch(mesh.rank)).backward()
        launched_in_backward = sync._next  # every chunk is complete by the end of the backward
        overlapped.grad_sync.finish()
        for a, b in zip(plain.buckets, overlapped.buckets):
            for (lo_b, got), (lo_a, want) in zip(b.reduced_grad(), a.reduce_grad(), strict=True):
                assert lo_a == lo_b
                torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=lambda m: f"{a.name}: {m}")
        owners = {id(c): {c.lo // c.bucket.shard.numel(), (c.hi - 1) // c.bucket.shard.numel()} for c in sync.chunks}
        if mesh.rank == 0:
            (out_dir / "out.json").write_text(json.dumps({
                "chunks": len(sync.chunks), "launched_in_backward": launched_in_backward,
                "straddling": sum(len(o) > 1 for o in owners.values()),
                "order": [c.first_param for c in sync.chunks]}))
    finally:
        shutdown(mesh)


@pytest.mark.parametrize("nproc, ep, mode", [(2, 1, "ep_aware"), (4, 2, "ep_aware"), (4, 2, "ep_unaware")])
def test_overlapped_reduction_equals_the_plain_one(tmp_path, nproc, ep, mode):
    spawn_local(_transformer_worker, nproc, (ep, mode, tmp_path), start_method="fork")
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["chunks"] > 10 and got["straddling"] > 0
    assert got["launched_in_backward"] == got["chunks"]  # none waited for finish()
    assert got["order"] == sorted(got["order"], reverse=True)  # backward's order: last parameters first


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.unused, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sum()


def _unused_worker(out_dir):
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(), device="cpu")
    try:
        torch.manual_seed(0)
        model = _WithUnused()
        ref = copy.deepcopy(model)
        opt = ShardedAdamW(model, mesh, OptimConfig(lr=1e-2, weight_decay=0.0), overlap=True, chunk_mb=64 / 2**20)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(mesh.rank))
        # a skipped step: armed, backward launches reductions, then zero_grad drops them
        opt.arm_grad_sync()
        model(x * 100).backward()
        opt.zero_grad()
        assert all(b.grad_N.abs().max() == 0 for b in opt.buckets)
        # a real step: the unused layer's chunks never complete and launch in finish()
        opt.arm_grad_sync()
        model(x).backward()
        pending = [c for c in opt.grad_sync.chunks if c.pending > 0]
        opt.clip_and_step(max_norm=None)
        # the reference: the mean gradient over both ranks' inputs, by hand
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(mesh.world_size)]
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        (sum(ref(x_r) for x_r in xs) / mesh.world_size).backward()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if mesh.rank == 0:
            (out_dir / "out.json").write_text(json.dumps({"pending": len(pending)}))
    finally:
        shutdown(mesh)


def test_an_unused_parameter_and_a_skipped_step(tmp_path):
    spawn_local(_unused_worker, 2, (tmp_path,), start_method="fork")
    assert json.loads((tmp_path / "out.json").read_text())["pending"] >= 1


def test_chunks_are_whole_parameters_covering_the_buffer():
    model = Transformer(MODEL)
    opt = ShardedAdamW(model, Mesh.single(), OptimConfig())
    order_of = {id(p): i for i, p in enumerate(model.parameters())}
    for bucket in opt.buckets:
        starts, offset = set(), 0
        for p in bucket.params:
            starts.add(offset)
            offset += p.numel()
        for cap_bytes in (1, 4096, 1 << 30):
            chunks = split_into_chunks(bucket, cap_bytes, order_of)
            spans = sorted((c.lo, c.hi) for c in chunks)
            assert spans[0][0] == 0 and spans[-1][1] == bucket.flat_N.numel()
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
            assert all(c.lo in starts for c in chunks)  # whole parameters
            assert sum(c.n_params for c in chunks) == len(bucket.params)
            if cap_bytes == 1:
                assert len(chunks) == len(bucket.params)
            if cap_bytes == 1 << 30:
                assert len(chunks) == 1
