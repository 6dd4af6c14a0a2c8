"""Stage `optimus corpus`: the text to pretrain on, in the OLMoE-mix-0924 (Dolma) layout.

Without ``from_dir`` it builds a small corpus, offline and byte-for-byte reproducible on a given
Python, from text every Python installation carries::

    <out>/prose/part-0000.json.gz ...   pydoc's documentation topics, one document per topic
    <out>/code/part-0000.json.gz ...    standard-library .py files, one document per file
    <out>/docs/part-0000.json.gz ...    their docstrings (read with ast, never imported),
                                        one document per module, class or function

Each line of a part is a Dolma record: ``id``, ``text``, ``source``, ``added``, ``metadata``.

With ``from_dir`` (a download of OLMoE-mix-0924: ``<dir>/data/<source>/**/*.json.zst`` or
``<dir>/<source>/...``) nothing is copied: ``<out>/index.json`` lists every file with its source
and size, and that index is the corpus.

Readers use :func:`list_corpus`, which accepts both kinds of directory, and
:func:`read_records`, which reads ``.jsonl``, ``.json.gz`` and ``.json.zst`` alike and reports
bad input by file and line (:class:`CorpusError`)::

    run_corpus(CorpusConfig(), CorpusInputs(), CorpusOutputs(Path("results/data/corpus")))
    for f in list_corpus(Path("results/data/corpus")):
        for record in read_records(f):
            print(f.source, f.rel, record.line, record.id, len(record.text))
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import os
import platform
import sysconfig
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import zstandard
from tqdm import tqdm

from optimus_core.atomic import atomic_dir
from optimus_core.outputs import check_output, mark_output
from optimus_core.config import ConfigError
from optimus_core.log import get_logger
from optimus_core.paths import missing

_log = get_logger(__name__)

__all__ = [
    "CorpusConfig", "CorpusInputs", "CorpusOutputs", "CorpusResult", "run_corpus",
    "CorpusError", "CorpusFile", "Record", "list_corpus", "read_records", "CORPUS_SUFFIXES", "INDEX_NAME",
]

INDEX_NAME = "index.json"
INDEX_FORMAT = "optimus-corpus-index"
CORPUS_SUFFIXES = (".jsonl", ".json.gz", ".jsonl.gz", ".json.zst", ".jsonl.zst")
# Dolma's `added`: a fixed date, not now(), so that two builds are identical.
ADDED = "2024-09-24T00:00:00.000Z"
# Directories of the standard library that are not "the library": third-party packages and
# the test suites (these also hold deliberately broken files).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class CorpusError(ValueError):
    """Bad corpus input. ``path`` and ``line`` (1-based; None for the whole file) say where.

    Pickles with its fields, so an error in a worker process reaches the parent unchanged.
    """

    def __init__(self, message: str, path: Optional[str] = None, line: Optional[int] = None):
        super().__init__(message)
        self.path, self.line = path, line

    def __reduce__(self):
        return type(self), (self.args[0], self.path, self.line)


@dataclass(frozen=True)
class CorpusConfig:
    """How much of each built-in source to take (UTF-8 bytes of text; None = all of it).

    Documents are taken until a cap is reached, so the last one may cross it.
    """

    prose_bytes: Optional[int] = None
    code_bytes: Optional[int] = 1_500_000
    docs_bytes: Optional[int] = 1_000_000
    parts: int = 4  # files per source, so that tokenizing runs in parallel
    max_file_bytes: int = 200_000  # larger stdlib files are generated tables, not code

    def __post_init__(self) -> None:
        for name in ("prose_bytes", "code_bytes", "docs_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"corpus.{name} = {value!r}: must be an integer >= 1, or null for no cap")
        for name in ("parts", "max_file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"corpus.{name} = {value!r}: must be an integer >= 1")


@dataclass(frozen=True)
class CorpusInputs:
    from_dir: Optional[Path] = None  # an OLMoE-mix download to index; None = build from stdlib
    # with from_dir: index only the files this list names (a line each: <source>/<file name>, or
    # a URL ending in them, e.g. the urls.txt the authors' scripts/generate_urls.py writes), so
    # that the windows are numbered over the files the paper trained on
    files_list: Optional[Path] = None


@dataclass(frozen=True)
class CorpusOutputs:
    out_dir: Path


@dataclass(frozen=True)
class CorpusResult:
    out_dir: Path
    indexed: bool  # True: out_dir/index.json points into from_dir; False: built here
    files: dict[str, int]  # corpus files per source
    file_bytes: dict[str, int]  # their size on disk per source
    docs: dict[str, int] = field(default_factory=dict)  # per source; built corpora only (an
    # index does not count documents: that would read terabytes)


def run_corpus(config: CorpusConfig, inputs: CorpusInputs, outputs: CorpusOutputs) -> CorpusResult:
    """Build the stdlib corpus, or index ``inputs.from_dir``; publish ``outputs.out_dir`` atomically."""
    out = Path(outputs.out_dir)
    # an index made before output markers existed says what it is; a built corpus does not (a
    # folder of the user's own .jsonl files looks the same), so only a marked one is replaced
    check_output(out, "corpus", [inputs.from_dir], recognise=lambda p: _is_index(p / INDEX_NAME))
    if inputs.from_dir is None:
        with atomic_dir(out) as tmp:
            docs = _build(config, tmp)
            mark_output(tmp, "corpus", {})
        files = list_corpus(out)
    else:
        src = Path(inputs.from_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"corpus input from_dir = {str(src)!r}: "
                                    f"{missing(src, 'directory')}")
        files = _scan(src.resolve())
        if inputs.files_list is not None:
            files = _listed(files, Path(inputs.files_list))
        with atomic_dir(out) as tmp:
            _write_index(tmp, src.resolve(), files)
            mark_output(tmp, "corpus", {"from_dir": src.resolve()})
        docs = {}
    count: dict[str, int] = {}
    size: dict[str, int] = {}
    for f in files:
        count[f.source] = count.get(f.source, 0) + 1
        size[f.source] = size.get(f.source, 0) + f.size
    return CorpusResult(out, inputs.from_dir is not None, count, size, docs)


# ----------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class CorpusFile:
    """One corpus file: its source, its path relative to the corpus root, where to read it."""

    source: str
    rel: str
    path: Path
    size: int


def list_corpus(corpus_dir: Path) -> list[CorpusFile]:
    """Every corpus file of ``corpus_dir``, sorted by (source, path).

    ``corpus_dir`` holds an ``index.json`` (an indexed download) or ``<source>/**/*.jsonl |
    .json.gz | .json.zst`` (also under ``data/``). CorpusError when nothing is found or an
    indexed file is missing or changed.
    """
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise CorpusError(f"corpus {corpus_dir}: {missing(corpus_dir, 'directory')} "
                          f"(give the directory `optimus corpus` wrote)", str(corpus_dir))
    index = corpus_dir / INDEX_NAME
    if not index.is_file():
        return _scan(corpus_dir)
    try:
        d = json.loads(index.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorpusError(f"{index}: not valid JSON ({e}); run `optimus corpus --from DOWNLOAD` again", str(index)) \
            from None
    if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
        raise CorpusError(f"{index}: not an optimus corpus index "
                          f"(format {d.get('format') if isinstance(d, dict) else None!r})", str(index))
    files = []
    try:
        root = Path(d["root"])
        for entry in d["files"]:
            path = root / entry["path"]
            if not path.is_file():
                raise CorpusError(f"{path}: listed in {index} but missing", str(path))
            if path.stat().st_size != entry["size"]:
                raise CorpusError(f"{path}: {path.stat().st_size} bytes, {index} says {entry['size']}: "
                                  "the download changed since it was indexed; run `optimus corpus` again", str(path))
            files.append(CorpusFile(entry["source"], entry["path"], path, entry["size"]))
    except (KeyError, TypeError) as e:
        raise CorpusError(f"{index}: an incomplete corpus index ({type(e).__name__}: {e}); run `optimus corpus "
                          f"--from DOWNLOAD` again", str(index)) from None
    return files


@dataclass(frozen=True)
class Record:
    """A good corpus record: its 1-based line in the file, its id and its text."""

    line: int
    id: str
    text: str


def read_records(file: CorpusFile, skipped: Optional[Counter] = None) -> Iterator[Record]:
    """The records of one corpus file, in order.

    With ``skipped`` None, bad input raises CorpusError naming the file and line. Otherwise
    bad records are counted in ``skipped`` by reason and left out; an unreadable or truncated
    archive ends the file (the records before the damage are kept). Blank lines are ignored.
    A record without an ``id`` gets ``<path>:<line>``.
    """

    n_good = n_bad = 0

    def bad(line: Optional[int], reason: str, detail: str = "") -> None:
        nonlocal n_bad
        if skipped is None:
            where = f"{file.path}:{line}" if line is not None else str(file.path)
            raise CorpusError(f"{where}: {reason}" + (f" ({detail})" if detail else ""), str(file.path), line)
        skipped[reason] += 1
        n_bad += 1

    for line, raw in _lines(file, bad):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad(line, "not UTF-8", str(e))
            continue
        except json.JSONDecodeError as e:
            bad(line, "not JSON", str(e))
            continue
        if not isinstance(record, dict):
            bad(line, "not a JSON object")
            continue
        text = record.get("text")
        if not isinstance(text, str):
            bad(line, "no 'text' string", f"text is {type(text).__name__}")
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate escaped as \ud800 in the JSON
            bad(line, "not UTF-8", str(e))
            continue
        ident = record.get("id")
        n_good += 1
        yield Record(line, str(ident) if ident is not None else f"{file.rel}:{line}", text)
    if n_good == 0 and n_bad == 0:
        bad(None, "empty file", "no records")


def _lines(file: CorpusFile, bad) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of the non-blank lines; a read error is reported through ``bad``."""
    n = 0
    try:
        rest = b""
        for block in _blocks(file.path):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                n += 1
                if raw.strip():
                    yield n, raw
        if rest.strip():
            yield n + 1, rest
    except (OSError, EOFError, zstandard.ZstdError) as e:  # gzip.BadGzipFile is an OSError
        bad(n + 1, "unreadable or truncated file", f"{type(e).__name__}: {e}")


def _blocks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    """The decompressed bytes of a .jsonl, .gz or .zst file, block by block."""
    with open(path, "rb") as raw:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw) as gz:  # raises EOFError when truncated
                while block := gz.read1(size):  # read1: the data before a truncation comes out
                    yield block
        elif path.name.endswith(".zst"):
            yield from _zstd_blocks(raw, size)
        else:
            while block := raw.read(size):
                yield block


def _zstd_blocks(raw, size: int) -> Iterator[bytes]:
    # Frame by frame, because zstandard's stream_reader returns a truncated file's data short
    # without an error; here a file that ends inside a frame raises.
    dctx = zstandard.ZstdDecompressor()
    frame, pending = None, b""
    while data := pending or raw.read(size):
        frame = frame or dctx.decompressobj()
        if block := frame.decompress(data):
            yield block
        pending, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise zstandard.ZstdError("the file ends inside a zstd frame")


def _scan(root: Path) -> list[CorpusFile]:
    base = root / "data" if (root / "data").is_dir() else root
    files, passed_over = [], []
    for path in sorted(base.iterdir()):  # a file beside the source directories is in none
        if path.is_file() and not path.name.startswith("."):
            passed_over.append(path)
    for source_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for path in sorted(source_dir.rglob("*")):
            rel = path.relative_to(root)
            if not path.is_file() or any(part.startswith(".") for part in rel.parts):  # .cache, temp files
                continue
            if path.name.endswith(CORPUS_SUFFIXES):
                files.append(CorpusFile(source_dir.name, rel.as_posix(), path, path.stat().st_size))
            else:
                passed_over.append(path)
    if passed_over:
        shown = ", ".join(str(p.relative_to(root)) for p in passed_over[:3])
        _log.warning("%s: %d file(s) not read: not *%s under a source directory (%s%s)", root, len(passed_over),
                     "|*".join(CORPUS_SUFFIXES), shown, ", ..." if len(passed_over) > 3 else "")
    if not files:
        raise CorpusError(f"{root}: no corpus files; expected <dir>/<source>/*{'|*'.join(CORPUS_SUFFIXES)} "
                          f"(or the same under <dir>/data/), or an {INDEX_NAME} written by `optimus corpus`",
                          str(root))
    return files


def _listed(files: list[CorpusFile], files_list: Path) -> list[CorpusFile]:
    """The ``files`` that ``files_list`` names (CorpusInputs.files_list), in the corpus's order;
    a listed file that is not there is a CorpusError naming it, files not listed are left out
    with a warning counting them."""
    try:
        lines = [line.strip() for line in files_list.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"files list {files_list}: cannot be read ({e})", str(files_list)) from None
    wanted = ["/".join(line.rstrip("/").split("/")[-2:]) for line in lines if line and not line.startswith("#")]
    if not wanted:
        raise CorpusError(f"files list {files_list}: names no file (a line each: <source>/<file> or its URL)",
                          str(files_list))
    by_name = {f"{f.source}/{Path(f.rel).name}": f for f in files}
    missing = [name for name in wanted if name not in by_name]
    if missing:
        raise CorpusError(f"files list {files_list}: {len(missing)} listed file(s) not in the corpus, e.g. "
                          f"{', '.join(missing[:3])}", str(files_list))
    keep = set(wanted)
    left = [f for name, f in by_name.items() if name not in keep]
    if left:
        _log.warning("%d corpus file(s) not in %s left out (e.g. %s)", len(left), files_list,
                     ", ".join(f.rel for f in left[:3]))
    return [f for f in files if f"{f.source}/{Path(f.rel).name}" in keep]


def _is_index(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == INDEX_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _write_index(out: Path, root: Path, files: list[CorpusFile]) -> None:
    index = {"format": INDEX_FORMAT, "version": 1, "root": str(root),
             "files": [{"path": f.rel, "source": f.source, "size": f.size} for f in files]}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- building

Doc = tuple[str, str, dict]  # id, text, metadata


def _build(config: CorpusConfig, out: Path) -> dict[str, int]:
    files = _stdlib_files(config.max_file_bytes)
    sources = {
        "prose": (_prose_docs(), config.prose_bytes),
        "code": (_code_docs(files), config.code_bytes),
        "docs": (_docstring_docs(files), config.docs_bytes),
    }
    counts = {}
    for source, (docs, cap) in tqdm(sources.items(), desc="corpus", unit="source", disable=None):
        taken = sorted(_take(docs, cap))
        _write_parts(out / source, source, taken, config.parts)
        counts[source] = len(taken)
    return counts


def _take(docs: Iterable[Doc], cap: Optional[int]) -> list[Doc]:
    taken, total = [], 0
    for doc in docs:
        if cap is not None and total >= cap:
            break
        taken.append(doc)
        total += len(doc[1].encode("utf-8"))
    return taken


def _stdlib_files(max_bytes: int) -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, in a fixed order that spreads
    over the whole library (sorted by a hash of the path), so a cap does not stop at 'a...'."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.stat().st_size <= max_bytes:
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found, key=lambda f: hashlib.blake2b(f[0].encode(), digest_size=8).digest())


def _read_utf8(path: Path) -> Optional[str]:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:  # a few legacy modules declare latin-1; not worth a special case
        return None


def _prose_docs() -> Iterator[Doc]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"prose/{name}", topics[name], {"topic": name}


def _code_docs(files: list[tuple[str, Path]]) -> Iterator[Doc]:
    for rel, path in files:
        text = _read_utf8(path)
        if text and text.strip():
            yield f"code/{rel}", text, {"path": rel}


def _docstring_docs(files: list[tuple[str, Path]]) -> Iterator[Doc]:
    for rel, path in files:
        text = _read_utf8(path)
        if text is None:
            continue
        try:
            with warnings.catch_warnings():  # invalid escapes in old modules are not our concern
                warnings.simplefilter("ignore")
                tree = ast.parse(text, filename=rel)
        except SyntaxError:
            continue
        module = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        seen: dict[str, int] = {}
        for qualname, doc in _docstrings(tree, module):
            seen[qualname] = seen.get(qualname, 0) + 1
            # a name defined twice (in if/else branches) gets #2, #3... to keep ids unique
            ident = qualname if seen[qualname] == 1 else f"{qualname}#{seen[qualname]}"
            yield f"docs/{ident}", doc, {"path": rel, "qualname": qualname}


_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(node: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of ``node`` and every module / class / function below it."""
    if isinstance(node, (ast.Module, *_DEFS)):
        doc = ast.get_docstring(node, clean=True)
        if doc and doc.strip():
            yield qualname, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFS):
            yield from _docstrings(child, f"{qualname}.{child.name}")
        elif not isinstance(child, ast.expr):  # if / try / with blocks hold definitions too
            yield from _docstrings(child, qualname)


def _write_parts(out: Path, source: str, docs: list[Doc], parts: int) -> None:
    """Split ``docs`` (in order) into up to ``parts`` contiguous files of similar text size."""
    out.mkdir(parents=True)
    sizes = [len(text.encode("utf-8")) for _, text, _ in docs]
    total = max(1, sum(sizes))
    groups: dict[int, list[Doc]] = {}
    before = 0
    for doc, size in zip(docs, sizes):
        groups.setdefault(min(parts - 1, before * parts // total), []).append(doc)
        before += size
    meta = {"python": platform.python_version(), "license": "PSF-2.0"}
    for number, key in enumerate(sorted(groups)):
        lines = [json.dumps({"id": ident, "text": text, "source": source, "added": ADDED,
                             "metadata": {**extra, **meta}}, ensure_ascii=False) + "\n"
                 for ident, text, extra in groups[key]]
        _write_gzip(out / f"part-{number:04d}.json.gz", "".join(lines).encode("utf-8"))


def _write_gzip(path: Path, data: bytes) -> None:
    # mtime=0 and no file name in the header: the same data gives the same bytes on every run
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        gz.write(data)
    path.write_bytes(buf.getvalue())
