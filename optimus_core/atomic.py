"""Atomic outputs: a reader sees the old content or the complete new one, never a partial file.

The house rule: every output is written atomically and an interrupted writer leaves nothing that
looks finished. Two tools cover every case in the pipeline:

    from optimus_core.atomic import atomic_write, atomic_dir

    atomic_write(run_dir / "meta.json", json.dumps(meta))      # one file: bytes or str

    with atomic_dir(out_dir) as tmp:                           # a whole directory
        (tmp / "a.npy").write_bytes(...)                       # build it freely inside tmp
    # here out_dir holds exactly what was built; on an exception out_dir is untouched

Temporary names start with a dot and contain ``.tmp-`` (``.meta.json.tmp-1a2b3c``), so globs
over outputs never match them, and they sit in the same directory as the target because
``rename`` is only atomic within one filesystem. Those names are ours, not the user's: a write
refused for want of permission (or on a read-only file system) is re-raised naming the output
asked for (``cannot write`` that path), never its temporary sibling.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator, Union

__all__ = ["atomic_write", "atomic_open", "atomic_dir", "fsync_dir", "sweep_dead_builds", "NOT_WRITABLE", "NO_SPACE"]

NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # a write refused: permission, read-only file system
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a write that ran out of room: the disk's or the quota's


@contextlib.contextmanager
def _naming(path: Path, tmp: Union[str, Path, None] = None) -> Iterator[None]:
    """A write refused (NOT_WRITABLE) inside the block names ``path``: a temporary sibling of it
    (``.<name>.tmp-*`` / ``.<name>.old-*``) is ``path`` itself, a file inside ``tmp`` (the
    directory being built) is the same file under ``path``; so is a write out of room (NO_SPACE),
    and one that names no file names ``path``. Other errors pass as they are."""
    try:
        yield
    except OSError as e:
        if e.errno in NO_SPACE and e.filename is None:  # a plain write() says no path: the output's
            raise type(e)(e.errno, e.strerror, os.fspath(path)) from e
        if e.errno not in NOT_WRITABLE + NO_SPACE or e.filename is None:
            raise
        name = os.fspath(e.filename)
        if tmp is not None and (name == os.fspath(tmp) or name.startswith(os.fspath(tmp) + os.sep)):
            name = os.fspath(path) + name[len(os.fspath(tmp)):]
        elif Path(name).name.startswith((f".{path.name}.tmp-", f".{path.name}.old-")):
            name = os.fspath(path)
        else:
            raise
        raise type(e)(e.errno, e.strerror, name) from e


def fsync_dir(path: Union[str, Path]) -> None:
    """Flush a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: Union[str, Path], mode: str = "wb") -> Iterator:
    """Open a temporary sibling of ``path`` for writing; on a clean exit it replaces ``path``.

    ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8). On an exception the temporary file is removed
    and ``path`` keeps its old content (or stays absent).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open mode = {mode!r}: must be 'wb' or 'w'")
    path = Path(path)
    if path.is_dir():  # os.replace would fail only after the whole file is written (naming its temporary)
        raise FileExistsError(f"{path} is a directory, not a file: nothing was written to it")
    with _naming(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        with _naming(path):
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs are ordinary files
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write(path: Union[str, Path], data: Union[bytes, str]) -> None:
    """Write ``data`` (bytes, or str as UTF-8) to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_dir(path: Union[str, Path]) -> Iterator[Path]:
    """Build a directory in a temporary sibling and publish it as ``path`` on a clean exit.

    Yields the (empty) temporary directory. On success an existing ``path`` is replaced only
    after the new content is complete and synced; on an exception the temporary directory is
    deleted and ``path`` is untouched. Replacing is two renames (old aside, new in), so a crash
    between them leaves ``path`` absent plus a hidden ``.<name>.old-*`` sibling, never a mix.
    The temporary directory's name holds its builder's process id and host: a build killed
    before its cleanup (kill -9, a node lost) is swept by the next build of ``path`` on that host
    (sweep_dead_builds), never one whose process is alive.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_builds(path)
    with _naming(path):
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}@{socket.gethostname()}.",
                                    dir=path.parent))
    try:
        with _naming(path, tmp):
            yield tmp
            _sync_tree(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700
            old = None
            if path.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.replace(path, old / path.name)
            os.replace(tmp, path)
            fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sweep_dead_builds(path: Union[str, Path]) -> list[Path]:
    """Remove the temporary directories ``atomic_dir(path)`` left behind on this host whose
    builder process is gone (killed before its cleanup); returns what was removed. A directory
    of another host, of a live process, or of a name it did not make is left alone."""
    path, host, removed = Path(path), socket.gethostname(), []
    prefix = f".{path.name}.tmp-"
    for tmp in path.parent.glob(prefix + "*@*"):
        pid, _, rest = tmp.name[len(prefix):].partition("@")
        owner_host = rest.rpartition(".")[0]
        if not pid.isdigit() or owner_host != host or _alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (the content must be durable before the
    rename that publishes it, or a crash could publish a directory of empty files)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
