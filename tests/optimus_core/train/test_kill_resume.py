"""kill -9 at a random step, restart, and the run is the uninterrupted run bit for bit (float32 CPU).

The run under test is a separate process (forked: no torch re-import) that writes its losses to
a results store, as `optimus pretrain` does; the test kills it with SIGKILL once a random
checkpoint is published (the kill lands somewhere in the steps after it: mid-step, mid-log or
mid-save), runs it again on the same directory, and compares the store's losses with those of
an uninterrupted run. The same for two gloo ranks, one of them killed: the launcher must end
the survivor (no hang), and the rerun resumes both.
"""
import multiprocessing
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

from optimus_core import presets
from optimus_core.parallel.launch import spawn_local
from optimus_core.store import open_store
from optimus_core.train import checkpoint as ckpt
from stages.pretrain import PretrainConfig, PretrainInputs, PretrainOutputs, run_pretrain

STEPS, EVERY = 18, 3
RUN_ID = "kill-test"


def tiny_cfg(ep: int = 1, async_checkpoint: bool = False, pp: int = 1):
    return presets.get("mula-7b-a1b@laptop").run_config(**{
        "train.steps": STEPS, "train.checkpoint_every": EVERY, "train.eval_batches": 1, "train.device": "cpu",
        "train.global_batch": 4, "data.seq_len": 32, "schedule.warmup_steps": 2, "model.n_layers": pp,
        "model.moe.n_experts": 8, "model.moe.top_k": 2, "parallel.ep": ep, "parallel.pp": pp,
        "train.micro_batch": 2 if pp > 1 else 0, "train.async_checkpoint": async_checkpoint})


def _one_rank(cfg_json, tokens_dir, run_dir, store):
    from optimus_core.config import RunConfig

    torch.set_num_threads(1)
    run_pretrain(PretrainConfig(RunConfig.from_json(cfg_json), run_id=RUN_ID, progress=False),
                 PretrainInputs(data_dir=tokens_dir), PretrainOutputs(run_dir=run_dir, store=store))


def _launch(nproc, cfg_json, tokens_dir, run_dir, store):
    """What `optimus pretrain --nproc N` runs: one rank here, or N ranks through spawn_local."""
    if nproc == 1:
        _one_rank(cfg_json, tokens_dir, run_dir, store)
    else:
        spawn_local(_one_rank, nproc, (cfg_json, tokens_dir, run_dir, store), start_method="fork", grace_s=2)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


def _newest_step(run_dir: Path) -> int:
    """The newest published step directory (published whole: atomic_dir), 0 before the first."""
    dirs = ckpt.list_step_dirs(run_dir)
    return int(dirs[-1].name.split("_")[1]) if dirs else 0


def _losses(store: Path) -> list[tuple[int, float]]:
    frame = open_store(store, mode="r").metrics(RUN_ID)
    return list(zip(frame["step"].astype(int).tolist(), frame["loss"].tolist()))


def run_killed_then_rerun(nproc, cfg, tokens_dir, run_dir, store, seed):
    rng = random.Random(seed)
    kill_after = rng.randrange(EVERY, STEPS - EVERY, EVERY)  # a published checkpoint, then a random delay
    fork = multiprocessing.get_context("fork")
    args = (nproc, cfg.to_json(), tokens_dir, run_dir, store)
    first = fork.Process(target=_launch, args=args)
    first.start()
    deadline = time.monotonic() + 120
    while _newest_step(run_dir) < kill_after:
        assert first.is_alive(), f"the run ended (status {first.exitcode}) before step {kill_after}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.15))
    victim = first.pid if nproc == 1 else rng.choice(_children(first.pid))  # one rank of the job
    os.kill(victim, signal.SIGKILL)
    first.join(60)
    assert first.exitcode is not None, "a surviving rank hangs after its peer was killed"
    assert first.exitcode != 0
    assert ckpt.latest_valid(run_dir).step >= kill_after
    again = fork.Process(target=_launch, args=args)
    again.start()
    again.join(120)
    assert again.exitcode == 0
    return kill_after


@pytest.fixture(scope="module")
def reference(tokens_dir, tmp_path_factory):
    """The uninterrupted runs' losses, from their stores: {nproc: [(step, loss), ...]}."""
    out = {}
    for nproc in (1, 2):
        root = tmp_path_factory.mktemp(f"straight{nproc}")
        _launch(nproc, tiny_cfg(ep=nproc).to_json(), tokens_dir, root / "run", root / "store.zarr")
        out[nproc] = _losses(root / "store.zarr")
        assert [s for s, _ in out[nproc]] == list(range(1, STEPS + 1))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_a_random_step_then_resume_is_bit_identical(reference, tokens_dir, tmp_path, seed):
    run_killed_then_rerun(1, tiny_cfg(), tokens_dir, tmp_path / "run", tmp_path / "store.zarr", seed)
    assert _losses(tmp_path / "store.zarr") == reference[1]


def test_two_ranks_one_killed_then_resume_is_bit_identical(reference, tokens_dir, tmp_path):
    run_killed_then_rerun(2, tiny_cfg(ep=2), tokens_dir, tmp_path / "run", tmp_path / "store.zarr", seed=3)
    assert _losses(tmp_path / "store.zarr") == reference[2]


def test_a_pipeline_stage_killed_then_resume_is_bit_identical(tokens_dir, tmp_path):
    """Two gloo ranks, one pipeline of two stages (one layer each, two micro-batches a step):
    one stage killed, the rerun resumes both from the newest checkpoint and follows the
    uninterrupted pipelined run bit for bit."""
    cfg = tiny_cfg(pp=2)
    _launch(2, cfg.to_json(), tokens_dir, tmp_path / "straight", tmp_path / "straight.zarr")
    run_killed_then_rerun(2, cfg, tokens_dir, tmp_path / "run", tmp_path / "store.zarr", seed=6)
    assert _losses(tmp_path / "store.zarr") == _losses(tmp_path / "straight.zarr")


@pytest.mark.parametrize("nproc, seed", [(1, 4), (2, 5)])
def test_background_checkpoints_survive_a_kill_9_too(reference, tokens_dir, tmp_path, nproc, seed):
    """train.async_checkpoint: written from a CPU copy while training goes on, published at the
    next save; a kill loses at most the one being written."""
    cfg = tiny_cfg(ep=nproc, async_checkpoint=True)
    run_killed_then_rerun(nproc, cfg, tokens_dir, tmp_path / "run", tmp_path / "store.zarr", seed)
    assert _losses(tmp_path / "store.zarr") == reference[nproc]
    assert [int(p.name[5:]) for p in ckpt.list_step_dirs(tmp_path / "run")] == [STEPS - EVERY, STEPS]
    assert sorted(p.name for p in ckpt.checkpoints_dir(tmp_path / "run").iterdir()
                  if p.name.startswith(".")) == []  # no temporary directory left behind


# ----------------------------------------------------------------------------- resharding

def _reshard_cfg(ep: int, checkpoint_every: int = 0):
    # micro_batch 1 on every layout: the load-balancing loss is a per-forward statistic
    base = tiny_cfg(ep=ep)
    return base.replace(train=base.train.replace(steps=12, micro_batch=1, checkpoint_every=checkpoint_every,
                                                 keep_every=6))


def _copy_at_step(run_dir: Path, to: Path, step: int) -> None:
    shutil.copytree(run_dir, to)
    for path in ckpt.list_step_dirs(to):
        if int(path.name.split("_")[1]) > step:
            shutil.rmtree(path)
    (to / "summary.json").unlink()


def test_a_sharded_checkpoint_resumes_on_another_world_size_and_ep(tokens_dir, tmp_path):
    """Saved by 4 ranks with ep 2, sharded in blocks of 2 and replicated twice, at step 6; resumed
    by 2 ranks with ep 1, by 4 ranks with ep 4 and by one process: the rest of the loss curve is
    the uninterrupted one (the reduction order differs: 1e-5)."""
    saved = tmp_path / "saved"
    cfg = _reshard_cfg(ep=2, checkpoint_every=6)
    cfg = cfg.replace(parallel=cfg.parallel.replace(dp_shard=2))
    _launch(4, cfg.to_json(), tokens_dir, saved / "run", saved / "store.zarr")
    reference = _losses(saved / "store.zarr")
    assert ckpt.latest_valid(saved / "run").meta["format"] == ckpt.FORMAT
    for nproc, ep in ((2, 1), (4, 4), (1, 1)):
        where = tmp_path / f"w{nproc}-ep{ep}"
        _copy_at_step(saved / "run", where / "run", 6)
        _launch(nproc, _reshard_cfg(ep=ep).to_json(), tokens_dir, where / "run", where / "store.zarr")
        resumed = _losses(where / "store.zarr")
        assert [s for s, _ in resumed] == list(range(7, 13))
        assert max(abs(a - b) for (_, a), (_, b) in zip(resumed, reference[6:])) < 1e-5, (nproc, ep)


def test_one_process_reads_a_sharded_checkpoint_whole(tokens_dir, tmp_path):
    run = tmp_path / "run"
    _launch(2, tiny_cfg(ep=2).replace(train=tiny_cfg().train.replace(steps=2)).to_json(), tokens_dir, run, None)
    full = ckpt.latest_valid(run).load_model_state()  # export, evaluation: no ranks needed
    w_up = next(v for k, v in full.items() if k.endswith("experts.w_up"))
    cfg = tiny_cfg()
    assert w_up.shape[0] == cfg.model.moe.n_experts * cfg.model.d_model  # every expert's rows, from both ranks


def test_a_damaged_sharded_checkpoint_is_skipped_for_the_one_before(tokens_dir, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_cfg(ep=2)
    cfg = cfg.replace(train=cfg.train.replace(steps=4, checkpoint_every=2, keep_checkpoints=3))
    _launch(2, cfg.to_json(), tokens_dir, run, None)
    newest = ckpt.latest_valid(run)
    assert newest.step == 4 and newest.meta["format"] == ckpt.FORMAT
    shard = newest.path / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # rank 1's shard truncated
    with pytest.warns(UserWarning, match=r"__1_0.distcp fails its sha256 checksum \(listed in manifests/rank_00001"):
        assert ckpt.latest_valid(run).step == 2
    (ckpt.checkpoints_dir(run) / "step_000002" / ".metadata").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.latest_valid(run) is None
    assert [str(w.message).rsplit(": ", 1)[-1] for w in caught] == [
        "__1_0.distcp fails its sha256 checksum (listed in manifests/rank_00001.json)",
        ".metadata is missing (listed in meta.json)"]


def _stopped_after_step_5(cfg, tokens_dir, run_dir, monkeypatch) -> None:
    """Train ``cfg`` into ``run_dir`` with a SIGTERM arriving during step 5: it stops there."""
    from optimus_core.train import loop as loop_module
    from optimus_core.train.loop import Trainer
    from optimus_core.train.resilience import Preempted

    real, calls = loop_module.train_step, [0]

    def sigterm_on_the_fifth(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "train_step", sigterm_on_the_fifth)
        with pytest.raises(Preempted, match="after step 5"):
            Trainer(cfg, tokens_dir, run_dir, progress=False).fit()


def test_a_stop_signal_publishes_the_background_checkpoint_before_exiting(tokens_dir, tmp_path, monkeypatch):
    from optimus_core.train.loop import Trainer
    from sinks import ListSink

    cfg = tiny_cfg(async_checkpoint=True)
    cfg = cfg.replace(train=cfg.train.replace(steps=8, checkpoint_every=2))
    straight = ListSink()
    Trainer(cfg, tokens_dir, tmp_path / "straight", writer=straight, progress=False).fit()
    _stopped_after_step_5(cfg, tokens_dir, tmp_path / "run", monkeypatch)
    assert ckpt.latest_valid(tmp_path / "run").step == 5  # written in the background, published on the way out
    resumed = ListSink()
    Trainer(cfg, tokens_dir, tmp_path / "run", writer=resumed, progress=False).fit()
    assert resumed.losses() == straight.losses()[5:]


@pytest.mark.gpu
def test_on_a_gpu_a_resumed_run_is_the_straight_run(tokens_dir, tmp_path, monkeypatch):
    """One GPU under the default execution plan (bf16, the Triton experts, AdamW and LM loss,
    compiled where measured faster): two straight runs are bit-identical, and one stopped by
    SIGTERM after step 5 and resumed makes the same losses. Our kernels use no atomics; this
    says whether the rest of the step (torch's kernels) is as deterministic."""
    from optimus_core.train.loop import Trainer
    from sinks import ListSink

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = tiny_cfg()
    cfg = cfg.replace(train=cfg.train.replace(steps=8, checkpoint_every=2, device="cuda"))
    straight = [ListSink(), ListSink()]
    for i, sink in enumerate(straight):
        Trainer(cfg, tokens_dir, tmp_path / f"straight{i}", writer=sink, progress=False).fit()
    assert straight[0].losses() == straight[1].losses()
    _stopped_after_step_5(cfg, tokens_dir, tmp_path / "run", monkeypatch)
    resumed = ListSink()
    Trainer(cfg, tokens_dir, tmp_path / "run", writer=resumed, progress=False).fit()
    assert resumed.losses() == straight[0].losses()[5:]
