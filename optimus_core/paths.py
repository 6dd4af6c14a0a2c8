"""How a path the user gave is not what a command needs: the end of a one-line error.

    if not Path(path).is_file():
        raise FileNotFoundError(f"--measured {path}: {missing(path, 'file')} (a JSON-lines file ...)")
"""
from __future__ import annotations

from pathlib import Path


def missing(path, kind: str) -> str:
    """'no such file' / 'no such directory' where nothing of that kind is at ``path``, or what is
    there instead: 'is a directory, not a file' (``kind`` "file"), 'is a file, not a directory'
    (``kind`` "directory"). Call it where ``path`` is not the ``kind`` asked for."""
    if kind == "file":
        return "is a directory, not a file" if Path(path).is_dir() else "no such file"
    if kind == "directory":
        return "is a file, not a directory" if Path(path).exists() else "no such directory"
    raise ValueError(f"kind = {kind!r}: must be 'file' or 'directory'")
