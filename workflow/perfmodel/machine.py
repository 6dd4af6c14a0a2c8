"""The machine as the model sees it: links, devices, overheads, and their YAML (workflow/machines/*.yaml).

    machine = load_machine("aurora")        # or a path; machine_from_dict(mapping) validates a mapping
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from optimus_core.config import ConfigError

MACHINES_DIR = Path(__file__).resolve().parent.parent / "machines"
KINDS = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")
DTYPES = ("float32", "bfloat16")


# ----------------------------------------------------------------------------- machine

@dataclass(frozen=True)
class Link:
    """One collective on one kind of link: bus bandwidth (B/s) and latency per algorithm step (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Machine:
    """A machine as the model sees it (see workflow/machines/*.yaml for each field's source).

    ``matmul_flops``: per-device dense matmul rate per dtype (FLOP/s, measured where we could);
    ``compute_efficiency``: the fraction of it a whole training step achieves; ``intra`` /
    ``inter``: per collective kind, the link inside a node and the node's whole network
    injection (all NICs) across nodes (``inter`` None: a one-node machine).
    """

    name: str
    matmul_flops: dict[str, float]
    compute_efficiency: float
    memory_bandwidth: float
    devices_per_node: int
    intra: dict[str, Link]
    inter: Optional[dict[str, Link]] = None
    nics_per_node: int = 0
    nic_bandwidth: float = 0.0
    compute_slots_per_node: float = 0  # devices computing at once (free CPU cores); 0 = devices_per_node
    peak_flops: float = 0.0  # datasheet peak of the main dtype: the MFU denominator (0 = unknown)
    step_overhead: float = 0.0  # s per step outside every phase (host work)
    microbatch_overhead: float = 0.0  # s of host time per micro-batch forward + backward
    expert_overhead: float = 0.0  # s per local expert, MoE layer and micro-batch (loop backend only)
    dispatch_passes: float = 0.0  # EP dispatch: memory passes over the dispatched rows, per MoE layer and micro-batch
    rank_skew: float = 0.0  # the slowest rank's compute over the mean, minus 1: the others wait that long
    moe_imbalance: float = 1.0  # slowest EP rank's expert tokens / the mean (1 = balanced routing)
    memory_bytes: float = 0.0  # one device's memory (0 = unknown): the memory model's budget
    device_kind: str = "cuda"  # the torch device type a rank runs on

    @property
    def slots(self) -> int:
        return self.compute_slots_per_node or self.devices_per_node

    @property
    def injection_bandwidth(self) -> float:
        return self.nics_per_node * self.nic_bandwidth


def _bad(machine: str, key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"machine {machine}: {key} = {value!r}: {allowed}")


def _number(machine: str, key: str, value: Any, *, positive: bool = True, integer: bool = False) -> float:
    if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1.6e11 as a string: accept what float() reads
        try:
            value = float(value)
        except ValueError:
            raise _bad(machine, key, value, "must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and int(value) != value):
        raise _bad(machine, key, value, "must be an integer" if integer else "must be a number")
    if (positive and value <= 0) or value < 0 or not math.isfinite(value):
        raise _bad(machine, key, value, "must be > 0" if positive else "must be >= 0")
    return int(value) if integer else float(value)


def _mapping(machine: str, key: str, value: Any, known: Iterable[str], required: Iterable[str]) -> dict:
    if not isinstance(value, dict):
        raise _bad(machine, key, value, "must be a mapping")
    known = list(known)
    for k in value:
        if k not in known:
            raise ConfigError(f"machine {machine}: {key}.{k}: unknown key; known: {', '.join(known)}")
    for k in required:
        if k not in value:
            raise ConfigError(f"machine {machine}: {key}.{k}: missing")
    return value


def _links(machine: str, key: str, value: Any) -> dict[str, Link]:
    value = _mapping(machine, key, value, KINDS, KINDS)
    out = {}
    for kind in KINDS:
        spec = _mapping(machine, f"{key}.{kind}", value[kind], ("bandwidth", "latency"), ("bandwidth", "latency"))
        out[kind] = Link(_number(machine, f"{key}.{kind}.bandwidth", spec["bandwidth"]),
                         _number(machine, f"{key}.{kind}.latency", spec["latency"], positive=False))
    return out


def machine_from_dict(data: Any, name: str = "") -> Machine:
    """Validate a machine mapping (the YAML's layout); errors name the machine and the key."""
    name = (data or {}).get("name", name) if isinstance(data, dict) else name
    top = ("name", "device", "devices_per_node", "compute_slots_per_node", "network", "overhead")
    data = _mapping(name, "machine", data, top, ("device", "devices_per_node", "network"))
    dev = _mapping(name, "device", data["device"], ("matmul_flops", "peak_flops", "compute_efficiency",
                                                    "memory_bandwidth", "memory_gib", "kind"),
                   ("matmul_flops", "compute_efficiency", "memory_bandwidth"))
    rates = _mapping(name, "device.matmul_flops", dev["matmul_flops"], DTYPES, ())
    if not rates:
        raise ConfigError(f"machine {name}: device.matmul_flops: needs at least one of {', '.join(DTYPES)}")
    eff = _number(name, "device.compute_efficiency", dev["compute_efficiency"])
    if eff > 1:
        raise _bad(name, "device.compute_efficiency", eff, "must be in (0, 1]")
    net = _mapping(name, "network", data["network"], ("intra_node", "inter_node", "nics_per_node", "nic_bandwidth"),
                   ("intra_node",))
    inter = net.get("inter_node")
    nics = nic_bw = 0
    if inter is not None:
        nics = _number(name, "network.nics_per_node", net.get("nics_per_node"), integer=True)
        nic_bw = _number(name, "network.nic_bandwidth", net.get("nic_bandwidth"))
        inter = _links(name, "network.inter_node", inter)
        for kind, link in inter.items():  # a node cannot push more than its NICs carry
            if link.bandwidth > nics * nic_bw * (1 + 1e-9):
                raise _bad(name, f"network.inter_node.{kind}.bandwidth", link.bandwidth,
                           f"must be <= nics_per_node x nic_bandwidth ({nics * nic_bw:.4g} B/s)")
    over = _mapping(name, "overhead", data.get("overhead") or {}, ("step", "microbatch", "expert", "dispatch",
                                                                   "skew", "moe_imbalance"), ())
    imb = _number(name, "overhead.moe_imbalance", over.get("moe_imbalance", 1.0))
    if imb < 1:
        raise _bad(name, "overhead.moe_imbalance", imb, "must be >= 1 (slowest / mean)")
    return Machine(
        name=name or "unnamed",
        matmul_flops={d: _number(name, f"device.matmul_flops.{d}", v) for d, v in rates.items()},
        compute_efficiency=eff,
        memory_bandwidth=_number(name, "device.memory_bandwidth", dev["memory_bandwidth"]),
        devices_per_node=_number(name, "devices_per_node", data["devices_per_node"], integer=True),
        compute_slots_per_node=_number(name, "compute_slots_per_node", data.get("compute_slots_per_node", 0),
                                       positive=False),
        intra=_links(name, "network.intra_node", net["intra_node"]),
        inter=inter, nics_per_node=nics, nic_bandwidth=nic_bw,
        peak_flops=_number(name, "device.peak_flops", dev.get("peak_flops", 0.0), positive=False),
        step_overhead=_number(name, "overhead.step", over.get("step", 0.0), positive=False),
        microbatch_overhead=_number(name, "overhead.microbatch", over.get("microbatch", 0.0), positive=False),
        expert_overhead=_number(name, "overhead.expert", over.get("expert", 0.0), positive=False),
        dispatch_passes=_number(name, "overhead.dispatch", over.get("dispatch", 0.0), positive=False),
        rank_skew=_number(name, "overhead.skew", over.get("skew", 0.0), positive=False),
        moe_imbalance=imb,
        memory_bytes=_number(name, "device.memory_gib", dev.get("memory_gib", 0), positive=False) * 2 ** 30,
        device_kind=_kind(name, dev.get("kind", "cuda")),
    )


def _kind(machine: str, value: Any) -> str:
    if value not in ("cpu", "cuda", "xpu"):
        raise _bad(machine, "device.kind", value, "must be one of 'cpu', 'cuda', 'xpu'")
    return value


def load_machine(name_or_path: str | Path) -> Machine:
    """``h200``, ``cpu``, ``aurora`` (workflow/machines/<name>.yaml) or a path to a YAML file."""
    import yaml

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = MACHINES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MACHINES_DIR.glob("*.yaml"))
        raise ConfigError(f"machine = {str(name_or_path)!r}: unknown; known: {', '.join(known)} or a YAML path")
    return machine_from_dict(yaml.safe_load(path.read_text()), name=path.stem)
