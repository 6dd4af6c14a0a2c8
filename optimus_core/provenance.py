"""Where a result came from: git revision, host, hardware, library versions (for store attrs)."""
from __future__ import annotations

import datetime as _dt
import platform
import socket
import subprocess
from pathlib import Path

import torch


def git_revision(path: Path | None = None) -> str:
    """The commit of the checkout this code runs from, with ``-dirty`` if it has local changes."""
    where = path or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{rev}-dirty" if dirty else rev
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def describe(device_name: str) -> dict:
    return {
        "git_rev": git_revision(),
        "host": socket.gethostname(),
        "hardware": device_name,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def software(device_type: str, backend: str) -> dict:
    """The stack a run trained on, for its meta.json and store attrs: torch (and where it was
    imported from: the frameworks module's, or a venv's), triton, the device runtime and the
    collective backend with its version where torch says it, and Intel's extensions if loaded."""
    import importlib.metadata
    import sys

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = {"torch": torch.__version__, "torch_path": str(Path(torch.__file__).parent), "triton": triton_version,
           "device_type": device_type, "backend": backend}
    if device_type == "cuda":
        out["cuda"] = torch.version.cuda
        if backend == "nccl":
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    elif device_type == "xpu":
        out["xpu"] = getattr(torch.version, "xpu", None)  # the SYCL runtime torch was built with
    for dist in ("intel-extension-for-pytorch", "oneccl-bind-pt", "pytorch-triton-xpu"):
        if dist.replace("-", "_") in sys.modules or version(dist):
            out[dist] = version(dist)
    return out
