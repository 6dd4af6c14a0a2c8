#!/usr/bin/env python3
"""Where a training step's peak memory lies, and what is allocated then (not a test).

    python bench/memory_step.py [--variant 7b8l-triton+compile] [--warmup 3] [--top 20]

The same step as bench/train_step.py (its VARIANTS), warmed up, then one step recorded by the
CUDA caching allocator (``torch.cuda.memory._record_memory_history``, Python stacks). The
recorded allocations and frees are replayed from what was allocated when the recording began:

- phases: ``forward`` (also what the previous step's update beside it allocates), ``backward``
  (from the first allocation made under a backward to the last), ``update`` (after it);
- for each phase, the most allocated and when; ``backward_start``: what was allocated just before
  the backward's first allocation (the forward's saved activations at their most);
- at the step's peak and at the backward's start: the allocated bytes by what made them. What
  existed before the recording is named from the model and optimizer (parameters, AdamW moments,
  weight copies, gradients the update still reads); what was made during it, by its innermost
  frame in this repository, or ``compiled backward`` / ``autograd`` where no frame of ours is.

The allocated figure is ``torch.cuda.max_memory_allocated``'s (blocks as the allocator rounds
them); the replayed peak is printed beside it, with a warning where they differ by more than
16 MiB (they agreed within 1 MB on an H200: the record missed nothing). Output: a table, and one JSON line per run
appended to bench/results/memory-<device>.jsonl.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

from bench.common import device_slug, read_jsonl, write_jsonl  # noqa: E402

GIB = 2 ** 30
OURS = ("optimus_core/", "kernels/", "bench/")


def _ours(filename: str) -> str | None:
    """The repository-relative path of ``filename``, where it is one of ours."""
    for prefix in OURS:
        at = filename.rfind("/" + prefix)
        if at >= 0:
            return filename[at + 1:]
    return None


def is_backward(frames: list[dict]) -> bool:
    """Made under a backward: by autograd's engine (no Python frame at all) or a backward function."""
    return not frames or any("backward" in f.get("name", "") for f in frames)


def made_by(frames: list[dict]) -> str:
    """What made an allocation: its innermost frame in this repository ("path:line function"),
    else ``compiled backward``, ``autograd`` (no Python frame) or the innermost frame there is."""
    for f in frames:  # innermost first
        path = _ours(f.get("filename", ""))
        if path:
            return f"{path}:{f.get('line', 0)} {f.get('name', '')}"
    if not frames:
        return "autograd (no Python frame)"
    if any("torchinductor" in f.get("filename", "") for f in frames) and is_backward(frames):
        return "compiled backward"
    f = frames[0]
    return f"{Path(f.get('filename', '?')).name}:{f.get('line', 0)} {f.get('name', '')}"


def replay(events: list[dict], before: dict[int, tuple[int, str]], before_other: int) -> dict:
    """Replay one recorded step's allocator events.

    ``before``: {address: (bytes, what)} of blocks allocated when the recording began that are
    known by name; ``before_other``: the rest of what was allocated then, in bytes. Returns the
    phases' peaks, the backward's start and the allocated bytes by maker at the step's peak and
    at the backward's start.
    """
    live: dict[int, tuple[int, str]] = dict(before)
    by_what: Counter = Counter()
    for size, what in before.values():
        by_what[what] += size
    by_what["allocated before the step (other)"] += before_other
    total = sum(by_what.values())
    kinds = [e for e in events if e.get("action") in ("alloc", "free_requested")]
    marks = [i for i, e in enumerate(kinds) if e["action"] == "alloc" and is_backward(e.get("frames", []))]
    first_bw, last_bw = (marks[0], marks[-1]) if marks else (len(kinds), len(kinds) - 1)

    def phase(i: int) -> str:
        return "forward" if i < first_bw else "backward" if i <= last_bw else "update"

    peaks = {name: {"bytes": 0, "at_event": None} for name in ("forward", "backward", "update")}
    peak, peak_state, start_state = total, Counter(by_what), None
    for i, e in enumerate(kinds):
        if i == first_bw:
            start_state = (total, Counter(by_what))
        addr, size = e["addr"], e["size"]
        if e["action"] == "alloc":
            what = made_by(e.get("frames", []))
            live[addr] = (size, what)
            by_what[what] += size
            total += size
        else:  # the event's size: the allocator's block, as memory_allocated counts it
            _, what = live.pop(addr, (size, "allocated before the step (other)"))
            by_what[what] -= size
            total -= size
        p = peaks[phase(i)]
        if total > p["bytes"]:
            p.update(bytes=total, at_event=i)
        if total > peak:
            peak, peak_state = total, Counter(by_what)
    for p in peaks.values():  # as a fraction of the step's allocator events: where in it
        p["at"] = None if p["at_event"] is None else round(p["at_event"] / max(1, len(kinds)), 3)
    start_total, start_by = start_state if start_state else (total, Counter(by_what))
    return {"peak_bytes": peak, "peak_phase": max(peaks, key=lambda k: peaks[k]["bytes"]),
            "phases": peaks, "backward_start_bytes": start_total,
            "at_peak": _positive(peak_state), "at_backward_start": _positive(start_by), "events": len(kinds)}


def _positive(counts: Counter) -> dict[str, int]:
    return {k: v for k, v in counts.most_common() if v > 0}


def known_blocks(model, optimizer) -> dict[int, tuple[int, str]]:
    """{address: (bytes, name)} of what the model and optimizer hold between steps."""
    import torch

    def nbytes(t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    named: dict[int, tuple[int, str]] = {}

    def add(t, what: str) -> None:
        if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().data_ptr() not in named:
            named[t.untyped_storage().data_ptr()] = (nbytes(t), what)

    for name, p in model.named_parameters():
        add(p, "parameters (float32, experts)" if ".experts." in name else "parameters (float32, dense)")
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            add(state.get(key), "AdamW moments")
    for copy in getattr(optimizer, "casts", {}).values():
        add(copy, "expert weight copies (bf16)")
    updates = getattr(optimizer, "beside_forward", None)
    for held in (getattr(updates, "_held", None) or {}).values():
        for t in held:
            add(t, "gradients (previous step, held for the update)")
    for p in model.parameters():
        if p.grad is not None:
            add(p.grad, "gradients")
    return named


def record_step(step, before: dict[int, tuple[int, str]]) -> tuple[dict, int]:
    """(replay's result, torch.cuda.max_memory_allocated) of one call of ``step()`` recorded by
    the CUDA caching allocator; ``before``: known_blocks of what the step starts from."""
    import torch

    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    events = snapshot["device_traces"][torch.cuda.current_device()]
    return replay(events, before, base - sum(size for size, _ in before.values())), measured


def main(argv=None) -> None:
    from bench.profile_step import variant_arguments, warmed_up_step

    p = variant_arguments(__doc__.split("\n")[0])
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)

    import torch

    model, optimizer, step = warmed_up_step(args, "bench/memory_step.py")
    device = torch.device("cuda")
    result, measured = record_step(step, known_blocks(model, optimizer))

    if abs(result["peak_bytes"] - measured) > 16 * 2 ** 20:
        print(f"warning: the replayed peak ({result['peak_bytes'] / GIB:.2f} GiB) is not the allocator's "
              f"({measured / GIB:.2f} GiB): the record missed allocations, the breakdown is partial")
    print(f"{args.variant}: peak {result['peak_bytes'] / GIB:.2f} GiB allocated in the {result['peak_phase']} "
          f"(torch.cuda.max_memory_allocated: {measured / GIB:.2f}); backward start "
          f"{result['backward_start_bytes'] / GIB:.2f} GiB; {result['events']} allocator events")
    for name, ph in result["phases"].items():
        print(f"  {name:>9}: most {ph['bytes'] / GIB:6.2f} GiB (at {ph['at']})")
    for title, key in (("at the peak", "at_peak"), ("at the backward's start", "at_backward_start")):
        print(f"  {title}:")
        for what, size in list(result[key].items())[:args.top]:
            print(f"    {size / GIB:7.3f} GiB  {what[:120]}")
    record = {"bench": "memory_step", "variant": args.variant, "device": device_slug(device),
              "max_memory_allocated_bytes": measured, "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
              **{k: v for k, v in result.items() if k not in ("at_peak", "at_backward_start")},
              "at_peak": dict(list(result["at_peak"].items())[:40]),
              "at_backward_start": dict(list(result["at_backward_start"].items())[:40])}
    path = Path(args.out) / f"memory-{device_slug(device)}.jsonl"
    write_jsonl(path, (read_jsonl(path) if path.exists() else []) + [record])  # one line per variant run
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in record.items() if k not in ("at_peak", "at_backward_start")})[:1500])


if __name__ == "__main__":
    main()
