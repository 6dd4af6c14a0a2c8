#!/usr/bin/env python3
"""Where the device waits in a training step, and on what: read a torch.profiler timeline.

    python bench/trace_gaps.py TRACE.json[.gz] [--min-gap-us 20] [--top 25] [--skip 1]

A trace comes from ``bench/profile_step.py --trace DIR`` (one GPU) or ``bench/distributed.py
--trace DIR`` (every rank of a multi-process point; optimus_core/train/measure.py writes it). For
each ``optimus.step`` range the device's busy time is the union of its kernels, copies and
fills on all streams (and apart, without the collectives' kernels); the rest of the step's
device window is idle. Each idle gap is charged to the kernel that ends it: to the host op that
launched that kernel (the innermost ``cpu_op`` around the launch call) and to the last call that
made the host wait for the device before it (a stream / event / device synchronize, or a
copy whose device side is device-to-host), if any happened since the gap began: a gap that starts while the host sits
in such a wait is the sync's; one whose ending kernel was launched late, with no wait, is host
overhead. Output: a per-step table and the gaps summed by cause, largest first.

    python bench/trace_gaps.py BEFORE.json.gz AFTER.json.gz --compare [--top 25]
    python bench/trace_gaps.py TRACE.json.gz --ops [--top 25]
    python bench/trace_gaps.py TRACE.json.gz --streams

``--ops``: the last step's device time per (host op that launched it, kernel), largest first.
``--streams``: per step, the main stream's busy time and the side streams' (the update beside the
forward, on one GPU), split into what ran beside the main stream's work and what ran alone,
while the main stream had nothing to run (a forward waiting for its block's update shows there).
``--compare``: device time of the last step of each trace per (host op that launched it, kernel),
and AFTER - BEFORE, largest growth first: which work one setup adds to the other (weak-2 against
weak-1, say).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
WAIT_CALL = re.compile(r"Synchronize|urEventWait")  # calls that block the host until the device is done
COPY_CALL = re.compile(r"Memcpy")  # block only when the copy goes device -> host (seen on its device event)


def load(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union_length(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total covered length and the merged intervals, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(e - s for s, e in merged), [(s, e) for s, e in merged]


def _runtime_calls(events: list[dict]) -> tuple[list[dict], dict]:
    """The host's runtime / driver calls, and the call of each correlation id (its launch)."""
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "xpu_runtime")]
    return runtime, {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}


def _ops_by_thread(events: list[dict]) -> dict:
    ops_by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_thread[e["tid"]].append(e)
    for ops in ops_by_thread.values():
        ops.sort(key=lambda e: e["ts"])
    return ops_by_thread


def _innermost_op(ops_by_thread: dict, launch: dict) -> str:
    """The host op around a launch call: the latest-starting one that encloses it."""
    best = None
    for op in ops_by_thread.get(launch["tid"], []):
        if op["ts"] > launch["ts"]:
            break
        if op["ts"] + op["dur"] >= launch["ts"] + launch["dur"]:
            best = op  # later-starting enclosing ops are nested deeper
    return best["name"] if best else "?"


def _steps(events: list[dict]) -> list[dict]:
    steps = sorted((e for e in events if e.get("name") == "optimus.step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:  # a trace without our annotation: the whole timeline as one step
        steps = [{"ts": min(e["ts"] for e in events), "dur": max(e["ts"] + e["dur"] for e in events)}]
        steps[0]["dur"] -= steps[0]["ts"]
    return steps


def _device_events_by_step(events: list[dict]) -> list[tuple[int, list[dict]]]:
    """(step index, its device work sorted by start) for each step with any: a step's work starts
    at or after its annotation and before the next step's."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    starts = [s["ts"] for s in _steps(events)] + [float("inf")]
    out = []
    for i in range(len(starts) - 1):
        mine = [e for e in device if starts[i] <= e["ts"] < starts[i + 1]]
        if mine:
            out.append((i, mine))
    return out


def device_time_by_op(events: list[dict]) -> dict[tuple[str, str], tuple[float, int]]:
    """{(launching host op, kernel name): (µs, count)} over the device work of the last step
    (from its annotation's start to the end of the timeline)."""
    start = _steps(events)[-1]["ts"]
    _, launches = _runtime_calls(events)
    ops_by_thread = _ops_by_thread(events)
    out: dict = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in DEVICE_CATS and e["ts"] >= start:
            launch = launches.get(e.get("args", {}).get("correlation"))
            key = (_innermost_op(ops_by_thread, launch) if launch else "?", e["name"])
            out[key][0] += e["dur"]
            out[key][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def compare(before: list[dict], after: list[dict]) -> list[dict]:
    """Rows (op, kernel, before µs / count, after µs / count, delta µs), largest growth first."""
    a, b = device_time_by_op(before), device_time_by_op(after)
    rows = [{"op": op, "kernel": kernel, "before_us": a.get((op, kernel), (0.0, 0))[0],
             "before_n": a.get((op, kernel), (0.0, 0))[1], "after_us": b.get((op, kernel), (0.0, 0))[0],
             "after_n": b.get((op, kernel), (0.0, 0))[1]} for op, kernel in set(a) | set(b)]
    for r in rows:
        r["delta_us"] = r["after_us"] - r["before_us"]
    return sorted(rows, key=lambda r: -r["delta_us"])


def analyze(events: list[dict], min_gap_us: float = 20.0, skip: int = 0) -> dict:
    """Per step: device window, busy (all / without collectives), idle; gaps by cause (µs).
    ``skip``: the first steps are left out of the causes and the gaps (a warm-up, a one-time
    autotuning), not of the per-step table."""
    runtime, launches = _runtime_calls(events)
    to_host = {e["args"].get("correlation") for e in events
               if e.get("cat") == "gpu_memcpy" and re.search(r"DtoH|Device -> Host", e["name"])}
    waits = sorted((e for e in runtime if WAIT_CALL.search(e["name"])
                    or (COPY_CALL.search(e["name"]) and e.get("args", {}).get("correlation") in to_host)),
                   key=lambda e: e["ts"])
    wait_ends = [w["ts"] + w["dur"] for w in waits]
    ops_by_thread = _ops_by_thread(events)

    def innermost_op(launch: dict) -> str:
        return _innermost_op(ops_by_thread, launch)

    out = {"steps": [], "causes": defaultdict(float), "gaps": []}
    for i, mine in _device_events_by_step(events):
        begin, end = mine[0]["ts"], max(e["ts"] + e["dur"] for e in mine)
        busy, merged = union_length([(e["ts"], e["ts"] + e["dur"]) for e in mine])
        busy_compute, _ = union_length([(e["ts"], e["ts"] + e["dur"]) for e in mine
                                        if "nccl" not in e["name"].lower()])
        by_start = sorted(mine, key=lambda e: e["ts"])
        kernel_starts = [e["ts"] for e in by_start]
        for (_, gap_start), (gap_end, _) in zip(merged, merged[1:]):
            gap = gap_end - gap_start
            if gap < min_gap_us:
                continue
            nxt = by_start[bisect.bisect_left(kernel_starts, gap_end)]
            launch = launches.get(nxt.get("args", {}).get("correlation"))
            op = innermost_op(launch) if launch else "?"
            # the last host wait that ended inside the gap: the host was held until then
            j = bisect.bisect_right(wait_ends, gap_end) - 1
            wait = waits[j] if j >= 0 and wait_ends[j] >= gap_start else None
            cause = f"after {wait['name']}" if wait else "host launch late"
            key = f"{cause} -> {op}"
            if i < skip:
                continue
            out["causes"][key] += gap
            out["gaps"].append({"step": i, "us": gap, "cause": cause, "op": op, "next_kernel": nxt["name"][:80]})
        out["steps"].append({"step": i, "window_us": end - begin, "busy_us": busy,
                             "busy_no_collectives_us": busy_compute, "idle_us": end - begin - busy})
    out["causes"] = dict(sorted(out["causes"].items(), key=lambda kv: -kv[1]))
    out["gaps"].sort(key=lambda g: -g["us"])
    return out


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the overlap of two sorted, merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def streams(events: list[dict]) -> list[dict]:
    """Per step, the device's streams against its main one (the stream with the most busy time):
    ``main_us`` its busy time, ``side_us`` the other streams' (their union), ``beside_us`` the
    side work that ran while the main stream was busy, ``side_alone_us`` the side work that ran
    while the main stream had nothing (the main stream waiting on it, e.g. a forward waiting for
    its block's update beside it, or simply idle), ``idle_us`` neither; and the side streams'
    five largest kernels (µs). The steps are taken as ``analyze`` takes them."""
    out = []
    for i, mine in _device_events_by_step(events):
        by_stream: dict = defaultdict(list)
        for e in mine:
            by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
        busy = {sid: union_length([(e["ts"], e["ts"] + e["dur"]) for e in es]) for sid, es in by_stream.items()}
        main_id = max(busy, key=lambda sid: busy[sid][0])
        side = [e for sid, es in by_stream.items() if sid != main_id for e in es]
        main_us, main_merged = busy[main_id]
        side_us, side_merged = union_length([(e["ts"], e["ts"] + e["dur"]) for e in side])
        beside = _intersection_length(main_merged, side_merged)
        begin, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        kernels: dict = defaultdict(float)
        for e in side:
            kernels[e["name"]] += e["dur"]
        out.append({"step": i, "main_stream": main_id, "window_us": end - begin, "main_us": main_us,
                    "side_us": side_us, "beside_us": beside, "side_alone_us": side_us - beside,
                    "idle_us": end - begin - (main_us + side_us - beside),
                    "side_kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:5])})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--skip", type=int, default=0,
                   help="leave the first N steps out of the causes and gaps (warm-up, autotuning)")
    p.add_argument("--compare", action="store_true", help="two traces: the second's device time per op minus the first's")
    p.add_argument("--ops", action="store_true", help="the last step's device time per launching op and kernel")
    p.add_argument("--streams", action="store_true",
                   help="per step: the main stream's busy time, the side streams' beside it and alone")
    args = p.parse_args(argv)
    if args.streams:
        for path in args.traces:
            print(f"== {path}")
            print(f"{'step':>4} {'window ms':>10} {'main ms':>8} {'side ms':>8} {'beside':>8} {'alone':>8} {'idle':>8}")
            for s in streams(load(path)):
                print(f"{s['step']:>4} {s['window_us'] / 1e3:10.2f} {s['main_us'] / 1e3:8.2f} {s['side_us'] / 1e3:8.2f} "
                      f"{s['beside_us'] / 1e3:8.2f} {s['side_alone_us'] / 1e3:8.2f} {s['idle_us'] / 1e3:8.2f}  "
                      + ", ".join(f"{name[:40]} {us / 1e3:.2f}" for name, us in s["side_kernels_us"].items()))
        return
    if args.ops:
        for path in args.traces:
            rows = sorted(device_time_by_op(load(path)).items(), key=lambda kv: -kv[1][0])
            print(f"== {path}: last step's device time {sum(us for us, _ in dict(rows).values()) / 1e3:.2f} ms")
            for (op, kernel), (us, n) in rows[:args.top]:
                print(f"{us / 1e3:9.2f} {n:5d}  {op[:45]} -> {kernel[:80]}")
        return
    if args.compare:
        if len(args.traces) != 2:
            p.error("--compare takes two traces: BEFORE AFTER")
        rows = compare(load(args.traces[0]), load(args.traces[1]))
        total = [sum(r[k] for r in rows) / 1e3 for k in ("before_us", "after_us")]
        print(f"last step's device time: {total[0]:.2f} ms -> {total[1]:.2f} ms ({total[1] - total[0]:+.2f})")
        print(f"{'before ms':>9} {'n':>4} {'after ms':>9} {'n':>4} {'delta':>7}  host op -> kernel")
        shown = rows[:args.top] + [r for r in rows[-min(args.top, 8):] if r not in rows[:args.top]]
        for r in shown:
            print(f"{r['before_us'] / 1e3:9.2f} {r['before_n']:4d} {r['after_us'] / 1e3:9.2f} {r['after_n']:4d} "
                  f"{r['delta_us'] / 1e3:+7.2f}  {r['op'][:45]} -> {r['kernel'][:70]}")
        return
    for path in args.traces:
        result = analyze(load(path), args.min_gap_us, args.skip)
        n = max(1, len(result["steps"]) - args.skip)
        print(f"== {path}")
        print(f"{'step':>4} {'window ms':>10} {'busy ms':>9} {'no-coll ms':>10} {'idle ms':>8}")
        for s in result["steps"]:
            print(f"{s['step']:>4} {s['window_us'] / 1e3:10.2f} {s['busy_us'] / 1e3:9.2f} "
                  f"{s['busy_no_collectives_us'] / 1e3:10.2f} {s['idle_us'] / 1e3:8.2f}")
        print(f"idle gaps >= {args.min_gap_us:g} us by cause (ms per step{f', first {args.skip} left out' if args.skip else ''}):")
        for key, us in list(result["causes"].items())[:args.top]:
            print(f"  {us / 1e3 / n:8.2f}  {key[:150]}")
        print("largest gaps:")
        for g in result["gaps"][:args.top]:
            print(f"  {g['us'] / 1e3:7.2f} ms  step {g['step']}  {g['cause']} -> {g['op'][:60]}  next: {g['next_kernel']}")


if __name__ == "__main__":
    main()
