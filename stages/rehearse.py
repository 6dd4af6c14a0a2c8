"""Stage `rehearse`: one rank of each given layout on this machine's device, its peak memory
beside the memory model's, written to a JSON-lines file and the results store.

    from stages.rehearse import Rehearsal, RehearseConfig, RehearseOutputs, run_rehearse
    jobs = [Rehearsal("scaling-mula-220b-a10b-12288", cfg, world=12288, checkpointing=("full", 2), budget_gib=57.6)]
    run_rehearse(RehearseConfig(jobs, rank=0, steps=2, device="cuda"),
                 RehearseOutputs(jsonl=Path("bench/results/rehearsal-nvidia-h200.jsonl"), store=Path(...)))

The rank is built and stepped by optimus_core.rehearsal (torch's fake process group stands in
for the other ranks); the rehearsals run one after another in this process, the device's
caches emptied and its peak counters reset between them. The file is rewritten whole after
each rehearsal (atomically), so an interrupted sweep keeps what it measured; its records
replace earlier ones of the same name and tile count, and its last line is a summary. The
store run is ``rehearsal-<device>``: one table per record (``<name>@<tiles>``), the record's
other fields in the run's attrs. The `optimus rehearse` command resolves the layouts (the
experiment registry, the site's memory budget) and calls this.
"""
from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError, RunConfig
from optimus_core.device import device_slug
from optimus_core.log import get_logger
from optimus_core.rehearsal import fmt, rehearse
from optimus_core.paths import missing

_log = get_logger(__name__)


@dataclass(frozen=True)
class Rehearsal:
    """One layout to rehearse: a name (the registry's run), its RunConfig and world size, the
    checkpointing and weight gathers it resolves to on its target machine (None: a rank not
    sharded, or as the rehearsal's device resolves them), and that machine's budget per device."""

    name: str
    run: RunConfig
    world: int
    checkpointing: tuple[str, int]
    budget_gib: float | None = None
    weight_gathers: str | None = None


@dataclass
class RehearseConfig:
    jobs: Sequence[Rehearsal]
    rank: int = 0
    steps: int = 2
    micro_batches: int | None = 2  # of each rank's micro-batches per step; None: all of them
    device: str = "cuda"
    save: bool = True  # write the rank's part of a checkpoint after the steps (a temporary directory), its peak recorded

    def __post_init__(self):
        # ConfigError (a ValueError): a wrong setting, exit 2 from the command line
        if not self.jobs:
            raise ConfigError("rehearse: no layout to rehearse")
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: must be >= 1")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ConfigError(f"--micro-batches {self.micro_batches}: must be >= 1")
        smallest = min(job.world for job in self.jobs)
        if not 0 <= self.rank < smallest:
            raise ConfigError(f"--rank {self.rank}: must be in [0, {smallest}) (the smallest world rehearsed)")


@dataclass
class RehearseOutputs:
    jsonl: Path | None = None
    store: Path | None = None


@dataclass
class RehearseResult:
    records: list[dict] = field(default_factory=list)
    run_id: str = ""


def record_key(record: dict) -> str:
    return f"{record['name']}@{record['world']}"


def run_rehearse(config: RehearseConfig, outputs: RehearseOutputs) -> RehearseResult:
    import torch

    from optimus_core.compile_cache import use_compile_cache

    use_compile_cache()  # the site's cache: filled here by `optimus warm-cache`, else its copy
    device = torch.device(config.device)
    kept = _read(outputs.jsonl) if outputs.jsonl and Path(outputs.jsonl).is_file() else []
    kept = [r for r in kept if "name" in r]
    result = RehearseResult(run_id=f"rehearsal-{device_slug(device)}")
    for job in config.jobs:
        if device.type in ("cuda", "xpu"):
            backend = getattr(torch, device.type)
            backend.empty_cache()
            backend.reset_peak_memory_stats(device)
        with tempfile.TemporaryDirectory(prefix="rehearsal-save-") as save_dir:
            record = rehearse(job.run, job.world, rank=config.rank, steps=config.steps, device=config.device,
                              micro_batches=config.micro_batches, checkpointing=job.checkpointing,
                              weight_gathers=job.weight_gathers,
                              save_dir=save_dir if config.save else None)
        record.update(name=job.name, budget_gib=job.budget_gib,
                      within_budget=None if job.budget_gib is None or "peak_allocated_gib" not in record
                      else bool(record["peak_allocated_gib"] <= job.budget_gib))
        _log.info(fmt(record) + (f"; budget {job.budget_gib:.1f} GiB" if job.budget_gib else ""))
        # subtracted from the peak (optimus_core.rehearsal); on an H200, 0.06 GiB is held before
        # any rehearsal (the process's own buffers), so only more than that is worth a warning
        if record.get("held_before_gib", 0) > 0.25:
            _log.warning("%s: %.2f GiB were allocated on the device before this rehearsal began (not freed "
                         "by an earlier one?); its peak is counted without them", record_key(record),
                         record["held_before_gib"])
        result.records.append(record)
        kept = [r for r in kept if record_key(r) != record_key(record)] + [record]
        if outputs.jsonl:
            Path(outputs.jsonl).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(outputs.jsonl), "".join(json.dumps(line) + "\n"
                                                      for line in kept + [summary(kept, result.run_id)]))
    if outputs.store:
        write_store(outputs.store, result.run_id, kept, summary(kept, result.run_id))
    return result


def summary(records: list[dict], run_id: str) -> dict:
    """The last line of a rehearsal file: the worst model error and whether all fit."""
    measured = [r for r in records if "peak_allocated_gib" in r]
    errors = [abs(r["model_error"]) for r in measured]
    return {"bench": "rehearsal_summary", "run_id": run_id, "records": len(records),
            "max_abs_model_error": max(errors) if errors else None,
            "all_within_budget": all(r.get("within_budget") is not False for r in records)}


def write_store(store: Path, run_id: str, records: list[dict], head: dict) -> None:
    """The records into the store: one table per record, a row of its numbers; the rest in attrs."""
    from optimus_core.store import open_store

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    with open_store(store).run_writer(run_id, attrs={**head, "experiment": "rehearsal"}) as w:
        for r in records:
            row = {k: v for k, v in r.items() if number(v)}
            row.update({f"model_{k}_gib": v for k, v in r.get("terms_gib", {}).items()})
            w.log(_table(record_key(r)), {**row, "step": 0})
        w.update_attrs(records={_table(record_key(r)): {k: v for k, v in r.items() if not number(v)} for r in records})


def ingest(path: Path, store: Path) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--ingest {path}: {missing(path, 'file')} "
                                f"(a rehearsal file: `optimus rehearse --jsonl` writes one)")
    records = [r for r in _read(path) if "name" in r]
    if not records:
        raise ValueError(f"{path}: no rehearsal records")
    run_id = f"rehearsal-{Path(path).stem.removeprefix('rehearsal-')}"
    write_store(store, run_id, records, summary(records, run_id))
    return f"wrote run {run_id} ({len(records)} records) to {store}"


def _table(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+@-]+", "_", key)


def _read(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    return out
