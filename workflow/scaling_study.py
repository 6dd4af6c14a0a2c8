"""The strong-scaling study's numbers: measured sweeps, the calibrated model beside them, held-out
errors, and the paper's sweep predicted on Aurora (`optimus perfmodel`).

    from workflow.scaling_study import run_study
    study = run_study(store=Path("results/store.zarr"),
                      measured=[Path("bench/results/distributed-strong-weak-nvidia-h200.jsonl")],
                      out_json=Path("results/perfmodel.json"))
    study["holdout"]     # one row per held-out point: measured_s, predicted_s, rel_error, sweep
    study["predicted"]   # the model beside every measured point, and the paper's Aurora sweep

Measured points come from two places, both in the point contract of stages/scaling.py
(preset, overrides, device, devices, ep, optimizer, global_batch, micro_batch, seq_len, dtype,
step_s and its phases):

* the results store: every completed run of kind ``scaling`` (`optimus scaling`), its table
  ``scaling`` (numbers) and its attrs (strings: preset, device, optimizers per device count);
* JSON-lines files (``--measured``): the records of the ``strong`` suite of bench/distributed.py
  (e.g. the H200 points in bench/results/), other records are ignored.

A sweep is one (preset, overrides, device, setting, EP rule): ``EP=n`` where every point splits
the experts over all its ranks, ``EP=<e>`` where the degree is fixed; the setting ("batch 8",
"batch 16 micro 2") where `optimus scaling` measured several; a one-device point is the base of
every sweep of its (preset, overrides, device, setting). Each sweep's machine
(``MACHINE_OF_DEVICE``) is calibrated on its points below the largest device count and tested on
those at the largest (``perfmodel.holdout_error``, scheme "largest"); the model rows drawn beside
a sweep come from that same fit, so the largest points are predictions, never fits. A sweep of
one device count is fitted on all its points and has no held-out error.

A family (preset, overrides, device) measured with a held-out design instead (its points carry a
``role``, chosen by `optimus scaling --fitted/--holdout` before anything was timed: the laptop's
2-core CPU cannot add ranks, so it holds out other batches and micro-batches, at EP = 1 and 2) is
calibrated once on all its "fitted" points, across its sweeps, and tested on its "held-out" ones
(``study_design``, scheme "role"); its holdout rows name what was fitted (``fit_points``). It
needs two fitted multi-rank settings that differ in all-to-all calls per step (the laptop's: batch
16 whole and in micro-batches of 2): with one, a collective's per-call latency and its per-byte
cost are one equation in two unknowns, and a held-out batch extrapolates in bytes on a guess.
Measured points keep ``step_s_spread`` and ``cpu_wait`` (how loaded the box was: stages/scaling.py)
for the report.

Everything goes to the store as run ``perfmodel`` -- tables ``measured``, ``predicted`` and
``holdout`` (one row per item, ``step`` = its index; the strings of row i in the run attrs
``strings.<table>[i]``) -- which stages/scaling_figure.read_scaling reads back, and to a JSON file.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from optimus_core.atomic import atomic_write
from optimus_core.config import ConfigError
from optimus_core.paths import missing
from stages.scaling import POINT_STRINGS
from workflow import perfmodel as pm

RUN_ID = "perfmodel"
TABLES = ("measured", "predicted", "holdout")
# Device slug of a measured point (stages/scaling.device_slug) -> workflow/machines/<name>.yaml.
MACHINE_OF_DEVICE = {"cpu": "cpu", "nvidia-h200": "h200"}
PAPER_MACHINE = "aurora"
OVERLAP_WHATIF = "grad_sync"
OUR_DESIGN = "zero3-blocks"  # the registry's other design of the sweep (workflow.experiments.DESIGNS)
# A held-out design fits the memory bandwidth too: its fitted points time the optimizer (memory-
# bound AdamW) at 1 and 2 ranks in several settings, and AdamW's in-place passes beat the machine
# file's copy probe (laptop CPU design, one rank: median 33.7 ms over 24 points of six sweeps,
# 43 ms at the probe's bandwidth). A GPU sweep's two fitted device counts are too few for one more.
DESIGN_FIT = pm.DEFAULT_FIT + ("memory_bandwidth",)
POINT_FIELDS = ("preset", "overrides", "device", "devices", "ep", "optimizer", "global_batch", "micro_batch",
                "seq_len", "dtype", "experts_backend", "setting", "sharding", "dp_shard", "step_s", "compute_s",
                "a2a_s", "grad_sync_s", "optimizer_s", "idle_s", "tokens_per_s", "step_s_spread", "cpu_wait")


# ----------------------------------------------------------------------------- reading points

def store_points(store_path: Path) -> list[dict]:
    """The points of every completed ``scaling`` run of the store (none if the store is absent)."""
    from optimus_core.store import open_store

    if not Path(store_path).exists():
        return []
    store = open_store(store_path, mode="r")
    runs = store.runs()
    points = []
    for run_id, status in zip(runs["run_id"], runs["status"]):
        attrs = store.attrs(run_id)
        if attrs.get("kind") != "scaling" or status != "completed" or "scaling" not in store.tables(run_id):
            continue
        optimizers = attrs.get("optimizers") or {}
        strings = {k: attrs.get(f"{k}s") or [] for k in POINT_STRINGS}  # per row, in row order
        for i, row in enumerate(store.metrics(run_id, "scaling").to_dict("records")):
            n = int(row["devices"])
            labels = {k: v[i] for k, v in strings.items() if i < len(v) and v[i]}
            points.append({**{k: v for k, v in row.items() if k != "step" and v == v}, **labels,
                           "devices": n, "ep": int(row["ep"]),
                           "preset": attrs["preset"], "device": attrs.get("device", "cpu"),
                           "overrides": attrs.get("overrides") or {},
                           "optimizer": optimizers.get(str(n), attrs.get("optimizer", "ep_aware")),
                           "dtype": attrs.get("dtype", "float32"),
                           "experts_backend": attrs.get("experts_backend", ""),
                           "source": f"store:{run_id}"})
    return points


def file_points(path: Path) -> list[dict]:
    """The strong-suite records of a bench JSON-lines file that carry every field the model needs."""
    points = []
    for i, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
        if record.get("suite") != "strong" or "error" in record:
            continue
        missing = [k for k in ("preset", "device", "devices", "global_batch", "seq_len", "step_s") if k not in record]
        if missing:
            raise ValueError(f"{path}:{i}: a strong-scaling record without {', '.join(missing)}")
        points.append({**record, "source": f"{Path(path).name}:{record.get('label', i)}"})
    return points


# ----------------------------------------------------------------------------- sweeps

def _rule(p: dict) -> str:
    return "EP=n" if int(p.get("ep", 1)) == int(p["devices"]) else f"EP={int(p.get('ep', 1))}"


def _family(p: dict) -> tuple:
    return p["preset"], json.dumps(p.get("overrides") or {}, sort_keys=True), p.get("device", "")


def sweeps(points: Iterable[dict]) -> dict[str, list[dict]]:
    """Points grouped into strong-scaling sweeps, named ``<preset> <device> <EP rule>`` (plus
    the overrides where a preset was measured with several, and the setting -- "batch 8",
    "batch 16 micro 2" (stages/scaling.py) -- where a family was measured at several); each
    sorted by device count, with the one-device base of its preset, overrides, device and setting
    copied into every multi-device sweep of theirs. Each point gets ``sweep`` (that name) and
    ``run_id`` (the name less preset and device: what stages/scaling_figure.series separates
    sweeps of one preset and device by)."""
    points = list(points)
    overrides_of, settings_of = defaultdict(set), defaultdict(set)
    for p in points:
        overrides_of[(p["preset"], p.get("device", ""))].add(_family(p)[1])
        settings_of[_family(p)].add(p.get("setting") or "")
    multi, base = defaultdict(list), defaultdict(list)
    for p in points:
        family = (*_family(p), p.get("setting") or "")
        (multi[(*family, _rule(p))] if int(p["devices"]) > 1 else base[family]).append(p)
    out = {}
    for key in sorted(set(multi) | {(*f, "EP=n") for f in base if not any(k[:4] == f for k in multi)}):
        preset, overrides, device, setting, rule = key
        short = rule + (f" {overrides}" if len(overrides_of[(preset, device)]) > 1 else "")
        short += f" {setting}" if len(settings_of[(preset, overrides, device)]) > 1 else ""
        name = f"{preset} {device} {short}"
        rows = base[(preset, overrides, device, setting)] + multi.get(key, [])
        out[name] = sorted(({**p, "sweep": name, "run_id": short} for p in rows), key=lambda p: int(p["devices"]))
    return out


def _machine_for(points: Sequence[dict]) -> Optional[str]:
    return MACHINE_OF_DEVICE.get(str(points[0].get("device", "")))


def study_sweep(name: str, points: list[dict], machine: pm.Machine) -> dict[str, Any]:
    """Calibrate ``machine`` on the sweep's points below its largest device count, predict every
    point with that fit, and the held-out error at the largest (module doc)."""
    points = [{**p, "run_id": p.get("run_id") or name} for p in points]
    counts = sorted({int(p["devices"]) for p in points})
    top = counts[-1]
    train = [p for p in points if int(p["devices"]) < top] if len(counts) > 1 else list(points)
    fitted = pm.calibrate(train, machine)
    holdout = pm.holdout_error(points, machine) if len(counts) > 1 else []
    predicted = pm.predict_points(points, fitted)  # carries each point's run_id
    measured = []
    for p in points:
        role = "held-out" if len(counts) > 1 and int(p["devices"]) == top else "fitted"
        measured.append({**{k: p[k] for k in POINT_FIELDS if k in p}, "run_id": p["run_id"], "sweep": name,
                         "role": role, "source": p.get("source", "")})
    for row in predicted:
        row["sweep"] = name
    fit_devices = " ".join(str(n) for n in counts[:-1])
    return {"name": name, "machine": machine.name, "device_counts": counts, "fitted_on": len(train),
            "knobs": pm.knob_values(fitted, machine), "measured": measured, "predicted": predicted,
            "holdout": [{**h, "sweep": name, "run_id": points[0]["run_id"], "fit_devices": fit_devices}
                        for h in holdout]}


def _point_label(p: dict) -> str:
    """A point as the report names it: "2 EP=1 batch 16"."""
    return " ".join(x for x in (str(int(p["devices"])), _rule(p) if int(p["devices"]) > 1 else "",
                                str(p.get("setting") or "")) if x)


def study_design(name: str, points: list[dict], machine: pm.Machine) -> dict[str, Any]:
    """A family measured with a held-out design (every point has a ``role``, stages/scaling.py):
    calibrate ``machine`` once on every point not held out, across the family's sweeps, and
    predict every point with that fit; the held-out points' errors are the test."""
    swept = [p for rows in sweeps(points).values() for p in rows]  # the one-device bases repeat: once each
    unique = _unique(swept)
    train = [p for p in unique if p.get("role") != "held-out"]
    test = [p for p in unique if p.get("role") == "held-out"]
    if not test:
        raise ConfigError(f"{name}: a held-out design without held-out points")
    fitted = pm.calibrate(train, machine, fit=DESIGN_FIT)
    counts = sorted({int(p["devices"]) for p in unique})
    fit_devices = " ".join(str(n) for n in sorted({int(p["devices"]) for p in train}))
    fit_points = ", ".join(_point_label(p) for p in train)
    holdout = [{**h, "sweep": p["sweep"], "run_id": p["run_id"], "fit_devices": fit_devices, "fit_points": fit_points}
               for h, p in zip(pm.error_rows(test, fitted, fitted_on=len(train)), test)]
    measured = [{**{k: p[k] for k in POINT_FIELDS if k in p}, "run_id": p["run_id"], "sweep": p["sweep"],
                 "role": p.get("role") or "fitted", "source": p.get("source", "")} for p in swept]
    predicted = [{**row, "sweep": p["sweep"]} for row, p in zip(pm.predict_points(swept, fitted), swept)]
    return {"name": name, "machine": machine.name, "device_counts": counts, "fitted_on": len(train),
            "design": "role", "fit_points": fit_points, "knobs": pm.knob_values(fitted, machine),
            "measured": measured, "predicted": predicted, "holdout": holdout}


def _unique(points: list[dict]) -> list[dict]:
    """Each measured point once (a one-device base sits in every sweep of its setting)."""
    seen, out = set(), []
    for p in points:
        key = (int(p["devices"]), int(p.get("ep", 1)), p.get("setting"), p.get("global_batch"), p.get("micro_batch"),
               p.get("source"), p["step_s"])
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def run_study(store: Optional[Path], measured: Sequence[Path], out_json: Optional[Path] = None,
              write_store: bool = True) -> dict[str, Any]:
    """The whole study (module doc); returns what it writes."""
    points = store_points(store) if store else []
    measured_points = [p for path in measured for p in file_points(path)]
    if measured and not measured_points:  # given to calibrate on, all would be ignored: say so, do not exit 0
        named = measured[0] if len(measured) == 1 else f"{len(measured)} files"
        raise ValueError(f"--measured {named}: no strong-scaling records (JSON lines with \"suite\": \"strong\" "
                         f"and no \"error\", as bench/distributed.py writes them)")
    points += measured_points  # (other benchmarks' files may be among them: the workflow passes them all)
    result: dict[str, Any] = {"sweeps": [], "skipped": {}, **{t: [] for t in TABLES}}
    families = defaultdict(list)
    for p in points:
        families[_family(p)].append(p)
    work = []  # (name, points, study function)
    for (preset, _, device), family in families.items():
        if any(p.get("role") for p in family):
            work.append((f"{preset} {device}", family, study_design))
        else:
            work += [(name, rows, study_sweep) for name, rows in sweeps(family).items()]
    for name, sweep_points, study in sorted(work, key=lambda w: w[0]):
        machine = _machine_for(sweep_points)
        if machine is None:
            result["skipped"][name] = (f"no machine file for device {sweep_points[0].get('device')!r} "
                                       f"(known: {', '.join(MACHINE_OF_DEVICE)})")
            continue
        one = study(name, sweep_points, pm.load_machine(machine))
        for table in TABLES:
            result[table] += one.pop(table)
        result["sweeps"].append(one)
    aurora = pm.load_machine(PAPER_MACHINE)
    # the authors' layout (the registry's sweep), its what-if, and our own design of the same runs
    paper, whatif = pm.paper_sweep(aurora), pm.paper_sweep(aurora, overlap=OVERLAP_WHATIF)
    ours = pm.paper_sweep(aurora, design=OUR_DESIGN)
    result["predicted"] += paper + whatif + ours
    result["paper"] = {"machine": aurora.name, "tiles": [r["devices"] for r in paper],
                       "efficiency": [r["efficiency"] for r in paper],
                       "efficiency_overlap_grad_sync": [r["efficiency"] for r in whatif],
                       f"efficiency_{OUR_DESIGN.replace('-', '_')}": [r["efficiency"] for r in ours]}
    result = _plain(result)
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out_json, json.dumps(result, indent=1, sort_keys=True) + "\n")
    if store and write_store:
        write_study(store, result)
    return result


def _plain(obj: Any) -> Any:
    """numpy scalars -> Python numbers, recursively (JSON and the store's attrs need plain types)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def write_study(store_path: Path, result: dict[str, Any]) -> None:
    """Run ``perfmodel``: numbers in the tables, strings (and dicts) of row i in attrs
    ``strings.<table>[i]``; a rerun replaces every table (rows are logged again from step 0)."""
    from optimus_core.store import open_store

    strings = {t: [{k: v for k, v in row.items() if not _is_number(v)} for row in result[t]] for t in TABLES}
    attrs = {"experiment": "perfmodel", "kind": "perfmodel", "status": "running", "strings": strings,
             "sweeps": result["sweeps"], "skipped": result["skipped"], "paper": result["paper"],
             "n_rows": {t: len(result[t]) for t in TABLES}}
    with open_store(store_path).run_writer(RUN_ID, attrs=attrs) as writer:
        for table in TABLES:
            for i, row in enumerate(result[table]):
                writer.log(table, {"step": i, **{k: v for k, v in row.items() if _is_number(v) and k != "step"}})


def check_paths(measured: Sequence[Path]) -> None:
    for path in measured:  # an input that is not there: exit 1, like every missing input
        if not Path(path).is_file():
            raise FileNotFoundError(f"--measured {path}: {missing(path, 'file')}"
                                    f" (a JSON-lines file of bench/distributed.py's strong suite)")
