"""Devices and their collective backends: cpu (gloo), cuda (nccl), xpu (xccl, torch >= 2.8).

Intel's intel-extension-for-pytorch and oneccl-bindings-for-pytorch are end-of-life upstream:
they are imported only where installed (older Aurora stacks) and only when torch's own xccl is
missing; nothing requires them.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

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


def resolve_device_type(requested: str = "auto") -> str:
    """``auto`` picks cuda, then xpu, then cpu; an explicit request that cannot be met is an error."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "xpu": has_xpu()}
    if requested == "auto":
        return next(t for t in ("cuda", "xpu", "cpu") if available[t])
    if requested not in available:
        raise ValueError(f"device = {requested!r}: must be one of auto, cpu, cuda, xpu")
    if not available[requested]:
        raise RuntimeError(f"device = {requested!r} requested but torch sees no {requested} device")
    return requested


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


def import_vendor_extensions(device_type: str, backend: str) -> None:
    """Import the Intel extensions only where they are installed and actually needed."""
    if device_type == "xpu" and importlib.util.find_spec("intel_extension_for_pytorch") is not None:
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


def peak_flops_for(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def device_info(requested: str = "auto", index: int = 0) -> DeviceInfo:
    dtype = resolve_device_type(requested)
    name = device_name(dtype, index)
    return DeviceInfo(dtype, name, collective_backend(dtype), None if dtype == "cpu" else peak_flops_for(name))
