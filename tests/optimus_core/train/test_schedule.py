import math

import pytest

from optimus_core.config import ScheduleConfig
from optimus_core.train.schedule import lr_at


def test_cosine_warms_up_then_decays_to_the_floor():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 110, 1.0, cfg) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[10 + 50] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))


def test_wsd_is_stable_then_decays_linearly():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=5, min_lr_ratio=0.0, decay_fraction=0.2)
    lrs = [lr_at(s, 100, 2.0, cfg) for s in range(100)]
    assert lrs[5:80] == [2.0] * 75
    assert lrs[-1] == pytest.approx(0.0)
    assert lrs[90] == pytest.approx(2.0 * (1 - 11 / 20))


def test_constant():
    cfg = ScheduleConfig(kind="constant", warmup_steps=0)
    assert {lr_at(s, 50, 3e-4, cfg) for s in range(50)} == {3e-4}
