"""The tokenize stage's per-file fan-out core: one task per corpus file, then one merge.

::

    key = shard_settings(config, tokenizer_path)           # once, where the tasks are planned
    for f in list_corpus(corpus):                           # one task each, anywhere
        tokenize_shard(config, f, tokenizer_path, key, shard_dir(shards, f))
    merge_shards(config, TokenizeInputs(corpus, tokenizer_path), shards, TokenizeOutputs(out))

Paper scale (thousands of .json.zst files) tokenizes one file per task on many nodes: each task
writes the file's outputs into its own shard directory, and ``merge_shards`` assembles the data
directory ``run_tokenize`` (stages/tokenize.py) would have written (same files, same manifest)
from the shards. workflow/tokenize_fanout.py runs the tasks through Parsl.

A shard is ``<shards>/<key of the file>/`` with the train / val layout of a data directory and
``shard.json`` written last (what the file gave: records, skipped, token files, val candidates,
and the settings it was made with). A file whose shard was made from the same input bytes
(sha256), the same tokenizer (sha256) and the same split / special-token settings is not
tokenized again. The fan-out needs a given tokenizer: training one is a pass over everything.
The per-file encoding, the val guarantee and the manifest are stages/tokenize.py's own.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from optimus_core.atomic import atomic_dir, atomic_write
from optimus_core.outputs import mark_output
from optimus_core.config import ConfigError
from optimus_core.data.shards import TOKENIZER_NAME, TokenFile, sha256_file, token_dtype, write_manifest
from stages.corpus import CorpusError, CorpusFile, list_corpus
from stages.tokenize import (TokenizeConfig, TokenizeInputs, TokenizeOutputs, TokenizeResult, _check_unique_outputs,
                             _ensure_val_per_source, _FileResult, _Job, _manifest, _output_stem, _special_ids,
                             _tokenize_file, check_token_output, load_tokenizer)

__all__ = ["SHARD_NAME", "shard_settings", "shard_dir", "tokenize_shard", "merge_shards"]

SHARD_NAME = "shard.json"


def shard_settings(config: TokenizeConfig, tokenizer_path: Path) -> dict:
    """What a shard's content depends on besides its input file (recorded in ``shard.json``)."""
    return {"tokenizer_sha256": sha256_file(tokenizer_path), "val_fraction": config.val_fraction,
            "split_seed": config.split_seed, "skip_bad_records": config.skip_bad_records,
            "eos_token": config.eos_token, "pad_token": config.pad_token}


def shard_dir(shards: Path, f: CorpusFile) -> Path:
    """The shard directory of one corpus file: its output stem, flattened, plus a short hash
    (so that two stems never share a directory or nest)."""
    stem = _output_stem(f)
    digest = hashlib.blake2b(stem.encode("utf-8"), digest_size=4).hexdigest()
    return Path(shards) / f"{stem.replace('/', '__')}-{digest}"


def tokenize_shard(config: TokenizeConfig, f: CorpusFile, tokenizer_path: Path, settings: dict,
                   out: Path) -> str:
    """Tokenize one corpus file into the shard directory ``out`` (published atomically), unless
    ``out`` already holds its shard for the same input sha256 and ``settings``. Returns
    ``"tokenized"`` or ``"reused"``."""
    out, input_sha = Path(out), sha256_file(f.path)
    previous = _read_shard(out)
    if previous and previous["input_sha256"] == input_sha and previous["settings"] == settings:
        return "reused"
    tokenizer = load_tokenizer(tokenizer_path)
    if sha256_file(tokenizer_path) != settings["tokenizer_sha256"]:
        raise ConfigError(f"tokenizer = {str(tokenizer_path)!r}: changed since the fan-out was planned "
                          "(its sha256 differs from settings.tokenizer_sha256)")
    eos_id, _ = _special_ids(tokenizer, config, tokenizer_path)
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    with atomic_dir(out) as tmp:
        job = _Job(tmp, str(tokenizer_path), eos_id, str(token_dtype(vocab_size)), config.val_fraction,
                   config.split_seed, config.skip_bad_records)
        r = _tokenize_file(job, f, tokenizer)
        if r.sha256 != input_sha:
            raise CorpusError(f"{f.rel}: changed while it was tokenized; run again", f.rel)
        atomic_write(tmp / SHARD_NAME, json.dumps({
            "input": f.rel, "source": f.source, "size": f.size, "input_sha256": r.sha256, "settings": settings,
            "records": r.records, "skipped": r.skipped, "outputs": [asdict(t) for t in r.outputs],
            "candidates": [list(c) for c in r.candidates]}, indent=1, sort_keys=True))
    return "tokenized"


def _read_shard(path: Path) -> Optional[dict]:
    try:
        return json.loads((Path(path) / SHARD_NAME).read_text())
    except (OSError, ValueError):
        return None  # absent or unreadable: not a finished shard


def merge_shards(config: TokenizeConfig, inputs: TokenizeInputs, shards: Path,
                 outputs: TokenizeOutputs) -> TokenizeResult:
    """The data directory of every file of ``inputs.corpus_dir`` from their shards under
    ``shards`` (each must be finished and made with this tokenizer and these settings): the
    token files hard-linked (copied across filesystems), the per-source val guarantee applied
    as run_tokenize applies it, the manifest merged and written last."""
    if inputs.tokenizer is None:
        raise ConfigError("tokenizer = None: merging shards needs the tokenizer.json they were made with")
    check_token_output(inputs, outputs)
    files = list_corpus(Path(inputs.corpus_dir))
    _check_unique_outputs(files)
    settings = shard_settings(config, inputs.tokenizer)
    shard_of = {f.rel: (shard_dir(shards, f), _read_shard(shard_dir(shards, f))) for f in files}
    stale = [rel for rel, (_, s) in shard_of.items() if s is None or s["settings"] != settings
             or (s["input"], s["size"]) != (rel, next(f.size for f in files if f.rel == rel))]
    if stale:
        raise CorpusError(f"{len(stale)} of {len(files)} corpus files have no finished shard for this tokenizer "
                          f"and settings under {shards} (first: {stale[0]}); tokenize them first", stale[0])
    with atomic_dir(outputs.out_dir) as tmp:
        tokenizer_path = tmp / TOKENIZER_NAME
        shutil.copyfile(inputs.tokenizer, tokenizer_path)
        tokenizer = load_tokenizer(tokenizer_path)
        eos_id, pad_id = _special_ids(tokenizer, config, inputs.tokenizer)
        vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        job = _Job(tmp, str(tokenizer_path), eos_id, str(token_dtype(vocab_size)), config.val_fraction,
                   config.split_seed, config.skip_bad_records)
        results = []
        for f in files:
            where, s = shard_of[f.rel]
            outputs_ = tuple(TokenFile(**t) for t in s["outputs"])
            for t in outputs_:
                for rel in (t.tokens, t.index):
                    _link_or_copy(where / rel, tmp / rel)
            results.append(_FileResult(f, s["input_sha256"], s["records"], s["skipped"], outputs_,
                                       tuple(tuple(c) for c in s["candidates"])))
        results = sorted(results, key=lambda r: (r.input.source, r.input.rel))
        results = _ensure_val_per_source(job, tokenizer, results)  # unlinks before it rewrites
        manifest = _manifest(config, inputs, tokenizer_path, vocab_size, eos_id, pad_id, job.dtype, results)
        mark_output(tmp, "tokenize", {"corpus_dir": inputs.corpus_dir, "tokenizer": inputs.tokenizer})
        write_manifest(tmp, manifest)  # last: the manifest marks the directory complete
    return TokenizeResult(Path(outputs.out_dir), vocab_size, job.dtype, False, len(manifest.files),
                          manifest.totals, dict(manifest.skipped["by_reason"]))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # shards and the data directory usually share a filesystem: no copy
    except OSError:
        shutil.copyfile(src, dst)
