"""bench/trace_gaps.py on a hand-made timeline: busy time, idle gaps and what they are charged to."""
import gzip
import json

from bench.trace_gaps import analyze, load, main


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def _timeline():
    # One step: kernel A [100, 200); the host waits in cudaStreamSynchronize until 210, then its
    # op "aten::item"... launches kernel B late (correlation 2) at 300; kernel C (an NCCL kernel
    # on another stream) overlaps B; kernel D is launched by "optimus::permute" while the device
    # is idle, with no wait: host overhead.
    return [
        _x("optimus.step", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 10, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 15, 5, correlation=1),
        _x("cudaStreamSynchronize", "cuda_runtime", 40, 170),
        _x("aten::add", "cpu_op", 280, 40),
        _x("cudaLaunchKernel", "cuda_runtime", 290, 5, correlation=2),
        _x("optimus::permute", "cpu_op", 500, 100),
        _x("aten::index", "cpu_op", 540, 30),  # nested inside permute: the innermost op
        _x("cudaLaunchKernel", "cuda_runtime", 550, 5, correlation=4),
        _x("A", "kernel", 100, 100, tid=7, correlation=1),
        _x("B", "kernel", 300, 100, tid=7, correlation=2),
        _x("ncclDevKernel_Reduce", "kernel", 350, 100, tid=8, correlation=3),
        _x("D", "kernel", 560, 40, tid=7, correlation=4),
    ]


def test_busy_idle_and_causes():
    result = analyze(_timeline(), min_gap_us=20)
    (step,) = result["steps"]
    assert step["window_us"] == 500  # 100 .. 600
    assert step["busy_us"] == 100 + 150 + 40  # A, B with the overlapping collective, D
    assert step["busy_no_collectives_us"] == 240
    assert step["idle_us"] == 210
    gaps = {(g["cause"], g["op"]): g["us"] for g in result["gaps"]}
    assert gaps == {("after cudaStreamSynchronize", "aten::add"): 100,
                    ("host launch late", "aten::index"): 110}


def test_small_gaps_are_ignored_and_the_cli_reads_gzip(tmp_path, capsys):
    assert analyze(_timeline(), min_gap_us=200)["gaps"] == []
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _timeline()}, f)
    assert len(load(path)) == len(_timeline())
    main([str(path)])
    out = capsys.readouterr().out
    assert "host launch late -> aten::index" in out and "0.21" in out


def test_a_device_to_host_copy_is_a_wait_an_async_device_copy_is_not():
    events = [
        _x("optimus.step", "user_annotation", 0, 1000),
        _x("cudaMemcpyAsync", "cuda_runtime", 20, 5, correlation=9),  # device -> device: no wait
        _x("cudaLaunchKernel", "cuda_runtime", 30, 5, correlation=1),
        _x("cudaMemcpyAsync", "cuda_runtime", 210, 90, correlation=5),  # device -> host: waits
        _x("cudaLaunchKernel", "cuda_runtime", 320, 5, correlation=2),
        _x("cudaMemcpyAsync", "cuda_runtime", 430, 5, correlation=8),  # device -> device, late
        _x("A", "kernel", 100, 100, tid=7, correlation=1),
        _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 95, 4, tid=7, correlation=9),
        _x("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 205, 3, tid=7, correlation=5),
        _x("B", "kernel", 340, 60, tid=7, correlation=2),
        _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 500, 4, tid=7, correlation=8),
    ]
    gaps = {g["cause"]: g["us"] for g in analyze(events, min_gap_us=20)["gaps"]}
    assert gaps == {"after cudaMemcpyAsync": 132, "host launch late": 100}


def test_compare_charges_device_time_to_the_launching_op(tmp_path, capsys):
    from bench.trace_gaps import compare

    before = _timeline()
    # After: kernel D takes 40 us longer, and a new kernel E from "aten::mul_" appears.
    after = [dict(e, dur=80) if e["name"] == "D" else e for e in _timeline()] + [
        _x("aten::mul_", "cpu_op", 700, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 705, 5, correlation=5),
        _x("E", "kernel", 710, 30, tid=7, correlation=5)]
    rows = {(r["op"], r["kernel"]): r for r in compare(before, after)}
    assert rows[("aten::mul_", "E")]["delta_us"] == 30 and rows[("aten::mul_", "E")]["before_n"] == 0
    assert rows[("aten::index", "D")]["delta_us"] == 40  # the innermost op around D's launch
    assert rows[("aten::mm", "A")]["delta_us"] == 0 and rows[("aten::mm", "A")]["after_n"] == 1
    assert [r["kernel"] for r in compare(before, after)][:2] == ["D", "E"]  # largest growth first
    paths = []
    for name, events in (("a", before), ("b", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(events))
    main([str(p) for p in paths] + ["--compare"])
    out = capsys.readouterr().out
    assert "0.34 ms -> 0.41 ms (+0.07)" in out and "aten::mul_ -> E" in out


def test_skip_leaves_the_first_steps_out_of_the_causes():
    later = [dict(e, ts=e["ts"] + 2000) for e in _timeline()]  # the same step again, 2000 us later
    for e in later:
        if "correlation" in e.get("args", {}):
            e["args"] = {"correlation": e["args"]["correlation"] + 100}
    both = _timeline() + later
    all_steps, second = analyze(both, min_gap_us=20), analyze(both, min_gap_us=20, skip=1)
    assert len(all_steps["steps"]) == len(second["steps"]) == 2  # the table keeps every step
    assert sum(all_steps["causes"].values()) == 2 * sum(second["causes"].values()) == 2 * 210
    assert {g["step"] for g in second["gaps"]} == {1}


def test_ops_lists_the_last_steps_device_time_by_launching_op(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_timeline()))
    main([str(path), "--ops"])
    out = capsys.readouterr().out
    assert "last step's device time 0.34 ms" in out
    lines = [line for line in out.splitlines() if "->" in line]
    assert "aten::add -> B" in lines[0] or "aten::mm -> A" in lines[0]  # 0.10 ms each, the largest
    assert any("aten::index -> D" in line and "0.04" in line for line in lines)


def test_streams_split_side_work_beside_the_main_stream_and_alone():
    """Main stream 7: [0, 100) and [300, 400); side stream 9 (the update): [50, 250), of which
    [50, 100) ran beside the main stream's work and [100, 250) alone; [250, 300) idle."""
    from bench.trace_gaps import streams

    events = [_x("optimus.step", "user_annotation", 0, 1000),
              _x("gemm", "kernel", 0, 100, tid=7), _x("gemm", "kernel", 300, 100, tid=7),
              _x("_adamw_kernel", "kernel", 50, 120, tid=9), _x("_adamw_kernel", "kernel", 170, 80, tid=9),
              _x("norm", "gpu_memset", 60, 10, tid=9)]
    (s,) = streams(events)
    assert s["main_stream"] == 7 and s["window_us"] == 400
    assert (s["main_us"], s["side_us"], s["beside_us"], s["side_alone_us"], s["idle_us"]) == (200, 200, 50, 150, 50)
    assert s["side_kernels_us"] == {"_adamw_kernel": 200, "norm": 10}


def test_streams_cli(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _timeline()}))
    main([str(path), "--streams"])
    out = capsys.readouterr().out
    # stream 7 (A, B, D: 240 us) is the main one; the NCCL kernel on 8 ran 50 us beside B, 50 alone
    assert "0.24" in out and "ncclDevKernel_Reduce 0.10" in out
