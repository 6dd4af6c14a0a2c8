"""The tokenize fan-out core: one shard per corpus file, merged into exactly the data directory
run_tokenize writes; a file already tokenized (same input, same tokenizer) is not redone."""
import json

import pytest
import zstandard

from optimus_core.config import ConfigError
from optimus_core.data.shards import load_manifest, sha256_file, verify
from stages.corpus import list_corpus
from stages.tokenize import CorpusError, TokenizeConfig, TokenizeInputs, TokenizeOutputs, run_tokenize
from stages.tokenize_shards import SHARD_NAME, merge_shards, shard_dir, shard_settings, tokenize_shard


def zst_records(n: int, prefix: str) -> bytes:
    lines = b"".join(json.dumps({"id": f"{prefix}-{i}", "text": f"{prefix} document {i}: some words, {i * i}.\n"})
                     .encode() + b"\n" for i in range(n))
    return zstandard.ZstdCompressor().compress(lines)


@pytest.fixture
def corpus(write_corpus):
    # two big files of one source, and a 3-document source whose hash holds out nothing (the
    # val guarantee then moves a document to val, re-tokenizing that file in the merge)
    return write_corpus({"data/web/part-0.json.zst": zst_records(120, "web0"),
                         "data/web/part-1.json.zst": zst_records(80, "web1"),
                         "data/tiny/only.json.zst": zst_records(3, "tiny")})


@pytest.fixture
def tokenizer(corpus, tmp_path):
    """A small BPE trained by run_tokenize: the 'given' tokenizer of both paths."""
    run_tokenize(TokenizeConfig(vocab_size=300), TokenizeInputs(corpus), TokenizeOutputs(tmp_path / "bpe"))
    return tmp_path / "bpe" / "tokenizer.json"


def fan_out(config, corpus, tokenizer, shards):
    settings = shard_settings(config, tokenizer)
    return {f.rel: tokenize_shard(config, f, tokenizer, settings, shard_dir(shards, f)) for f in list_corpus(corpus)}


def tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_shards_merge_into_exactly_what_run_tokenize_writes(corpus, tokenizer, tmp_path):
    config = TokenizeConfig()
    reference = tmp_path / "reference"
    run_tokenize(config, TokenizeInputs(corpus, tokenizer), TokenizeOutputs(reference))
    shards = tmp_path / "shards"
    assert fan_out(config, corpus, tokenizer, shards) == dict.fromkeys(
        ["data/tiny/only.json.zst", "data/web/part-0.json.zst", "data/web/part-1.json.zst"], "tokenized")
    assert len(list(shards.iterdir())) == 3  # one directory per input file
    merged = tmp_path / "merged"
    result = merge_shards(config, TokenizeInputs(corpus, tokenizer), shards, TokenizeOutputs(merged))
    assert tree(merged) == tree(reference)  # every token file, index, the tokenizer and the manifest
    m = verify(merged)
    assert result.files == len(m.files) and not result.trained_tokenizer
    assert sum(f.n_docs for f in m.files if f.source == "tiny" and f.split == "val") == 1  # the val guarantee
    # the merge re-tokenized the tiny file into the data directory, never into its shard
    for d in shards.iterdir():
        for t in json.loads((d / SHARD_NAME).read_text())["outputs"]:
            assert sha256_file(d / t["tokens"]) == t["tokens_sha256"]


def test_rerun_skips_unchanged_files_and_redoes_changed_ones(corpus, tokenizer, tmp_path):
    config, shards = TokenizeConfig(), tmp_path / "shards"
    fan_out(config, corpus, tokenizer, shards)
    stamp = {d.name: (d / SHARD_NAME).stat().st_mtime_ns for d in shards.iterdir()}
    assert set(fan_out(config, corpus, tokenizer, shards).values()) == {"reused"}
    assert stamp == {d.name: (d / SHARD_NAME).stat().st_mtime_ns for d in shards.iterdir()}
    (corpus / "data/web/part-1.json.zst").write_bytes(zst_records(81, "web1"))  # new content
    assert fan_out(config, corpus, tokenizer, shards) == {
        "data/tiny/only.json.zst": "reused", "data/web/part-0.json.zst": "reused",
        "data/web/part-1.json.zst": "tokenized"}
    merged = tmp_path / "merged"
    merge_shards(config, TokenizeInputs(corpus, tokenizer), shards, TokenizeOutputs(merged))
    assert sum(f.n_docs for f in load_manifest(merged).files if f.input.endswith("part-1.json.zst")) == 81
    # another split seed is another output: every file is done again
    assert set(fan_out(TokenizeConfig(split_seed=1), corpus, tokenizer, shards).values()) == {"tokenized"}


def test_merge_refuses_missing_or_foreign_shards(corpus, tokenizer, tmp_path):
    config, shards = TokenizeConfig(), tmp_path / "shards"
    f = list_corpus(corpus)[0]
    tokenize_shard(config, f, tokenizer, shard_settings(config, tokenizer), shard_dir(shards, f))
    with pytest.raises(CorpusError, match=r"2 of 3 corpus files have no finished shard .* \(first: data/web/part-0"):
        merge_shards(config, TokenizeInputs(corpus, tokenizer), shards, TokenizeOutputs(tmp_path / "out"))
    fan_out(config, corpus, tokenizer, shards)
    with pytest.raises(CorpusError, match=r"3 of 3 corpus files have no finished shard"):  # made with seed 0
        merge_shards(TokenizeConfig(split_seed=1), TokenizeInputs(corpus, tokenizer), shards,
                     TokenizeOutputs(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"tokenizer = None: merging shards needs the tokenizer.json"):
        merge_shards(config, TokenizeInputs(corpus), shards, TokenizeOutputs(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
