"""The paper's window order drawn once into a file that every rank memory-maps.

    path = write_order(windows, seed=42, epoch=0)     # <tokens>/window-order/train-s2048-seed42-e0-<id>.npy
    order = read_order(windows, seed=42, epoch=0)     # the same numbers, memory-mapped; None if no file

Drawn on each rank, the order of OLMoE-mix's ~2e9 windows of 2048 tokens would take ~15 GiB of
every rank's memory and minutes of its start (optimus_core.data.windows); the authors draw theirs
once, offline. The file holds exactly ``np.random.RandomState(seed)``'s ``(epoch + 1)``-th
permutation of the split's window numbers (the loader's order), as uint32 where the windows
number fewer than 2**32 (4 bytes a window), and a rank reads only the positions it takes. Its
name carries the split, the window length, the seed, the epoch and a digest of the windows'
layout (each file's path and token count, in the manifest's order): a file drawn for other data
is never picked up, and the loader draws in memory where no file matches.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from optimus_core.data.windows import FileWindows

DIRNAME = "window-order"


def layout_id(windows: "FileWindows") -> str:
    """16 hex digits naming the windows' layout: the split's files, their token counts, seq_len."""
    text = "\n".join(f"{path}\t{n}" for path, n in windows.files) + f"\n{windows.seq_len}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def order_path(windows: "FileWindows", seed: int, epoch: int) -> Path:
    return (windows.root / DIRNAME /
            f"{windows.split}-s{windows.seq_len}-seed{seed}-e{epoch}-{layout_id(windows)}.npy")


def draw_order(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The loader's order of epoch ``epoch``: the generator's (epoch + 1)-th permutation."""
    rng = np.random.RandomState(seed)
    for _ in range(epoch + 1):
        order = rng.permutation(n_windows)
    return order


def read_order(windows: "FileWindows", seed: int, epoch: int) -> np.ndarray | None:
    """The order of ``epoch`` memory-mapped from its file, or None where no file was drawn for
    these windows. A file of the right name but the wrong length (cut short) is an error."""
    path = order_path(windows, seed, epoch)
    if not path.is_file():
        return None
    order = np.load(path, mmap_mode="r")
    if order.ndim != 1 or len(order) != len(windows):
        raise ValueError(f"{path}: {order.shape} window numbers, the {windows.split} split has {len(windows)} "
                         f"windows; delete it and draw it again (optimus window-order)")
    return order


def write_order(windows: "FileWindows", seed: int, epoch: int) -> Path:
    """Draw the order of ``epoch`` and write it (atomically: a temporary file renamed) beside the
    tokens; an existing file of the same name is kept. Returns its path."""
    path = order_path(windows, seed, epoch)
    if path.is_file():
        read_order(windows, seed, epoch)  # a damaged one is an error, not kept silently
        return path
    order = draw_order(len(windows), seed, epoch)
    order = order.astype(np.uint32 if len(windows) < 2**32 else np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, order)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
