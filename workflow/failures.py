"""A failure the user causes and can fix, said in one line; outputs refused before any work.

A configuration or usage error exits 2 (it fails wherever it runs), an input or environment
error 1 (bad data, an output that cannot be written, a device that is not here); the line names
the user's path, never a temporary one. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

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


def check_file_output(path, flag: str, example: str | None, *, inputs: Iterable[tuple[str, Any]] = (),
                      ours: Callable[[Path], bool] | None = None) -> None:
    """Refuse, before any work, a one-file output (``flag``) that replacing would lose something:
    a directory (``example``: a file name to suggest in it; None: the path is a default, and
    another --out is the way out); the path of an input or one inside it (``inputs``: (flag,
    path) pairs, such as ("--store", store); a path None is no input); an existing file this
    command did not write (``ours`` recognises its own by their contents; an empty file holds
    nothing to lose). Each refusal is a FileExistsError of one line, and nothing is changed."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        hint = f"give a file path (such as {path / example})" if example else "pass --out FILE"
        raise FileExistsError(f"{flag} {path} is a directory; this output is one file: {hint} (nothing was changed)")
    out = path.resolve()
    for name, given in inputs:
        if given is None:
            continue
        inp = Path(given).resolve()
        if out == inp or inp in out.parents:
            where = "is" if out == inp else "lies inside"
            raise FileExistsError(f"{flag} {path} {where} the input {name} {given}: writing it would damage the "
                                  f"input (nothing was changed); choose a path outside it")
    if ours is not None and path.is_file() and path.stat().st_size and not ours(path):
        raise FileExistsError(f"{flag} {path} exists and is not an output of this command: it would be replaced "
                              f"(nothing was changed); remove it or choose another path")


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
        from optimus_core.atomic import NO_SPACE

        if e.errno in NO_SPACE and e.filename is not None:
            return 1, (f"{said}error: no space left writing {e.filename} ({e.strerror}): free space there, or "
                       f"give an --out on another file system; nothing unfinished was published")
        return None
    space = sys.modules.get("optimus_core.train.disk_space")
    if space is not None and isinstance(e, space.DiskFullError):  # a checkpoint's: its path and bytes
        return 1, f"{said}error: {e}"
    resilience = sys.modules.get("optimus_core.train.resilience")
    if resilience is not None and isinstance(e, resilience.Diverged):  # training cannot go on: says what to change
        return 1, f"{said}error: {e}"
    faults = sys.modules.get("optimus_core.train.node_faults")
    if faults is not None and isinstance(e, faults.NodeFault):  # a node's hardware: rerun without it
        return e.exit_code, f"{said}error: {e}"
    if isinstance(e, RuntimeError):  # the device asked for is not here: the environment (valid elsewhere)
        device = sys.modules.get("optimus_core.device")  # not imported: not its error (and no torch import)
        if device is not None and isinstance(e, (device.DeviceUnavailableError, device.DeviceBindingError)):
            return 1, f"{said}error: {e}"
    return None


def json_with(*keys: str) -> Callable[[Path], bool]:
    """``ours`` for a JSON output: a JSON object holding ``keys``; for JSON lines (any suffix but
    .json), lines of JSON objects of which one of the first 100 holds them."""
    def recognise(path: Path) -> bool:
        try:
            with open(path, encoding="utf-8") as f:
                if path.suffix == ".json":
                    values = [json.loads(f.read())]
                else:
                    values = [json.loads(line) for line, _ in zip(f, range(100)) if line.strip()]
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return (all(isinstance(v, dict) for v in values)
                and any(all(k in v for k in keys) for v in values))
    return recognise


def is_report(path: Path) -> bool:
    """``ours`` for `optimus report`: a markdown title, then the line that says it was written
    from a results store (stages.report)."""
    try:
        with open(path, encoding="utf-8") as f:
            head = [f.readline() for _ in range(3)]
    except (OSError, UnicodeDecodeError):
        return False
    return head[0].startswith("# ") and head[2].startswith("Written from the results store")
