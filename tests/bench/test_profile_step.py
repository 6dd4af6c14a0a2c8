"""bench/profile_step.py's sources table, on a fake profile (the real one needs a CUDA device):
kernels attributed to the op that launched them, its callers and the project's frames, ms per
step, GEMMs and attention left out."""
from types import SimpleNamespace as Event

from torch.autograd.profiler_util import Kernel

from bench.profile_step import kernel_sources


def test_sources_name_the_launching_op_its_callers_and_frames():
    backward = Event(name="autograd::engine::evaluate_function: AddBackward0", cpu_parent=None)
    add = Event(name="aten::add", cpu_parent=backward, stack=["optimus_core/model/moe.py(71): forward", "torch/x.py(1): f"],
                kernels=[Kernel("elementwise_add", 0, 3000.0)])
    same_launcher = Event(name="aten::add", cpu_parent=backward, stack=["optimus_core/model/moe.py(71): forward"],
                          kernels=[Kernel("elementwise_add", 0, 1000.0)])
    add_elsewhere = Event(name="aten::add", cpu_parent=None, stack=["kernels/optimus_kernels/permute.py(9): unpermute"],
                          kernels=[Kernel("elementwise_add", 0, 600.0)])
    gather = Event(name="aten::index_select", cpu_parent=None, stack=[], kernels=[Kernel("gather", 0, 500.0)])
    gemm = Event(name="aten::mm", cpu_parent=None, stack=[], kernels=[Kernel("nvjet_sm90_gemm", 0, 9000.0)])
    prof = Event(events=lambda: [add, same_launcher, add_elsewhere, gather, gemm, Event(name="python", kernels=[])])
    kernels = {"elementwise_add": 2.0, "gather": 0.25, "nvjet_sm90_gemm": 4.5}  # ms per step
    rows = kernel_sources(prof, kernels, n=5, steps=2)
    assert [r["kernel"] for r in rows] == ["elementwise_add", "elementwise_add", "gather"]  # no GEMM
    first = rows[0]
    assert first["op"] == "aten::add" and first["callers"] == [backward.name]
    assert first["frames"] == ["optimus_core/model/moe.py(71): forward"]
    assert first["ms"] == 2.0  # (3 + 1) ms over 2 steps: one launcher, however many launches
    assert rows[1]["op"] == "aten::add" and rows[1]["callers"] == [] and rows[1]["ms"] == 0.3
    assert rows[2]["ms"] == 0.25
    assert kernel_sources(prof, kernels, n=1, steps=2)[-1]["kernel"] == "elementwise_add"  # the top one only
