"""Calibration: the machine's free knobs fitted to measured points, and the error on points held out.

    fitted = calibrate(points, load_machine("cpu"))
    rows = holdout_error(points, load_machine("cpu"), scheme="largest")
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

import numpy as np

from optimus_core.config import ConfigError

from .machine import KINDS, Link, Machine
from .step import PHASES, point_layout, point_model, predict, predict_point

HOLDOUT_SCHEMES = ("largest", "role", "leave_one_out")


# ----------------------------------------------------------------------------- calibration

# Free knobs: each scales fields of the machine; fitted in log space (all must stay > 0).
KNOBS = {
    "compute_efficiency": "device.compute_efficiency (caps at 1)",
    "a2a_bandwidth": "intra/inter all_to_all bandwidth, one common factor",
    "sync_bandwidth": "reduce_scatter/all_gather/all_reduce bandwidth, one common factor",
    "latency": "every collective latency, one common factor",
    "memory_bandwidth": "device.memory_bandwidth",
    "compute_slots": "compute_slots_per_node (on a shared CPU box: the cores our ranks really get)",
    "step_overhead": "overhead.step (s)",
    "microbatch_overhead": "overhead.microbatch (s)",
    "expert_overhead": "overhead.expert (s per local expert, layer and micro-batch; loop backend)",
    "dispatch_passes": "overhead.dispatch (EP dispatch: passes over the dispatched rows in memory)",
    "rank_skew": "overhead.skew (the slowest rank's compute over the mean, minus 1)",
}
DEFAULT_FIT = ("compute_efficiency", "microbatch_overhead", "expert_overhead", "dispatch_passes", "rank_skew",
               "compute_slots", "a2a_bandwidth", "sync_bandwidth", "latency", "step_overhead")
TARGETS = ("step_s", "compute_s", "a2a_s", "grad_sync_s", "optimizer_s", "idle_s")


def _scale_links(links: Optional[dict[str, Link]], kinds, bw: float = 1.0, lat: float = 1.0):
    if links is None:
        return None
    return {k: Link(l.bandwidth * (bw if k in kinds else 1.0), l.latency * (lat if k in kinds else 1.0))
            for k, l in links.items()}


# Knobs that set one Machine field to the fitted value as it is.
FIELD_KNOBS = {"memory_bandwidth": "memory_bandwidth", "compute_slots": "compute_slots_per_node",
               "step_overhead": "step_overhead", "microbatch_overhead": "microbatch_overhead",
               "expert_overhead": "expert_overhead", "dispatch_passes": "dispatch_passes",
               "rank_skew": "rank_skew"}


def _apply(machine: Machine, knobs: dict[str, float]) -> Machine:
    m = machine
    for name, value in knobs.items():
        if name in FIELD_KNOBS:
            m = replace(m, **{FIELD_KNOBS[name]: value})
        elif name == "compute_efficiency":
            m = replace(m, compute_efficiency=min(1.0, value))
        elif name == "a2a_bandwidth":
            m = replace(m, intra=_scale_links(m.intra, ("all_to_all",), bw=value),
                        inter=_scale_links(m.inter, ("all_to_all",), bw=value))
        elif name == "sync_bandwidth":
            kinds = ("reduce_scatter", "all_gather", "all_reduce")
            m = replace(m, intra=_scale_links(m.intra, kinds, bw=value), inter=_scale_links(m.inter, kinds, bw=value))
        elif name == "latency":
            m = replace(m, intra=_scale_links(m.intra, KINDS, lat=value), inter=_scale_links(m.inter, KINDS, lat=value))
        else:
            raise ConfigError(f"fit: {name!r}: unknown knob; known: {', '.join(KNOBS)}")
    return m


def _start(machine: Machine, name: str) -> float:
    """Where a knob starts: its machine value (a multiplier of 1 for bandwidth/latency knobs);
    overheads that are 0 start at 1 ms (log space needs > 0)."""
    if name in ("a2a_bandwidth", "sync_bandwidth", "latency"):
        return 1.0
    value = {"compute_efficiency": machine.compute_efficiency, "memory_bandwidth": machine.memory_bandwidth,
             "compute_slots": float(machine.slots),
             "step_overhead": machine.step_overhead, "microbatch_overhead": machine.microbatch_overhead,
             "expert_overhead": machine.expert_overhead, "dispatch_passes": machine.dispatch_passes,
             "rank_skew": machine.rank_skew}[name]
    return value if value > 0 else {"expert_overhead": 1e-5, "dispatch_passes": 1.0, "rank_skew": 0.01}.get(name, 1e-3)


def calibrate(points: Sequence[dict], machine: Machine, fit: Sequence[str] = DEFAULT_FIT,
              targets: Sequence[str] = TARGETS, iterations: int = 100) -> Machine:
    """The machine with the knobs in ``fit`` set by least squares on log(predicted / measured) of
    ``targets`` over ``points``: the step time, and by default also each phase a point measured
    (weighted by the square root of its share of the step), since the step time alone cannot
    tell, say, a slower all-to-all from a slower matmul. Levenberg-Marquardt with a
    finite-difference Jacobian, in log space so every knob stays positive. Knobs the points
    cannot see (no multi-rank point for a bandwidth) stay put, held by a weak prior at their
    start value. ``targets=("step_s",)`` fits the step time alone."""
    for name in fit:
        if name not in KNOBS:
            raise ConfigError(f"fit: {name!r}: unknown knob; known: {', '.join(KNOBS)}")
    if not points:
        raise ConfigError("calibrate: no measured points")
    cases = [(point_model(p), point_layout(p), p) for p in points]
    x0 = np.log([_start(machine, n) for n in fit])
    prior = 1e-3  # weight of the pull towards the start (keeps unobservable knobs finite)

    def residuals(x: np.ndarray) -> np.ndarray:
        m = _apply(machine, dict(zip(fit, np.exp(x))))
        out = []
        for cfg, layout, p in cases:
            pred = predict(cfg, layout, m)
            for t in targets:
                if p.get(t) is not None and p[t] > 0 and getattr(pred, t) > 0:
                    # A phase counts by its share of the step: a phase of 1 % of the step, timed
                    # with its noise, must not pull the knobs as hard as the step time itself.
                    weight = 1.0 if t == "step_s" else math.sqrt(min(1.0, p[t] / p["step_s"]))
                    out.append(weight * math.log(getattr(pred, t) / p[t]))
        return np.concatenate([np.asarray(out), prior * (x - x0)])

    x, lam = x0.copy(), 1e-2
    r = residuals(x)
    for _ in range(iterations):
        J = np.empty((r.size, x.size))
        for j in range(x.size):  # backward: a knob at a kink (compute_slots at the core count) still moves
            dx = np.zeros_like(x)
            dx[j] = 1e-5
            J[:, j] = (r - residuals(x - dx)) / 1e-5
        g, H = J.T @ r, J.T @ J
        improved = False
        for _ in range(20):
            step = np.linalg.solve(H + lam * np.diag(np.diag(H) + 1e-12), -g)
            x_new = np.clip(x + step, x0 - 25, x0 + 25)
            r_new = residuals(x_new)
            if r_new @ r_new < r @ r:
                x, r, lam, improved = x_new, r_new, max(lam / 3, 1e-9), True
                break
            lam *= 4
        if not improved or np.abs(step).max() < 1e-7:
            break
    return _apply(machine, dict(zip(fit, np.exp(x))))


def knob_values(machine: Machine, reference: Machine) -> dict[str, float]:
    """The knobs of ``machine`` relative to ``reference`` (bandwidth / latency knobs as factors)."""
    return {
        "compute_efficiency": machine.compute_efficiency,
        "a2a_bandwidth": machine.intra["all_to_all"].bandwidth / reference.intra["all_to_all"].bandwidth,
        "sync_bandwidth": machine.intra["reduce_scatter"].bandwidth / reference.intra["reduce_scatter"].bandwidth,
        "latency": (machine.intra["all_to_all"].latency / reference.intra["all_to_all"].latency
                    if reference.intra["all_to_all"].latency else 1.0),
        "memory_bandwidth": machine.memory_bandwidth,
        "compute_slots": float(machine.slots),
        "step_overhead": machine.step_overhead,
        "microbatch_overhead": machine.microbatch_overhead,
        "expert_overhead": machine.expert_overhead,
        "dispatch_passes": machine.dispatch_passes,
        "rank_skew": machine.rank_skew,
    }


def split_points(points: Sequence[dict], scheme: str = "largest") -> list[tuple[list[dict], list[dict]]]:
    """(fitted, held-out) splits of ``points`` by ``scheme`` (holdout_error)."""
    if scheme not in HOLDOUT_SCHEMES:
        raise ConfigError(f"scheme = {scheme!r}: must be one of {', '.join(repr(s) for s in HOLDOUT_SCHEMES)}")
    if scheme == "leave_one_out":
        return [([q for j, q in enumerate(points) if j != i], [p]) for i, p in enumerate(points)]
    if scheme == "role":
        train = [p for p in points if p.get("role") != "held-out"]
        test = [p for p in points if p.get("role") == "held-out"]
        if not train or not test:
            raise ConfigError("holdout_error: 'role' needs points of role 'held-out' and others to fit on")
        return [(train, test)]
    top = max(int(p["devices"]) for p in points)
    train = [p for p in points if int(p["devices"]) < top]
    test = [p for p in points if int(p["devices"]) == top]
    if not train or not test:
        raise ConfigError("holdout_error: 'largest' needs points at more than one device count")
    return [(train, test)]


def holdout_error(points: Sequence[dict], machine: Machine, fit: Sequence[str] = DEFAULT_FIT,
                  scheme: str = "largest", targets: Sequence[str] = TARGETS) -> list[dict]:
    """Relative step-time error of points NOT used for fitting.

    ``scheme="largest"``: fit on the points below the largest device count of each sweep (same
    preset, device kind, dtype), test on those at the largest; ``"role"``: fit on the points
    whose ``role`` is not "held-out" (a design chosen before measuring: stages/scaling.py),
    test on the held-out ones; ``"leave_one_out"``: fit on all but one, test on it, for each
    point. Returns one row per tested point: its identity, measured and predicted step time and
    phases (``measured_<phase>``, ``predicted_<phase>``), and ``rel_error`` = predicted /
    measured - 1 of the step time.
    """
    rows = []
    for train, test in split_points(points, scheme):
        rows += error_rows(test, calibrate(train, machine, fit, targets), fitted_on=len(train))
    return rows


def error_rows(points: Sequence[dict], fitted: Machine, fitted_on: int) -> list[dict]:
    """holdout_error's rows for ``points`` predicted by an already ``fitted`` machine."""
    rows = []
    for p in points:
        pred = predict_point(p, fitted)
        rows.append({"preset": p["preset"], "device": p.get("device", ""), "devices": int(p["devices"]),
                     "ep": int(p.get("ep", 1)), "optimizer": p.get("optimizer", ""),
                     **({"setting": p["setting"]} if p.get("setting") else {}),
                     "global_batch": int(p["global_batch"]), "micro_batch": int(p.get("micro_batch") or 0),
                     "measured_s": float(p["step_s"]), "predicted_s": pred.step_s,
                     "rel_error": pred.step_s / float(p["step_s"]) - 1, "fitted_on": fitted_on,
                     **{f"measured_{ph}": float(p[ph]) for ph in PHASES if p.get(ph) is not None},
                     **{f"predicted_{ph}": getattr(pred, ph) for ph in PHASES}})
    return rows
