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


def _wait_for(fired, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not fired and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_save_or_evaluation_is_a_phase_with_its_own_limit():
    fired = []
    dog = Watchdog(0.2, rank=1, on_timeout=fired.append).start(step=4)
    with dog.phase("checkpoint save of step 4", timeout_s=1.0):
        time.sleep(0.5)  # past the step timeout, within the phase's
    assert fired == []
    with dog.phase("evaluation", timeout_s=0.3):
        _wait_for(fired)  # a stalled phase still trips, naming itself and its knob
    dog.stop()
    assert len(fired) == 1 and "rank 1: no progress for" in fired[0]
    assert "in the evaluation after step 4" in fired[0] and "train.watchdog_io_timeout_s = 0.3 s" in fired[0]
    after = []
    dog = Watchdog(0.2, on_timeout=after.append).start(step=1)
    with dog.phase("checkpoint load of step 1", timeout_s=5.0):
        pass
    _wait_for(after)  # outside a phase the step timeout is back
    dog.stop()
    assert after and "train.watchdog_timeout_s = 0.2 s" in after[0]


def test_a_checkpoint_slower_than_the_step_timeout_is_not_a_hang(tokens_dir, tmp_path, monkeypatch):
    from optimus_core import presets
    from optimus_core.train import checkpoint as ckpt
    from optimus_core.train import loop as loop_module

    fired = []
    monkeypatch.setattr(loop_module, "Watchdog", lambda timeout_s, rank=0: Watchdog(timeout_s, rank, on_timeout=fired.append))
    real_save = ckpt.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(5.0)  # two and a half step timeouts
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", slow_save)
    cfg = presets.get("mula-1b@laptop").run_config(**{
        "train.steps": 2, "train.eval_batches": 1, "train.device": "cpu",
        "model.n_layers": 1, "train.watchdog_timeout_s": 2.0, "train.watchdog_io_timeout_s": 30})
    from optimus_core.train.loop import Trainer

    assert Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit().steps == 2
    assert fired == [], fired  # the final save took 5 s under a 2 s step timeout: its own phase
