"""bench/memory_step.py's replay of allocator events: phases, peaks and who made what."""
from bench.memory_step import made_by, replay

OURS = {"filename": "/x/repo/optimus_core/model/moe.py", "line": 7, "name": "forward"}
INDUCTOR_BW = [{"filename": "/tmp/torchinductor_root/ab/cab.py", "line": 3, "name": "call"},
               {"filename": "/x/torch/_functorch/runtime_wrappers.py", "line": 9, "name": "backward"}]
ADAMW = {"filename": "/x/repo/kernels/adamw.py", "line": 5, "name": "adamw_step_"}


def alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def test_made_by_names_our_innermost_frame_else_the_backward():
    assert made_by([OURS, {"filename": "/x/torch/nn/module.py", "line": 1, "name": "_call_impl"}]) \
        == "optimus_core/model/moe.py:7 forward"
    assert made_by(INDUCTOR_BW) == "compiled backward"
    assert made_by([]) == "autograd (no Python frame)"


def test_replay_finds_the_peak_its_phase_and_the_backward_start():
    before = {1000: (40, "parameters"), 2000: (8, "gradients (previous step, held for the update)")}
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 512, "frames": []},  # not an allocation
        free(2000, 8),                  # forward: the held gradients go
        alloc(3000, 30, [OURS]),        # forward: an activation
        alloc(4000, 10, [OURS]),        # forward: another         -> forward peak 40 + 2 + 40 = 82
        alloc(5000, 25, INDUCTOR_BW),   # backward starts: 82 before it
        free(4000, 10),
        alloc(6000, 20, []),            # backward peak: 82 + 25 - 10 + 20 = 117
        free(3000, 30),
        alloc(7000, 5, [ADAMW]),        # update
    ]
    r = replay(events, before, before_other=2)
    assert r["backward_start_bytes"] == 82
    assert r["at_backward_start"] == {"optimus_core/model/moe.py:7 forward": 40, "parameters": 40,
                                      "allocated before the step (other)": 2}
    assert r["peak_bytes"] == 117 and r["peak_phase"] == "backward"
    assert r["at_peak"]["compiled backward"] == 25 and r["at_peak"]["autograd (no Python frame)"] == 20
    assert r["at_peak"]["optimus_core/model/moe.py:7 forward"] == 30
    assert r["phases"]["forward"]["bytes"] == 82 and r["phases"]["update"]["bytes"] == 117 - 30 + 5
    assert r["events"] == 8


def test_replay_without_a_backward_is_all_forward():
    r = replay([alloc(1, 4, [OURS]), free(1, 4)], {}, before_other=10)
    assert r["peak_bytes"] == 14 and r["peak_phase"] == "forward" and r["backward_start_bytes"] == 10
