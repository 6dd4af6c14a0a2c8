"""bench/kernels.py's Timer.interleaved: every fn warmed up, then timed once per repeat in a
rotating order, its own median returned (host clock on the CPU)."""
import time

import torch

from bench.kernels import Timer


def test_interleaved_times_each_fn_in_turns():
    calls = []

    def sleeper(name, seconds):
        def fn():
            calls.append(name)
            time.sleep(seconds)
        return fn

    timer = Timer(torch.device("cpu"), reps=4, warmup=1)
    ms = timer.interleaved({"short": sleeper("short", 0.001), "long": sleeper("long", 0.02)})
    assert set(ms) == {"short", "long"}
    assert ms["long"] > 15 and ms["short"] < ms["long"] / 3
    assert calls[:2] == ["short", "long"]  # warm-up
    # repeats alternate which fn goes first
    assert calls[2:] == ["short", "long", "long", "short", "short", "long", "long", "short"]


def test_interleaved_nothing_times_nothing():
    """A pass none of the asked backends has (e.g. --dw-configs' float32 dw with torch alone)."""
    assert Timer(torch.device("cpu"), reps=4, warmup=1).interleaved({}) == {}
