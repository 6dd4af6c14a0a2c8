"""Hangs: the per-rank watchdog and the collective timeout turn a stuck rank into a clear error."""
import threading
import time

import pytest
import torch
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from optimus_core.config import (ConfigError, DataConfig, ModelConfig, MoEConfig, ParallelConfig, RunConfig,
                                 ScheduleConfig, TrainConfig)
from optimus_core.parallel import init_distributed, shutdown
from optimus_core.parallel.launch import spawn_local
from optimus_core.train import loop as loop_module
from optimus_core.train.loop import Trainer
from optimus_core.train.watchdog import HANG_EXIT_CODE, Watchdog


def test_silence_past_the_timeout_reports_rank_and_last_step():
    fired = []
    dog = Watchdog(0.3, rank=3, on_timeout=fired.append).start(step=7)
    for step in range(8, 12):  # heartbeats keep it quiet well past the timeout
        time.sleep(0.1)
        dog.beat(step)
    assert fired == []
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert len(fired) == 1
    assert fired[0].startswith("rank 3: no progress for ")
    assert "s after step 11 (last completed step 11)" in fired[0]


def test_zero_timeout_is_off_and_negative_is_refused():
    dog = Watchdog(0, rank=0, on_timeout=lambda m: pytest.fail(m)).start()
    assert not dog.enabled and dog._thread is None
    dog.stop()
    with pytest.raises(ConfigError, match=r"train.watchdog_timeout_s = -1.0: must be >= 0"):
        TrainConfig(watchdog_timeout_s=-1)
    with pytest.raises(ConfigError, match=r"parallel.collective_timeout_s = 0.0: must be > 0"):
        ParallelConfig(collective_timeout_s=0)


def _tiny(watchdog_s: float, collective_s: float) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=4096, d_model=32, n_layers=1, n_heads=4, max_seq_len=32,
                          moe=MoEConfig(n_experts=4, top_k=2, d_expert=16)),
        train=TrainConfig(steps=50, global_batch=4, device="cpu", eval_batches=1, watchdog_timeout_s=watchdog_s),
        data=DataConfig(seq_len=32), schedule=ScheduleConfig(warmup_steps=2),
        parallel=ParallelConfig(ep=2, collective_timeout_s=collective_s))


def _rank_that_sleeps_forever(cfg_json, tokens_dir, run_dir, stuck_after):
    torch.set_num_threads(1)
    cfg = RunConfig.from_json(cfg_json)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts, device="cpu")
    if mesh.rank == 1:
        real, calls = loop_module.train_step, [0]

        def stuck(*args, **kwargs):
            calls[0] += 1
            if calls[0] > stuck_after:
                threading.Event().wait()  # forever: a rank lost in a kernel, I/O, a deadlock
            return real(*args, **kwargs)

        loop_module.train_step = stuck
    try:
        Trainer(cfg, tokens_dir, run_dir, progress=False, mesh=mesh).fit()
    finally:
        shutdown(mesh)


def test_a_rank_that_sleeps_forever_ends_the_run_with_the_watchdog_message(tokens_dir, tmp_path, capfd):
    start = time.monotonic()
    with pytest.raises((ProcessExitedException, ProcessRaisedException)) as failure:
        spawn_local(_rank_that_sleeps_forever, 2, (_tiny(3.0, 600.0).to_json(), tokens_dir, tmp_path / "run", 2),
                    start_method="fork", grace_s=2)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert "rank 1: no progress for " in err and "after step 2 (last completed step 2)" in err, err[-2000:]
    assert elapsed < 30, elapsed
    # the stuck rank exits with the watchdog's status, or the other rank fails first (its peer gone)
    exc = failure.value
    assert isinstance(exc, ProcessRaisedException) or exc.exit_code == HANG_EXIT_CODE


def test_without_a_watchdog_the_collective_timeout_ends_the_wait(tokens_dir, tmp_path, capfd):
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="(?i)timed? ?out"):
        spawn_local(_rank_that_sleeps_forever, 2, (_tiny(0.0, 3.0).to_json(), tokens_dir, tmp_path / "run", 1),
                    start_method="fork", grace_s=2)
    assert time.monotonic() - start < 45
