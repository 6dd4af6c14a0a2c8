"""A failure the user causes and can fix, said in one line; outputs refused before any work.

A configuration or usage error exits 2 (it fails wherever it runs), an input or environment
error 1 (bad data, an output that cannot be written, a device that is not here); the line names
the user's path, never a temporary one. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from optimus_core.config import ConfigError

INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)  # bad input: one line, exit 1


def check_writable(path: Path) -> None:
    """Refuse an output before any work where this process may not write its nearest existing
    directory (``path`` itself, or the parent it would be made in): a PermissionError naming it."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(probe))


def check_file_output(path, flag: str, example: str | None) -> None:
    """Refuse, before any work, a one-file output (``flag``) that names a directory: replacing it
    would fail at the end (or replace the user's directory). ``example``: a file name to suggest
    in it; None: the path is a default, and another --out is the way out."""
    if path is not None and Path(path).is_dir():
        hint = f"give a file path (such as {Path(path) / example})" if example else "pass --out FILE"
        raise FileExistsError(f"{flag} {path} is a directory; this output is one file: {hint} (nothing was changed)")


def _outputs(args) -> list[Path]:
    """The paths a command writes, as the user gave them (figures and report only read the store)."""
    names = ("out", "shards", "jsonl") + (() if args.command in ("figures", "report") else ("store",))
    paths = [Path(getattr(args, name)) for name in names if getattr(args, name, None)]
    if args.command == "evaluate" and not args.out:
        paths.append(Path(args.run) / "eval.json")
    return paths


def not_writable_message(e: OSError, args) -> str:
    """One sentence for a write refused (permission, a read-only file system), naming the user's
    path: the output asked for when the refused path is it or a directory made for it, the file
    inside it otherwise (optimus_core.atomic names its own temporary siblings as their target)."""
    why = "read-only file system" if e.errno == errno.EROFS else "permission denied"
    refused = os.path.abspath(e.filename)
    for out in _outputs(args):
        full = os.path.abspath(out)
        if refused == full or full.startswith(refused.rstrip(os.sep) + os.sep):
            return f"cannot write {out}: {why}"
        if refused.startswith(full + os.sep):
            return f"cannot write {e.filename}: {why}"
    return f"cannot access {e.filename}: {why}"


def check_site_use(args) -> None:
    """A --site is where --launcher parsl runs: without it, it would be ignored, so say so."""
    if getattr(args, "site", None) and getattr(args, "launcher", "parsl") != "parsl":
        raise ConfigError(f"--site {args.site} is used only with --launcher parsl (this command runs here)")


def user_failure(args, e: BaseException) -> tuple[int, str] | None:
    """(exit status, the one line) of a failure the user causes and can fix (the module doc);
    None for anything else, a bug, which keeps its traceback."""
    said = f"optimus {args.command}: "
    if isinstance(e, ConfigError):
        return 2, f"{said}configuration error: {e}"
    if isinstance(e, INPUT_ERRORS):
        return 1, f"{said}error: {e}"
    if isinstance(e, OSError):  # a write refused: the environment, not a bug
        from optimus_core.atomic import NOT_WRITABLE

        if e.errno in NOT_WRITABLE and e.filename is not None:
            return 1, f"{said}error: {not_writable_message(e, args)}"
        return None
    resilience = sys.modules.get("optimus_core.train.resilience")
    if resilience is not None and isinstance(e, resilience.Diverged):  # training cannot go on: says what to change
        return 1, f"{said}error: {e}"
    if isinstance(e, RuntimeError):  # the device asked for is not here: the environment (valid elsewhere)
        device = sys.modules.get("optimus_core.device")  # not imported: not its error (and no torch import)
        if device is not None and isinstance(e, (device.DeviceUnavailableError, device.DeviceBindingError)):
            return 1, f"{said}error: {e}"
    return None
