"""PhaseTimer: exclusive time per phase, nesting, the no-op when inactive (a fake clock)."""
import pytest

from optimus_core import timing
from optimus_core.timing import PhaseTimer, phase


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def advance(seconds):
        now[0] += seconds
    return advance


def test_nested_phases_are_exclusive(clock):
    timer = PhaseTimer("cpu")
    with timer.active():
        with phase("compute"):
            clock(1.0)
            with phase("a2a"):
                clock(0.25)
            clock(0.5)
            with phase("a2a"):
                clock(0.25)
        with phase("optimizer"):
            clock(2.0)
    assert timer.totals() == {"compute": 1.5, "a2a": 0.5, "optimizer": 2.0}


def test_reset_starts_a_new_measurement(clock):
    timer = PhaseTimer("cpu")
    with timer.active():
        with phase("compute"):
            clock(1.0)
        timer.reset()
        with phase("compute"):
            clock(3.0)
    assert timer.totals() == {"compute": 3.0}


def test_phase_is_a_noop_without_an_active_timer(clock):
    timer = PhaseTimer("cpu")
    with phase("compute"):
        clock(1.0)
    assert timer.totals() == {}
    with timer.active():
        pass
    with phase("compute"):  # the timer is no longer active once its block ends
        clock(1.0)
    assert timer.totals() == {}


def test_totals_refuses_an_open_phase(clock):
    timer = PhaseTimer("cpu")
    with timer.active(), phase("compute"):
        with pytest.raises(RuntimeError, match="'compute' is still open"):
            timer.totals()
