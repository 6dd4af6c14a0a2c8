"""An output directory belongs to the stage that made it: a stage replaces only its own outputs.

    check_output(out, "tokenize", inputs=[corpus_dir], recognise=lambda p: (p / "manifest.json").is_file())
    with atomic_dir(out) as tmp:
        ...
        mark_output(tmp, "tokenize", {"corpus_dir": corpus_dir})

``check_output`` runs before any work and refuses (``OutputRefused``, one line naming the path and
what is there) an ``--out`` that is a file, a directory holding anything that is not a previous
output of the same stage, or a path equal to, inside or around one of the stage's inputs (a
replace would delete the input, or write into it). A previous output carries a marker file,
``.optimus-output.json`` (the stage and its inputs; no time, so two builds stay byte-identical),
which ``mark_output`` writes into the directory being built. Outputs made before markers existed
are recognised by ``recognise`` where their contents say what they are unambiguously (a token
directory's manifest), and otherwise refused: nothing that might be the user's is replaced on a
guess. The replace itself stays atomic (optimus_core.atomic.atomic_dir).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from .atomic import atomic_write

MARKER = ".optimus-output.json"


class OutputRefused(FileExistsError):
    """An output path that holds something this stage did not make, or that overlaps an input."""


def _overlap(out: Path, given: Path) -> str | None:
    if out == given:
        return "is the input"
    if given in out.parents:
        return "is inside the input"
    if out in given.parents:
        return "holds the input"
    return None


def check_output(out: str | Path, stage: str, inputs: Iterable[str | Path | None] = (),
                 recognise: Callable[[Path], bool] | None = None) -> None:
    """Refuse ``out`` for ``stage`` unless it is absent, an empty directory, or a previous output
    of ``stage`` (module doc); refuse an ``out`` that overlaps one of ``inputs`` (None skipped)."""
    out = Path(out)
    resolved = out.resolve()
    for given in inputs:
        if given is None:
            continue
        why = _overlap(resolved, Path(given).resolve())
        if why:
            raise OutputRefused(f"{stage} output {out} {why} {given}: writing it would replace or change the "
                                f"input; choose an --out outside it")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise OutputRefused(f"{stage} output {out} is a file, not a directory {stage} made: choose another --out "
                            f"(nothing was changed)")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    made_by = read_marker(out)
    if made_by is not None:
        if made_by.get("stage") == stage:
            return
        raise OutputRefused(f"{stage} output {out} is an output of `optimus {made_by.get('stage')}`, not of "
                            f"`optimus {stage}`: choose another --out (nothing was changed)")
    if recognise is not None and recognise(out):
        return
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise OutputRefused(f"{stage} output {out} holds {len(entries)} entries ({shown}) that `optimus {stage}` did "
                        f"not make: it replaces only its own outputs; choose an empty or new --out, or remove "
                        f"it yourself (nothing was changed)")


def read_marker(path: Path) -> dict | None:
    """The marker of the output at ``path``, or None (none, or unreadable)."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _marker_text(stage: str, inputs: dict) -> str:
    return json.dumps({"stage": stage, "inputs": {k: str(v) for k, v in inputs.items() if v is not None}},
                      indent=1) + "\n"


def mark_output(tmp: str | Path, stage: str, inputs: dict) -> None:
    """Write the marker into ``tmp``, the directory being built (atomic_dir publishes it whole)."""
    (Path(tmp) / MARKER).write_text(_marker_text(stage, inputs))


def mark_output_in_place(out: str | Path, stage: str, inputs: dict) -> None:
    """Write the marker into ``out`` itself, for a stage that writes its files one at a time into
    a directory it owns (figures): atomically, so two writers of the same marker never tear it."""
    atomic_write(Path(out) / MARKER, _marker_text(stage, inputs))
