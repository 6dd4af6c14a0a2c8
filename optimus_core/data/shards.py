"""The token-shard format written by ``optimus tokenize``: reading it, checking it, and the
few writers the tokenizer stage shares so that the format is defined in one place.

Layout of a data directory::

    manifest.json                        written last: its presence means "complete"
    tokenizer.json                       the tokenizer the tokens come from
    <split>/<source>/<stem>.npy          raw little-endian token ids, no header (np.memmap-able;
                                         the OLMo-core convention), EOS after every document
    <split>/<source>/<stem>.csv.gz       one header-less row per document: start,end,path,id
                                         (token offsets into the .npy, end exclusive, the token
                                         at end-1 is EOS; path = the corpus file it came from)

``split`` is ``train`` or ``val``. Use::

    m = load_manifest(data_dir)              # -> Manifest
    for f in m.files_for("val", ["code"]):
        tokens = open_tokens(m.root / f.tokens, m.dtype)
        rows = read_index(m.root / f.index)
    verify(data_dir)                         # recompute every sha256; raises ShardError
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from optimus_core.atomic import atomic_write

__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANIFEST_NAME", "TOKENIZER_NAME", "SPLITS",
    "ShardError", "IndexRow", "TokenFile", "Totals", "Manifest",
    "token_dtype", "open_tokens", "read_index", "write_index", "sha256_file",
    "load_manifest", "write_manifest", "verify",
]

FORMAT = "optimus-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")


class ShardError(ValueError):
    """A data directory is missing, incomplete, of another format, or fails its checksums."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The on-disk dtype for ids below ``vocab_size``: little-endian uint16 when every id fits
    (vocab <= 65536; a vocab padded to a multiple of 128 stays <= 65536 then), else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size = {vocab_size}: must be >= 1")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def open_tokens(path: Union[str, Path], dtype: Union[str, np.dtype]) -> np.ndarray:
    """Map a token file read-only without loading it (np.memmap; an empty file cannot be
    mapped, so it comes back as an empty array)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    try:
        size = Path(path).stat().st_size
    except FileNotFoundError:
        raise ShardError(f"{path}: missing (the manifest lists it): the token directory is incomplete; "
                         f"rerun `optimus tokenize`") from None
    if size % dtype.itemsize:  # np.memmap would say only "not a multiple of the data-type size"
        raise ShardError(f"{path}: {size} bytes, not a whole number of {dtype.name} tokens ({dtype.itemsize} bytes "
                         f"each): truncated or damaged; rerun `optimus tokenize`")
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class IndexRow(NamedTuple):
    """One document in a token file: tokens[start:end], EOS at end-1."""

    start: int
    end: int
    path: str
    id: str


def write_index(path: Union[str, Path], rows: Iterable[IndexRow]) -> None:
    """Write rows as a header-less ``start,end,path,id`` csv.gz, reproducibly (gzip mtime 0 and
    no file name in the header, so the same rows give the same bytes). Not atomic by itself:
    the tokenizer builds its whole output directory atomically."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        text = io.TextIOWrapper(gz, encoding="utf-8", newline="")
        csv.writer(text, lineterminator="\n").writerows(rows)  # csv quotes ids with commas
        text.flush()
        text.detach()


def read_index(path: Union[str, Path]) -> list[IndexRow]:
    """The rows of a ``.csv.gz`` index, in file order."""
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        return [IndexRow(int(s), int(e), p, i) for s, e, p, i in csv.reader(f)]


def sha256_file(path: Union[str, Path], chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TokenFile:
    """One token array and its index; paths are relative to the data directory."""

    split: str
    source: str
    tokens: str
    index: str
    n_tokens: int
    n_docs: int
    n_bytes: int  # UTF-8 bytes of the documents' text (bits-per-byte needs them)
    tokens_sha256: str
    index_sha256: str
    input: str  # the corpus file, relative to the corpus root
    input_sha256: str


@dataclass(frozen=True)
class Totals:
    docs: int = 0
    tokens: int = 0
    bytes: int = 0

    def __add__(self, other: "Totals") -> "Totals":
        return Totals(self.docs + other.docs, self.tokens + other.tokens, self.bytes + other.bytes)


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says. ``root`` is where it was loaded from (not serialised).

    The typed fields are what readers need; ``tokenizer``, ``split``, ``inputs``, ``skipped``
    and ``created_by`` are provenance, kept as plain JSON.
    """

    vocab_size: int
    eos_id: int
    pad_id: int
    dtype: str
    tokenizer_sha256: str
    val_fraction: float
    files: tuple[TokenFile, ...]
    tokenizer: dict = field(default_factory=dict)  # origin, special tokens, encoding options
    split: dict = field(default_factory=dict)  # how documents were assigned to train / val
    inputs: tuple = ()  # per corpus file: path, source, sha256, records, skipped by reason
    skipped: dict = field(default_factory=dict)  # {"total": n, "by_reason": {...}}
    created_by: dict = field(default_factory=dict)
    root: Optional[Path] = None

    @property
    def sources(self) -> list[str]:
        return sorted({f.source for f in self.files})

    def files_for(self, split: str, sources: Optional[Sequence[str]] = None) -> list[TokenFile]:
        """The files of ``split`` (optionally only ``sources``), sorted by path."""
        if split not in SPLITS:
            raise ValueError(f"split = {split!r}: must be one of {', '.join(SPLITS)}")
        if sources is not None:
            unknown = sorted(set(sources) - set(self.sources))
            if unknown:
                raise ValueError(f"sources = {list(sources)}: {unknown[0]!r} is not in the data "
                                 f"(known: {', '.join(self.sources)})")
        chosen = [f for f in self.files
                  if f.split == split and (sources is None or f.source in sources)]
        return sorted(chosen, key=lambda f: f.tokens)

    @property
    def totals(self) -> dict[str, dict[str, Totals]]:
        """``totals[split][source]``: documents, tokens and text bytes."""
        out: dict[str, dict[str, Totals]] = {s: {} for s in SPLITS}
        for f in self.files:
            out[f.split][f.source] = out[f.split].get(f.source, Totals()) + Totals(f.n_docs, f.n_tokens, f.n_bytes)
        return {s: dict(sorted(v.items())) for s, v in out.items()}

    def to_json(self) -> str:
        d = asdict(self)
        del d["root"]
        d["files"] = [asdict(f) for f in sorted(self.files, key=lambda f: f.tokens)]
        d["inputs"] = list(self.inputs)
        d["sources"] = self.sources
        d["totals"] = {s: {src: asdict(t) for src, t in v.items()} for s, v in self.totals.items()}
        return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **d}, indent=1, sort_keys=True) + "\n"


def write_manifest(data_dir: Union[str, Path], manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically; write it last, it marks the directory complete."""
    atomic_write(Path(data_dir) / MANIFEST_NAME, manifest.to_json())


def load_manifest(data_dir: Union[str, Path]) -> Manifest:
    """Read ``<data_dir>/manifest.json``; ShardError if it is absent or of another format."""
    root = Path(data_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ShardError(f"{path} does not exist: {root} is not a complete `optimus tokenize` output")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: not valid JSON ({e}); rerun optimus tokenize") from None
    if d.get("format") != FORMAT or d.get("version") != FORMAT_VERSION:
        raise ShardError(f"{path}: format {d.get('format')!r} version {d.get('version')!r}; "
                         f"this reader understands {FORMAT!r} version {FORMAT_VERSION}")
    return Manifest(
        vocab_size=d["vocab_size"], eos_id=d["eos_id"], pad_id=d["pad_id"], dtype=d["dtype"],
        tokenizer_sha256=d["tokenizer_sha256"], val_fraction=d["val_fraction"],
        files=tuple(TokenFile(**f) for f in d["files"]), tokenizer=d.get("tokenizer", {}),
        split=d.get("split", {}),
        inputs=tuple(d.get("inputs", ())), skipped=d.get("skipped", {}),
        created_by=d.get("created_by", {}), root=root,
    )


def verify(data_dir: Union[str, Path]) -> Manifest:
    """Check every file against the manifest (size and sha256); ShardError names the first
    file that differs. Returns the manifest."""
    m = load_manifest(data_dir)
    itemsize = np.dtype(m.dtype).itemsize
    checks = [(TOKENIZER_NAME, m.tokenizer_sha256, None)]
    for f in m.files:
        checks += [(f.tokens, f.tokens_sha256, f.n_tokens * itemsize), (f.index, f.index_sha256, None)]
    for rel, expected, size in checks:
        path = m.root / rel
        if not path.is_file():
            raise ShardError(f"{path}: listed in the manifest but missing")
        if size is not None and path.stat().st_size != size:
            raise ShardError(f"{path}: {path.stat().st_size} bytes, the manifest says {size}")
        actual = sha256_file(path)
        if actual != expected:
            raise ShardError(f"{path}: sha256 {actual} does not match the manifest ({expected})")
    return m
