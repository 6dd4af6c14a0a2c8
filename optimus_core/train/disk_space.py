"""Checkpoints and the space they need: a write refused before it starts when it cannot fit, and
a write that runs out of space mid-way called what it is (torch.save's own message for it,
``unexpected pos``, says nothing of a disk). Either way the previous checkpoints are intact: a
step directory appears only whole (optimus_core.train.checkpoint)."""
from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

import torch


class DiskFullError(RuntimeError):
    """A checkpoint that cannot be written for want of space: the path, the bytes needed and the
    bytes free. The previous checkpoints are as they were (a step directory appears only whole)."""


def bytes_to_write(tensors: dict) -> int:
    """What this rank writes of ``tensors`` (its rows of each DTensor, every plain tensor)."""
    from ..parallel.layout import local_tensor

    total = 0
    for value in tensors.values():
        if torch.is_tensor(value):
            local = local_tensor(value)
            total += local.numel() * local.element_size()
    return total


def free_bytes(path: Path) -> int:
    """Free bytes of the file system ``path`` is (or will be) on."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def space_shortfall(root: Path, step: int, need: int, rank: int = 0) -> str | None:
    """None if checkpoint ``step`` (``need`` bytes: every rank's part, with 5 % and 64 MiB to
    spare for metadata) fits in ``root`` (a run's checkpoints directory); else the sentence that
    says what does not fit."""
    free = free_bytes(root)
    if need * 1.05 + 64 * 2**20 <= free:
        return None
    return (f"rank {rank}: no room for checkpoint step {step} in {root}: it is {need / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB are free (disk full); free space or point the run elsewhere. The previous "
            f"checkpoints are intact")


def out_of_space(e: BaseException) -> bool:
    """Whether a write failed for want of space: ENOSPC / EDQUOT anywhere in the chain, or
    torch.save's short-write message, which does not say so itself."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text or "unexpected pos" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def space_errors_named(path: Path, step: int):
    """A write that fails for want of space says so, with the path and the space left."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, DiskFullError) or not out_of_space(e):
            raise
        raise DiskFullError(f"writing checkpoint step {step} to {path} failed: the disk is full "
                            f"({free_bytes(path) / 2**30:.2f} GiB free now; {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}). The previous checkpoints are intact") from e
