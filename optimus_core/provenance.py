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
