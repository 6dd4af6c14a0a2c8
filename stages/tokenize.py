"""Stage `optimus tokenize`: Dolma JSONL in, the token-shard format out.

::

    run_tokenize(TokenizeConfig(workers=4),
                 TokenizeInputs(corpus_dir=Path("results/data/corpus"), tokenizer=None),
                 TokenizeOutputs(out_dir=Path("results/data/tokens")))

One task per corpus file, run by ``workers`` processes. Each document is encoded with a Hugging
Face tokenizer (the given ``tokenizer.json``, or a byte-level BPE trained here on the train
split), followed by EOS, and goes to ``train`` or ``val`` by a hash of its id. The output layout
and manifest are defined in :mod:`optimus_core.data.shards`; the whole directory is built
beside ``out_dir`` and published in one rename, with ``manifest.json`` written last.

At paper scale the same output comes from a fan-out, one task per input file, each into its own
shard directory (``tokenize_shard``; an unchanged file with the same tokenizer is not redone),
then ``merge_shards``: stages/tokenize_shards.py, built on this module's per-file core
(workflow/tokenize_fanout.py runs it through Parsl).

Bad input (unreadable or truncated archive, empty file, a line that is not UTF-8 or not a JSON
object, a record without a ``text`` string) stops the stage with a :class:`CorpusError` that
names the file and line; with ``skip_bad_records`` it is skipped and counted in the manifest.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import heapq
import itertools
import json
import multiprocessing
import os
import platform
import re
import shutil
import signal
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from optimus_core.atomic import atomic_dir
from optimus_core.outputs import check_output, mark_output
from optimus_core.config import ConfigError
from optimus_core.data.shards import (
    MANIFEST_NAME, SPLITS, TOKENIZER_NAME, Manifest, TokenFile, Totals, IndexRow, sha256_file, token_dtype,
    write_index, write_manifest,
)
from optimus_core.paths import missing
from optimus_core.log import configure_logging, get_logger
from stages.corpus import CORPUS_SUFFIXES, INDEX_NAME, CorpusError, CorpusFile, list_corpus, read_records

__all__ = ["TokenizeConfig", "TokenizeInputs", "TokenizeOutputs", "TokenizeResult", "run_tokenize",
           "CorpusError", "train_tokenizer", "load_tokenizer", "val_score"]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
_log = get_logger(__name__)
_BATCH_DOCS = 512  # documents per encode_batch call: amortises the call, bounds memory
# A document longer than this is encoded in pieces of about this many characters, cut where its
# tokens do not change (_pieces): the tokenizer's working memory grows with what it encodes at
# once (a 50 MB document took 9.3 GB whole), not with the document
_PIECE_CHARS = 1 << 20
# Train documents per file remembered as candidates for the val guarantee. Only sources far
# short of val_fraction use them, and those have a few times 1 / val_fraction documents at most.
_CANDIDATES = 64


@dataclass(frozen=True)
class TokenizeConfig:
    """How to tokenize; validated on construction (ConfigError names field, value, what is allowed)."""

    workers: int = 1  # processes; the output does not depend on it
    skip_bad_records: bool = False  # False: bad input stops the stage, naming file and line
    vocab_size: int = 4096  # of the BPE trained when no tokenizer is given
    val_fraction: float = 0.05  # of each source's documents held out, by a hash of their id
    split_seed: int = 0  # salts that hash: another seed, another held-out set
    eos_token: str = EOS_TOKEN
    pad_token: str = PAD_TOKEN
    # Training text for the BPE: at most this many bytes of train documents, taken from the
    # sources in turn. The laptop corpus is far below it; a full OLMoE-mix is far above.
    tokenizer_train_bytes: int = 100_000_000

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"tokenize.{name} = {getattr(self, name)!r}: {allowed}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        require(is_int(self.workers) and self.workers >= 1, "workers", "must be an integer >= 1")
        require(isinstance(self.skip_bad_records, bool), "skip_bad_records", "must be true or false")
        require(is_int(self.vocab_size) and self.vocab_size >= 258, "vocab_size",
                "must be an integer >= 258 (256 bytes + EOS + pad)")
        require(isinstance(self.val_fraction, (int, float)) and not isinstance(self.val_fraction, bool)
                and 0 <= self.val_fraction < 1, "val_fraction", "must be a number in [0, 1)")
        require(is_int(self.split_seed), "split_seed", "must be an integer")
        require(isinstance(self.eos_token, str) and self.eos_token != "", "eos_token", "must be a non-empty string")
        require(isinstance(self.pad_token, str) and self.pad_token != "", "pad_token", "must be a non-empty string")
        require(is_int(self.tokenizer_train_bytes) and self.tokenizer_train_bytes >= 1,
                "tokenizer_train_bytes", "must be an integer >= 1")


@dataclass(frozen=True)
class TokenizeInputs:
    corpus_dir: Path  # written by `optimus corpus` (files, or an index.json)
    tokenizer: Optional[Path] = None  # a tokenizer.json; None = train a byte-level BPE


@dataclass(frozen=True)
class TokenizeOutputs:
    out_dir: Path


@dataclass(frozen=True)
class TokenizeResult:
    out_dir: Path
    vocab_size: int
    dtype: str
    trained_tokenizer: bool
    files: int  # token files written
    totals: dict[str, dict[str, Totals]]  # [split][source] -> docs, tokens, bytes
    skipped: dict[str, int]  # bad records skipped, by reason (empty unless skip_bad_records)


def run_tokenize(config: TokenizeConfig, inputs: TokenizeInputs, outputs: TokenizeOutputs) -> TokenizeResult:
    """Tokenize every file of ``inputs.corpus_dir`` into ``outputs.out_dir`` (see the module doc)."""
    check_token_output(inputs, outputs)
    files = list_corpus(Path(inputs.corpus_dir))
    _check_unique_outputs(files)
    if inputs.tokenizer is not None:  # the user's file, named as given, before anything is built
        given = Path(inputs.tokenizer)
        if not given.is_file():
            raise FileNotFoundError(f"tokenizer {given}: {missing(given, 'file')} "
                                    f"(a Hugging Face tokenizer.json)")
        load_tokenizer(given)
    with atomic_dir(outputs.out_dir) as tmp:
        tokenizer_path = tmp / TOKENIZER_NAME
        if inputs.tokenizer is None:
            train_tokenizer(files, config).save(str(tokenizer_path))
        else:
            shutil.copyfile(inputs.tokenizer, tokenizer_path)
        tokenizer = load_tokenizer(tokenizer_path)
        eos_id, pad_id = _special_ids(tokenizer, config, inputs.tokenizer or "the trained tokenizer")
        # one past the largest id (not the count of tokens): the contract the embedding needs
        vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        job = _Job(tmp, str(tokenizer_path), eos_id, str(token_dtype(vocab_size)), config.val_fraction,
                   config.split_seed, config.skip_bad_records)
        results = _run_all(job, files, tokenizer, config.workers)
        results = _ensure_val_per_source(job, tokenizer, results)
        manifest = _manifest(config, inputs, tokenizer_path, vocab_size, eos_id, pad_id, job.dtype, results)
        mark_output(tmp, "tokenize", {"corpus_dir": inputs.corpus_dir, "tokenizer": inputs.tokenizer})
        write_manifest(tmp, manifest)  # last: the manifest marks the directory complete
    return TokenizeResult(Path(outputs.out_dir), vocab_size, job.dtype, inputs.tokenizer is None,
                          len(manifest.files), manifest.totals, dict(manifest.skipped["by_reason"]))


def check_token_output(inputs: TokenizeInputs, outputs: TokenizeOutputs) -> None:
    """Refuse an ``--out`` that is not absent, empty or a token directory (optimus_core.outputs),
    or that overlaps the corpus, the files an index points to, or the tokenizer given."""
    corpus = Path(inputs.corpus_dir)
    roots = [corpus, inputs.tokenizer]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # an index's download root
        roots.append(Path(json.loads((corpus / INDEX_NAME).read_text(encoding="utf-8"))["root"]))
    check_output(outputs.out_dir, "tokenize", roots, recognise=lambda p: (p / MANIFEST_NAME).is_file())


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(files: list[CorpusFile], config: TokenizeConfig) -> Tokenizer:
    """A byte-level BPE (GPT-2 style, no prefix space: ``decode(encode(t)) == t`` exactly) with
    ``config.eos_token`` and ``config.pad_token`` as ids 0 and 1, trained on train documents."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size, special_tokens=[config.eos_token, config.pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=sys.stderr.isatty())
    tokenizer.train_from_iterator(_training_text(files, config), trainer)
    return tokenizer


def _training_text(files: list[CorpusFile], config: TokenizeConfig) -> Iterator[str]:
    # Only train documents (held-out text must not shape the vocabulary), sources in turn so
    # that a byte cap does not fill up with the first source.
    def source_docs(source: str) -> Iterator[str]:
        for f in files:
            if f.source == source:
                skipped = Counter() if config.skip_bad_records else None  # counted by the main pass
                for r in read_records(f, skipped):
                    if val_score(r.id, config.split_seed) >= config.val_fraction:
                        yield r.text

    streams = [source_docs(s) for s in sorted({f.source for f in files})]
    budget = config.tokenizer_train_bytes
    for text in (t for group in itertools.zip_longest(*streams) for t in group if t is not None):
        yield text
        budget -= len(text.encode("utf-8"))
        if budget <= 0:
            return


def load_tokenizer(path) -> Tokenizer:
    """Load a tokenizer.json for encoding documents: text that spells a special token
    (``<|endoftext|>`` inside a document) is encoded as plain text, never as the token."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from e
    tokenizer.encode_special_tokens = True
    return tokenizer


def _special_ids(tokenizer: Tokenizer, config: TokenizeConfig, where) -> tuple[int, int]:
    ids = []
    for name in ("eos_token", "pad_token"):
        token = getattr(config, name)
        ident = tokenizer.token_to_id(token)
        if ident is None:
            raise ConfigError(f"tokenize.{name} = {token!r}: {where} has no such token; "
                              "set it to the tokenizer's own token")
        ids.append(ident)
    return ids[0], ids[1]


def val_score(doc_id: str, seed: int) -> float:
    """A document's place in [0, 1): it is held out when this is below val_fraction. A hash of
    the id, so the split does not depend on file order, worker count or the rest of the corpus."""
    digest = hashlib.blake2b(f"{seed}:{doc_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


# ----------------------------------------------------------------------------- one file

@dataclass(frozen=True)
class _Job:
    """What every task shares (picklable: it travels to the worker processes)."""

    out: Path
    tokenizer: str
    eos_id: int
    dtype: str
    val_fraction: float
    seed: int
    skip_bad_records: bool


@dataclass(frozen=True)
class _FileResult:
    input: CorpusFile
    sha256: str
    records: int
    skipped: dict[str, int]
    outputs: tuple[TokenFile, ...]
    # the lowest-scoring train documents, (val_score, line, tokens) ascending: what
    # _ensure_val_per_source may hold out when the hash held out too little of the source
    candidates: tuple[tuple[float, int, int], ...]


def _output_stem(f: CorpusFile) -> str:
    """``<source>/<path under the source directory, without the corpus suffix>``."""
    parts = PurePosixPath(f.rel).parts
    under = PurePosixPath(*parts[parts.index(f.source) + 1:]).as_posix()
    suffix = next(s for s in CORPUS_SUFFIXES if under.endswith(s))
    return f"{f.source}/{under[: -len(suffix)]}"


def _check_unique_outputs(files: list[CorpusFile]) -> None:
    seen: dict[str, str] = {}
    for f in files:
        stem = _output_stem(f)
        if stem in seen:
            raise CorpusError(f"{f.rel} and {seen[stem]} would both be tokenized to {stem}; "
                              "keep one of them", f.rel)
        seen[stem] = f.rel


class _SplitWriter:
    """The token array and index of one split of one input file, created on the first document."""

    def __init__(self, job: _Job, split: str, f: CorpusFile):
        self.job, self.split, self.input = job, split, f
        stem = f"{split}/{_output_stem(f)}"
        self.tokens, self.index = f"{stem}.npy", f"{stem}.csv.gz"
        self.dtype = np.dtype(job.dtype).newbyteorder("<")
        self.rows: list[IndexRow] = []
        self.n_bytes = 0

    def add(self, batch: list[tuple[str, int, list[int]]]) -> None:
        """Append documents (id, UTF-8 bytes, token ids), each followed by EOS."""
        path = self.job.out / self.tokens
        if not self.rows:
            path.parent.mkdir(parents=True, exist_ok=True)
        start = self.rows[-1].end if self.rows else 0
        for doc_id, n_bytes, ids in batch:
            end = start + len(ids) + 1
            self.rows.append(IndexRow(start, end, self.input.rel, doc_id))
            self.n_bytes += n_bytes
            start = end
        flat = itertools.chain.from_iterable((*ids, self.job.eos_id) for _, _, ids in batch)
        try:
            with open(path, "ab") as f:  # opened per batch: nothing stays open if the task fails
                np.fromiter(flat, dtype=self.dtype).tofile(f)
        except OSError as e:  # numpy's short write carries no errno and no path: a full disk, named
            if e.filename is not None and e.errno is not None:
                raise
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write: {e})", str(path)) from None

    def close(self, input_sha256: str) -> Optional[TokenFile]:
        """Write the index; the file's manifest entry, or None if no document came."""
        if not self.rows:
            return None
        write_index(self.job.out / self.index, self.rows)
        return TokenFile(self.split, self.input.source, self.tokens, self.index,
                         n_tokens=self.rows[-1].end, n_docs=len(self.rows), n_bytes=self.n_bytes,
                         tokens_sha256=sha256_file(self.job.out / self.tokens),
                         index_sha256=sha256_file(self.job.out / self.index),
                         input=self.input.rel, input_sha256=input_sha256)


def _tokenize_file(job: _Job, f: CorpusFile, tokenizer: Tokenizer,
                   force_val: frozenset[int] = frozenset()) -> _FileResult:
    """Encode one corpus file into its train and val outputs under ``job.out``; the documents
    on the lines ``force_val`` go to val whatever their score."""
    writers = {s: _SplitWriter(job, s, f) for s in SPLITS}
    skipped = Counter() if job.skip_bad_records else None
    records, candidates = 0, []  # a max-heap by score (negated) of at most _CANDIDATES
    for batch in _batched(read_records(f, skipped), _BATCH_DOCS):
        by_split: dict[str, list] = {s: [] for s in SPLITS}
        for r, ids in zip(batch, _encode(tokenizer, batch, f)):
            score = val_score(r.id, job.seed)
            split = "val" if score < job.val_fraction or r.line in force_val else "train"
            if split == "train":
                entry = (-score, r.line, len(ids) + 1)
                (heapq.heappush if len(candidates) < _CANDIDATES else heapq.heappushpop)(candidates, entry)
            by_split[split].append((r.id, len(r.text.encode("utf-8")), ids))
        for split, docs in by_split.items():
            if docs:
                writers[split].add(docs)
        records += len(batch)
    sha = sha256_file(f.path)
    outputs = tuple(t for t in (w.close(sha) for w in writers.values()) if t is not None)
    lowest = tuple(sorted((-neg, line, n) for neg, line, n in candidates))
    return _FileResult(f, sha, records, dict(skipped or {}), outputs, lowest)


def _encode(tokenizer: Tokenizer, batch: list, f: CorpusFile) -> list[list[int]]:
    """The token ids of each record of ``batch``: the short ones in one encode_batch call, each
    long one (over _PIECE_CHARS) piece by piece (_pieces), said in a log line as it starts."""
    ids: list = [None] * len(batch)
    short = [i for i, r in enumerate(batch) if len(r.text) <= _PIECE_CHARS]
    for i, enc in zip(short, tokenizer.encode_batch([batch[i].text for i in short], add_special_tokens=False)):
        ids[i] = enc.ids
    for i in (i for i, r in enumerate(batch) if ids[i] is None):
        pieces = list(_pieces(batch[i].text))
        _log.info("%s line %d: a document of %.1f MB, encoded in %d pieces", f.rel, batch[i].line,
                  len(batch[i].text.encode("utf-8")) / 1e6, len(pieces))
        ids[i] = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False).ids]
    return ids


def _pieces(text: str, size: int = _PIECE_CHARS):
    """``text`` cut into pieces of about ``size`` characters, each ending with a newline that a
    character other than whitespace follows: there a byte-level BPE's pre-tokenizer splits the
    whole text too (the newline ends a whitespace run, the next token starts with no space), so
    the pieces' tokens are the whole text's. A text with no such newline is one piece."""
    start = 0
    while len(text) - start > size:
        found = _CUT.search(text, start + size - 1)
        if found is None:
            break
        yield text[start:found.end()]
        start = found.end()
    yield text[start:]


_CUT = re.compile(r"\n(?=\S)")  # a newline that a character other than whitespace follows


def _batched(items, n: int):
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


_worker_tokenizer: Optional[Tokenizer] = None  # in a worker process: loaded once, by _init_worker


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    # Ctrl-C reaches the whole process group: the parent alone stops (and ends the pool), the
    # workers do not each print a KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()  # a worker's lines (a long document's) reach stderr as the parent's do
    # The processes are the parallelism; tokenizers' own threads would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _worker_task(args: tuple[_Job, CorpusFile]) -> _FileResult:
    return _tokenize_file(*args, _worker_tokenizer)


# ----------------------------------------------------------------------------- all files

def _run_all(job: _Job, files: list[CorpusFile], tokenizer: Tokenizer, workers: int) -> list[_FileResult]:
    """Tokenize every file (in this process when workers == 1) with a progress bar; results in
    input order. An error in a worker is re-raised here as itself (CorpusError pickles whole)."""
    progress = tqdm(total=len(files), desc="tokenize", unit="file", disable=None)
    results = []
    with progress:
        if workers == 1 or len(files) == 1:
            for f in files:
                results.append(_tokenize_file(job, f, tokenizer))
                progress.update()
        else:
            # spawn, not fork: the parent may run threads (torch, tokenizers) whose locks a fork
            # would copy in whatever state they are
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(min(workers, len(files)), initializer=_init_worker, initargs=(job.tokenizer,)) as pool:
                for result in pool.imap_unordered(_worker_task, [(job, f) for f in files]):
                    results.append(result)
                    progress.update()
    return sorted(results, key=lambda r: (r.input.source, r.input.rel))


def _ensure_val_per_source(job: _Job, tokenizer: Tokenizer, results: list[_FileResult]) -> list[_FileResult]:
    """Every source can be evaluated: in one of >= 2 documents whose held-out documents carry
    less than half of val_fraction of its tokens (a small source, unlucky in the hash; never
    a large one), the lowest-scoring train documents join them until they carry val_fraction
    (never all documents). Their files are tokenized again."""
    if job.val_fraction == 0:
        return results
    by_input = {r.input.rel: r for r in results}
    for source in sorted({r.input.source for r in results}):
        mine = [r for r in results if r.input.source == source]
        outputs = [t for r in mine for t in r.outputs]
        n_docs = sum(t.n_docs for t in outputs)
        target = job.val_fraction * sum(t.n_tokens for t in outputs)
        held = sum(t.n_tokens for t in outputs if t.split == "val")
        docs = sum(t.n_docs for t in outputs if t.split == "val")
        if n_docs < 2 or held >= target / 2:
            continue
        chosen: dict[str, set[int]] = {}
        for _, rel, line, n_tokens in sorted((c[0], r.input.rel, c[1], c[2]) for r in mine for c in r.candidates):
            if held >= target or docs == n_docs - 1:
                break
            chosen.setdefault(rel, set()).add(line)
            held, docs = held + n_tokens, docs + 1
        for rel, lines in chosen.items():
            for t in by_input[rel].outputs:
                (job.out / t.tokens).unlink()
                (job.out / t.index).unlink()
            by_input[rel] = _tokenize_file(job, by_input[rel].input, tokenizer, frozenset(lines))
    return [by_input[r.input.rel] for r in results]


def _manifest(config: TokenizeConfig, inputs: TokenizeInputs, tokenizer_path: Path, vocab_size: int,
              eos_id: int, pad_id: int, dtype: str, results: list[_FileResult]) -> Manifest:
    skipped = Counter()
    for r in results:
        skipped.update(r.skipped)
    return Manifest(
        vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, dtype=dtype,
        tokenizer_sha256=sha256_file(tokenizer_path), val_fraction=config.val_fraction,
        files=tuple(t for r in results for t in r.outputs),
        tokenizer={"file": TOKENIZER_NAME, "origin": "given" if inputs.tokenizer else "trained",
                   "eos_token": config.eos_token, "pad_token": config.pad_token,
                   # not stored in tokenizer.json; decode/encode elsewhere must match it
                   "encode_special_tokens": True,
                   **({"vocab_size_requested": config.vocab_size} if inputs.tokenizer is None else {})},
        split={"method": "blake2b-64", "seed": config.split_seed,
               "rule": "val when int(blake2b(f'{seed}:{id}', digest_size=8), big-endian) / 2**64 "
                       "< val_fraction; in a source of >= 2 documents whose val documents carry less "
                       "than val_fraction / 2 of its tokens, the lowest-scoring train documents join "
                       "them until they carry val_fraction (never all documents)"},
        inputs=tuple({"path": r.input.rel, "source": r.input.source, "size": r.input.size,
                      "sha256": r.sha256, "records": r.records,
                      "skipped": dict(sorted(r.skipped.items()))} for r in results),
        skipped={"total": sum(skipped.values()), "by_reason": dict(sorted(skipped.items()))},
        created_by=_created_by(),
    )


def _created_by() -> dict:
    import importlib.metadata
    import tokenizers

    try:
        version = importlib.metadata.version("optimus")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    # no dates or host names: a rerun on the same input writes the same manifest
    return {"stage": "optimus tokenize", "optimus": version, "python": platform.python_version(),
            "tokenizers": tokenizers.__version__, "numpy": np.__version__}
