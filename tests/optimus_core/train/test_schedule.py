import math

import pytest

from optimus_core.config import ScheduleConfig
from optimus_core.train.schedule import lr_at


def test_cosine_warms_up_then_decays_to_the_floor():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 109, 1.0, cfg) for s in range(110)]  # a 110-step run: the floor at its last step
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[10 + 50] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))


def test_wsd_is_stable_then_decays_linearly():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=5, min_lr_ratio=0.0, decay_fraction=0.2)
    lrs = [lr_at(s, 99, 2.0, cfg) for s in range(100)]
    assert lrs[5:80] == [2.0] * 75
    assert lrs[-1] == pytest.approx(0.0)
    assert lrs[90] == pytest.approx(2.0 * (1 - 11 / 20))


def test_constant():
    cfg = ScheduleConfig(kind="constant", warmup_steps=0)
    assert {lr_at(s, 49, 3e-4, cfg) for s in range(50)} == {3e-4}


def test_the_papers_schedule():
    """The authors' get_learning_rate: linear from the floor at step 0 to the peak at the warmup's
    end (no +1), then cosine (s - W) / (T - W) to the floor at T, one epoch of steps; the run's last
    step T - 1 a hair above the floor; past T the floor."""
    from optimus_core.train.schedule import decay_end

    cfg = ScheduleConfig(kind="cosine", warmup_steps=2500, min_lr_ratio=0.1, warmup_from="min_lr",
                         decay_horizon="epoch")
    T = decay_end(cfg, run_steps=15895, epoch_steps=635783)  # a 100B-token run on the 4T horizon
    assert T == 635783
    lr = lambda s: lr_at(s, T, 4e-4, cfg)  # noqa: E731
    assert lr(0) == pytest.approx(4e-5) and lr(1250) == pytest.approx(2.2e-4)
    assert lr(2499) == pytest.approx(4e-5 + 3.6e-4 * 2499 / 2500) and lr(2500) == pytest.approx(4e-4)
    mid = 2500 + (T - 2500) // 2
    assert lr(mid) == pytest.approx(4e-5 + 3.6e-4 * 0.5 * (1 + math.cos(math.pi * (mid - 2500) / (T - 2500))))
    assert 4e-5 < lr(T - 1) < 4e-5 * 1.0001 and lr(T) == pytest.approx(4e-5) and lr(T + 10) == pytest.approx(4e-5)
    assert lr(15894) > 3.9e-4  # the 100B-token runs stop early on the 4T horizon, near the peak
    assert decay_end(cfg.replace(decay_horizon=3000), 100) == 3000
    assert decay_end(cfg.replace(decay_horizon="run"), 100) == 99


def test_a_horizon_within_the_warmup_is_refused():
    from optimus_core.config import ConfigError
    from optimus_core.train.schedule import decay_end

    with pytest.raises(ConfigError, match=r"schedule.decay_horizon = 2000: must be 'run', 'epoch' or a number of "
                                          r"steps above warmup_steps \(2500\)"):
        ScheduleConfig(warmup_steps=2500, decay_horizon=2000)
    cfg = ScheduleConfig(warmup_steps=2500, decay_horizon="epoch")
    with pytest.raises(ConfigError, match=r"decay_horizon = 'epoch': one epoch of the data is 387 steps, which end "
                                          r"within the warmup \(schedule.warmup_steps = 2500\)"):
        decay_end(cfg, run_steps=100, epoch_steps=387)
    assert decay_end(ScheduleConfig(warmup_steps=20), run_steps=10) == 9  # a short run within its warmup is fine


def test_clipping_from_the_end_of_the_warmup():
    from optimus_core.config import OptimConfig, RunConfig
    from optimus_core.train.step import clip_at

    cfg = RunConfig(optim=OptimConfig(grad_clip=1.0, clip_after_warmup=True), schedule=ScheduleConfig(warmup_steps=5))
    assert [clip_at(s, cfg) for s in range(7)] == [None] * 5 + [1.0, 1.0]
    always = cfg.replace(optim=OptimConfig(grad_clip=1.0))
    assert {clip_at(s, always) for s in range(7)} == {1.0}
