"""ShardedAdamW keeps the experts' bf16 weight copies current: one process, and 2 gloo ranks at
EP = 1 (the expert shard is half a bucket: a cast after the all-gather) and EP = 2 (an expert-dp
group of one rank: the update writes the copy itself), both optimizer modes. After every bf16
step each copy equals its weight cast, bit for bit; the run is the one without copies, bit for
bit; a sharded checkpoint loads into a fresh model with current copies and trains on alike."""
import json
import os

import pytest
import torch

from optimus_core.config import ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from optimus_core.model.experts import assert_weight_casts_current
from optimus_core.model.transformer import Transformer
from optimus_core.parallel import Mesh, ShardedAdamW, init_distributed, parallelize, shutdown
from optimus_core.parallel.launch import spawn_local
from optimus_core.train import checkpoint as ckpt
from optimus_core.train.step import train_step

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))
GLOBAL_BATCH, SEQ, STEPS = 8, 8, 4
TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _model(seed=0, casts=True):
    model = Transformer(MODEL)
    model.init_weights(torch.Generator().manual_seed(seed))
    if casts:
        model.set_expert_weight_casts(torch.bfloat16)
    return model


def _batch(step, mesh):
    batch = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    local = GLOBAL_BATCH // mesh.world_size
    return batch[mesh.rank * local:(mesh.rank + 1) * local]


def _step(model, opt, step, mesh):
    return train_step(model, opt, _batch(step, mesh), micro_batch=0, grad_clip=0.05, lr=1e-2, dtype="bfloat16",
                      mesh=mesh)


def _expert_bucket(opt):
    (bucket,) = [b for b in opt.buckets if b.name.startswith("expert")]
    return bucket


def _train_and_compare(mesh, mode, implementation, tmp_path=None) -> dict:
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, implementation=implementation)
    plain = parallelize(_model(casts=False), mesh)
    copied = parallelize(_model(), mesh)
    plain_opt, opt = ShardedAdamW(plain, mesh, cfg, mode=mode), ShardedAdamW(copied, mesh, cfg, mode=mode)
    for step in range(STEPS):
        a, b = _step(plain, plain_opt, step, mesh), _step(copied, opt, step, mesh)
        assert a.loss == b.loss and float(a.grad_norm) == float(b.grad_norm)
        assert assert_weight_casts_current(copied) == 4
    for (name, p), q in zip(plain.named_parameters(), copied.parameters()):
        assert torch.equal(p, q), name
    bucket = _expert_bucket(opt)
    copies = [c for layer in copied.moe_layers() for c in layer.experts.weight_casts().values()]
    views = all(c.untyped_storage().data_ptr() == bucket.cast_N.untyped_storage().data_ptr() for c in copies)
    # The update writes the copy where this rank's shard is the whole bucket (and only there).
    writes = getattr(opt.inner, "casts", None) or {}
    hooked = bool(getattr(opt.inner, "_optimizer_step_post_hooks", {}))
    return {"whole_shard": bucket.whole_shard, "views": views, "update_writes": (bucket.shard in writes) or hooked}


@pytest.mark.parametrize("mode, implementation", [("ep_aware", "torch"), ("ep_unaware", "torch"),
                                                  pytest.param("ep_aware", "triton", marks=TRITON_ON_CPU)])
def test_one_process(mode, implementation):
    got = _train_and_compare(Mesh.single(), mode, implementation)
    assert got == {"whole_shard": True, "views": True, "update_writes": True}


def _resume(mesh, tmp_path):
    """Save a sharded checkpoint after 2 steps, load it into a fresh model (other weights, other
    copies) as the Trainer does, then step both: the same weights and current copies."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, implementation="torch")
    model = parallelize(_model(), mesh)
    opt = ShardedAdamW(model, mesh, cfg)
    for step in range(2):
        _step(model, opt, step, mesh)
    sharded = {**ckpt.sharded_model_state(model, mesh), **opt.state_dict(sharded=True)}
    path = ckpt.save_sharded_checkpoint(tmp_path, 2, sharded_state=sharded, state={}, meta={}, rank=mesh.rank)
    found = ckpt.latest_valid(tmp_path) if mesh.rank == 0 else None
    torch.distributed.barrier()
    path = found.path if found is not None else ckpt.checkpoints_dir(tmp_path) / "step_000002"

    fresh = parallelize(_model(seed=7), mesh)
    fresh_opt = ShardedAdamW(fresh, mesh, cfg)
    target = {**ckpt.sharded_model_state(fresh, mesh), **fresh_opt.state_dict(sharded=True)}
    ckpt.load_sharded(path, target)
    fresh.load_state_dict(ckpt.local_model_state(target))
    fresh_opt.load_state_dict({k: v for k, v in target.items() if not k.startswith(ckpt.MODEL)})
    assert assert_weight_casts_current(fresh) == 4
    for step in range(2, 4):
        a, b = _step(model, opt, step, mesh), _step(fresh, fresh_opt, step, mesh)
        assert a.loss == b.loss
        assert assert_weight_casts_current(fresh) == 4
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    for (name, c), d in zip(model.named_buffers(), fresh.buffers()):
        assert torch.equal(c, d), name


def _worker(ep, mode, implementation, out_dir):
    torch.set_num_threads(1)
    mesh = init_distributed(ParallelConfig(ep=ep), n_experts=4, device="cpu")
    try:
        got = _train_and_compare(mesh, mode, implementation)
        if mode == "ep_aware" and implementation == "torch":
            _resume(mesh, out_dir / "run")
        (out_dir / f"rank{mesh.rank}.json").write_text(json.dumps(got))
    finally:
        shutdown(mesh)


@pytest.mark.parametrize("ep, mode, implementation", [
    (1, "ep_aware", "torch"), (2, "ep_aware", "torch"), (1, "ep_unaware", "torch"),
    pytest.param(1, "ep_aware", "triton", marks=TRITON_ON_CPU), pytest.param(2, "ep_aware", "triton", marks=TRITON_ON_CPU)])
def test_two_ranks(tmp_path, ep, mode, implementation):
    spawn_local(_worker, 2, (ep, mode, implementation, tmp_path), start_method="fork")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # EP = 2: each rank holds its experts alone; EP = 1 ep_aware: half the bucket each
        whole = ep == 2 or mode == "ep_unaware"
        assert got == {"whole_shard": whole, "views": True, "update_writes": whole}, (rank, got)
