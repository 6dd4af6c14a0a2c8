"""Devices and their collective backends: cpu (gloo), cuda (nccl), xpu (xccl, torch >= 2.8).

Intel's intel-extension-for-pytorch and oneccl-bindings-for-pytorch are end-of-life upstream:
they are imported only where installed (older Aurora stacks) and only when torch's own xccl is
missing; nothing requires them.
"""
from __future__ import annotations

import importlib.util
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

# bf16 dense peak per device, the MFU denominator by convention (datasheet numbers).
PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    # Intel Data Center GPU Max 1550 (Aurora): 839 TFLOP/s bf16 per GPU, two tiles per GPU.
    "Max 1550": 839e12 / 2,
}


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # cpu | cuda | xpu
    name: str
    backend: str  # collective backend for torch.distributed
    peak_flops: float | None  # bf16 peak of one device (rank), None when unknown (CPU)


def has_xpu() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


class DeviceUnavailableError(RuntimeError):
    """An explicit device type this process does not see. The environment lacks it (the machine,
    its driver, the torch build, a visibility variable), not the configuration, which is valid
    where the device is; the message names the setting, the device and what torch reports."""


def resolve_device_type(requested: str = "auto", field: str = "device", instead: str = "auto or cpu") -> str:
    """``auto`` picks cuda, then xpu, then cpu; an explicit request that cannot be met is a
    DeviceUnavailableError naming ``field`` (the setting that asked: "train.device", "--device")
    and ``instead``, the values of that setting that would run here."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "xpu": has_xpu()}
    if requested == "auto":
        return next(t for t in ("cuda", "xpu", "cpu") if available[t])
    if requested not in available:
        raise ValueError(f"{field} = {requested!r}: must be one of auto, cpu, cuda, xpu")
    if not available[requested]:
        raise DeviceUnavailableError(_unavailable(requested, field, instead))
    return requested


def _unavailable(device_type: str, field: str, instead: str = "auto or cpu") -> str:
    """The sentence for an explicit ``device_type`` that this process does not see."""
    import os

    if device_type == "xpu" and not hasattr(torch, "xpu"):
        why = f"this torch, {torch.__version__}, has no torch.xpu"
    else:
        why = f"torch.{device_type}.is_available() is False"
    if device_type == "cuda" and torch.version.cuda is None:
        why += f"; this torch, {torch.__version__}, is built without CUDA"
    masks = [f"{v}={os.environ[v]!r}" for v in VISIBILITY_ENV.get(device_type, ()) if v in os.environ]
    if masks:
        why += "; " + ", ".join(masks)
    return (f"{field} = {device_type} but no {device_type.upper()} device is visible ({why}); run on a machine "
            f"with one, or set {field} to {instead}")


def collective_backend(device_type: str, *, torch_version: str = torch.__version__,
                       have_xccl: bool | None = None, have_oneccl_bindings: bool | None = None) -> str:
    """The torch.distributed backend for a device type (pure logic, unit-tested without hardware)."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    if device_type == "xpu":
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
        if have_xccl is None:
            have_xccl = (major, minor) >= (2, 8) and _xccl_available()
        if have_xccl:
            return "xccl"
        if have_oneccl_bindings is None:
            have_oneccl_bindings = importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None
        if have_oneccl_bindings:
            return "ccl"
        raise RuntimeError("xpu needs torch >= 2.8 built with xccl, or oneccl_bindings_for_pytorch installed")
    raise ValueError(f"unknown device type {device_type!r}")


def _xccl_available() -> bool:
    try:
        return bool(torch.distributed.is_xccl_available())
    except AttributeError:
        return False


def import_vendor_extensions(device_type: str, backend: str, intel_extension: bool = False) -> None:
    """Import Intel's extensions only where a run needs them: intel_extension_for_pytorch when it
    asks by name (execution.intel_extension) on an XPU, the oneCCL bindings for their "ccl"
    backend. Asked for and not installed: a ConfigError naming the field."""
    if intel_extension and device_type == "xpu":
        if importlib.util.find_spec("intel_extension_for_pytorch") is None:
            from .config import ConfigError

            raise ConfigError("execution.intel_extension = true: intel_extension_for_pytorch is not installed here "
                              "(torch's own xpu needs none: set it false)")
        import intel_extension_for_pytorch  # noqa: F401  (registers optimized xpu ops)
    if backend == "ccl":
        import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)


def device_name(device_type: str, index: int = 0) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name(index)
    if device_type == "xpu":
        return torch.xpu.get_device_name(index)
    import platform
    return platform.processor() or platform.machine() or "cpu"


def device_slug(device: str | torch.device = "auto") -> str:
    """The machine as results files and run ids name it: "cpu" / "meta", or the accelerator's
    name as a file-name slug ("nvidia-h200"). ``device``: "auto" (resolve_device_type), a type
    or a torch.device."""
    device = torch.device(resolve_device_type() if device == "auto" else device)
    if device.type in ("cpu", "meta"):
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", device_name(device.type, device.index or 0).lower()).strip("-")


def peak_flops_for(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def device_info(requested: str = "auto", index: int = 0) -> DeviceInfo:
    dtype = resolve_device_type(requested)
    name = device_name(dtype, index)
    return DeviceInfo(dtype, name, collective_backend(dtype), None if dtype == "cpu" else peak_flops_for(name))


# The variables that narrow what a process sees of a node's accelerators.
VISIBILITY_ENV = {"xpu": ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "ONEAPI_DEVICE_SELECTOR"),
                  "cuda": ("CUDA_VISIBLE_DEVICES",)}
# ... and those of them that a launcher sets per rank (ONEAPI_DEVICE_SELECTOR is the module's, for all)
RANK_MASK_ENV = {"xpu": ("ZE_AFFINITY_MASK",), "cuda": ("CUDA_VISIBLE_DEVICES",)}


class DeviceBindingError(RuntimeError):
    """A rank does not see the one device it should (no device, too few for the ranks of its node,
    or another than asked for). The message names the host, the rank, the visibility variables
    and the devices the rank sees."""


def binding_index(device_type: str, local_rank: int, local_world: int | None, names: Sequence[str], *,
                  rank: int = 0, env: Mapping[str, str] | None = None, host: str | None = None) -> int:
    """The device index local rank ``local_rank`` of ``local_world`` ranks on its node trains on,
    given the devices it sees (``names``, one per index), or DeviceBindingError.

    One visible device under a per-rank mask (ZE_AFFINITY_MASK, CUDA_VISIBLE_DEVICES), or with
    one rank on the node: it is this rank's own, index 0. Otherwise the node's devices are shared
    out by local rank, as ALCF's PyTorch page does under ZE_FLAT_DEVICE_HIERARCHY=FLAT (each tile
    a device): index ``local_rank``, which must exist, and there must be a device for every rank
    of the node (two ranks on one device would run, slowly, until the memory runs out).
    ``local_world`` None: the launcher did not say, so only the local rank is checked.

    >>> binding_index("xpu", 5, 12, [f"tile {i}" for i in range(12)])
    5
    >>> binding_index("xpu", 5, 12, ["tile 5"], env={"ZE_AFFINITY_MASK": "5"})
    0
    """
    env = {} if env is None else env
    n = len(names)
    masked = any(v in env for v in RANK_MASK_ENV.get(device_type, ()))
    if n == 1 and (masked or local_world in (None, 1)):
        return 0
    if n > 1 and n > local_rank and (local_world is None or n >= local_world):
        return local_rank
    shown = ", ".join(f"{v}={env[v]}" for v in VISIBILITY_ENV.get(device_type, ()) if v in env) or "no mask set"
    seen = "; ".join(f"{i}: {name}" for i, name in enumerate(names)) or "none"
    if n == 0:
        why = f"it sees no {device_type} device"
    elif local_world is not None and n < local_world:
        why = f"{local_world} ranks on this node share {n} visible {device_type} devices"
    else:
        why = f"local rank {local_rank} has no device of its own ({n} visible)"
    raise DeviceBindingError(
        f"host {host or socket.gethostname()}, rank {rank} (local rank {local_rank} of {local_world or '?'}): {why}; "
        f"{shown}; devices seen: {seen}. Each rank needs its own device: one rank per device (tile) of the "
        f"node, and no mask that hides the rank's device (under ZE_FLAT_DEVICE_HIERARCHY=FLAT a mask is a flat "
        f"index such as ZE_AFFINITY_MASK=<local rank>, not <gpu>.<tile>)")


def visible_devices(device_type: str) -> list[str]:
    """The names of the ``device_type`` devices this process sees, by index."""
    if device_type == "cpu":
        return []
    module = getattr(torch, device_type)
    return [module.get_device_name(i) for i in range(module.device_count())]
