"""Checkpoints: one directory per step, checksummed, published atomically, ``latest`` written last.

    run_dir/checkpoints/step_000120/   model.pt  optim.pt  state.pt  meta.json
    run_dir/checkpoints/latest         "step_000120"

``meta.json`` holds the resolved config, step, tokens seen, the data-loader position and the
sha256 of every file; ``state.pt`` the RNG states. A step directory appears only complete
(optimus_core.atomic.atomic_dir), and ``latest`` moves only after it, so a crash mid-save never
leaves a ``latest`` pointing at a partial checkpoint. On load, a checkpoint whose files are
missing or fail their checksum is skipped with a warning and the previous one is used.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import atomic_dir, atomic_write

STEP_DIR = re.compile(r"^step_(\d{6,})$")
FILES = ("model.pt", "optim.pt", "state.pt")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Checkpoint:
    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def load_model_state(self, map_location="cpu") -> dict:
        return torch.load(self.path / "model.pt", map_location=map_location, weights_only=True)

    def load_optim_state(self, map_location="cpu") -> dict:
        return torch.load(self.path / "optim.pt", map_location=map_location, weights_only=True)

    def load_state(self) -> dict:
        return torch.load(self.path / "state.pt", map_location="cpu", weights_only=False)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, *, model_state: dict, optim_state: dict, state: dict,
                    meta: dict, keep: int = 2, keep_every: int = 0) -> Path:
    """Write checkpoint ``step`` and point ``latest`` at it; keep the newest ``keep`` and, for
    the evaluation curves of a long run, every step that is a multiple of ``keep_every``."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    with atomic_dir(final) as tmp:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optim_state, tmp / "optim.pt")
        torch.save(state, tmp / "state.pt")
        full_meta = dict(meta, step=step, files={name: _sha256(tmp / name) for name in FILES})
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True))
    atomic_write(root / "latest", final.name)
    for old in list_step_dirs(run_dir)[:-keep]:
        if not (keep_every and int(STEP_DIR.match(old.name).group(1)) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_step_dirs(run_dir: Path) -> list[Path]:
    """Step directories, oldest first (temporary and unrelated entries ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def validate(path: Path) -> dict:
    """The checkpoint's meta if every file is present and matches its checksum; else raise."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path}: no meta.json (incomplete checkpoint)")
    meta = json.loads(meta_path.read_text())
    for name in FILES:
        expected = meta.get("files", {}).get(name)
        if not (path / name).is_file():
            raise ValueError(f"{path}: {name} is missing")
        if expected is None or _sha256(path / name) != expected:
            raise ValueError(f"{path}: {name} fails its sha256 checksum")
    return meta


def latest_valid(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that validates; None if there is none.

    Step directories are published whole, so a complete one newer than ``latest`` (a crash
    between the two renames) is as good as the one ``latest`` names; checksums catch the rest.
    """
    for path in reversed(list_step_dirs(run_dir)):
        try:
            return Checkpoint(path, validate(path))
        except (ValueError, json.JSONDecodeError) as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return None
