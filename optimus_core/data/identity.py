"""Which tokenizer a model was trained with, checked wherever data meets a model.

    sha = trained_tokenizer(meta)                       # a checkpoint's meta.json (or None: unknown)
    manifest = check_tokenizer(data_dir, sha, "run R")  # ShardError if the data is not that tokenizer's

A run's checkpoints record the sha256 of its data's ``tokenizer.json`` (``tokenizer_sha256``);
the data given to evaluate, export or resume a run must carry the same one, or its metrics (or the
exported tokenizer) would be meaningless. ``check_tokenizer`` also hashes the data's own
``tokenizer.json`` against its manifest, so a damaged or swapped file is found before use (a few
MB: cheap). The token shards are checked by size when opened (optimus_core.data.shards), and by
sha256 with ``verify`` on request: hashing terabytes at every start would cost minutes.
"""
from __future__ import annotations

import json
from pathlib import Path

from optimus_core.data.shards import TOKENIZER_NAME, Manifest, ShardError, load_manifest, sha256_file


def trained_tokenizer(meta: dict) -> str | None:
    """The sha256 of the tokenizer a checkpoint's run trained with: recorded in its meta.json, or
    (checkpoints before it was recorded) read from the manifest of the data its config names, if
    that is still there. None where neither says."""
    if meta.get("tokenizer_sha256"):
        return meta["tokenizer_sha256"]
    path = Path(((meta.get("config") or {}).get("data") or {}).get("path") or "")
    try:
        return json.loads((path / "manifest.json").read_text())["tokenizer_sha256"] if str(path) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_tokenizer(data_dir: str | Path, expected: str | None, trained_by: str) -> Manifest:
    """``data_dir``'s manifest, once its tokenizer.json matches the manifest and, where
    ``expected`` is known, is the tokenizer ``trained_by`` (say, "run R") was trained with."""
    manifest = load_manifest(data_dir)
    path = Path(data_dir) / TOKENIZER_NAME
    if not path.is_file():
        raise ShardError(f"{path}: missing (the manifest lists it); rerun optimus tokenize")
    if sha256_file(path) != manifest.tokenizer_sha256:
        raise ShardError(f"{path}: its sha256 does not match {Path(data_dir) / 'manifest.json'}: the tokenizer "
                         f"was changed or damaged after tokenizing; rerun optimus tokenize")
    refuse_other_tokenizer(data_dir, manifest.tokenizer_sha256, expected, trained_by)
    return manifest


def refuse_other_tokenizer(data_dir: str | Path, actual: str, expected: str | None, trained_by: str) -> None:
    """ShardError unless ``actual`` (the data's tokenizer sha256, already checked against its
    file) is ``expected``, the one ``trained_by`` was trained with (None: unknown, accepted)."""
    if expected is not None and actual != expected:
        raise ShardError(f"{data_dir} was tokenized with another tokenizer (sha256 {actual[:12]}) than "
                         f"{trained_by} was trained with ({expected[:12]}): its token ids mean other text; "
                         f"give the data the run was trained on")
