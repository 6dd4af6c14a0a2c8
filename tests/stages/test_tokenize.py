"""`optimus tokenize`: Dolma JSONL -> token arrays, indexes and a manifest, exactly and atomically."""
import gzip
import json
import shutil

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers

import stages.tokenize as tokenize
from optimus_core.config import ConfigError
from optimus_core.data.shards import load_manifest, open_tokens, read_index, sha256_file, verify
from optimus_core.outputs import MARKER
from stages.corpus import CorpusConfig, CorpusInputs, CorpusOutputs, run_corpus
from stages.tokenize import (CorpusError, TokenizeConfig, TokenizeInputs, TokenizeOutputs, load_tokenizer,
                             run_tokenize, val_score)


def records(n, prefix="doc"):
    """n good JSONL lines."""
    return b"".join(json.dumps({"id": f"{prefix}-{i}", "text": f"Document {i} of {prefix}: héllo wörld.\n"}).encode()
                    + b"\n" for i in range(n))


def tokenize_dir(corpus, out, tokenizer=None, **config):
    return run_tokenize(TokenizeConfig(**config), TokenizeInputs(corpus, tokenizer), TokenizeOutputs(out))


# ----------------------------------------------------------------------------- the tokenizer

def test_trained_tokenizer_round_trips_every_document_exactly(small_tokens, corpus_docs):
    tok = load_tokenizer(small_tokens / "tokenizer.json")
    assert tok.get_vocab_size() == 512
    tricky = [" leading space", "trailing  \n\n", "tabs\tand\r\nCRLF", "ünïcödé ✓ 🎉 日本語", "",
              "a literal <|endoftext|> and <|padding|> in the text", "\x00\x7f control"]
    for text in [r["text"] for r in corpus_docs.values()] + tricky:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    # the special tokens spelled inside a document are text, not the tokens
    ids = tok.encode(tricky[5], add_special_tokens=False).ids
    assert tok.token_to_id("<|endoftext|>") not in ids and tok.token_to_id("<|padding|>") not in ids


# ----------------------------------------------------------------------------- the output

def test_index_rows_tile_the_tokens_and_decode_to_the_documents(small_tokens, corpus_docs):
    m = load_manifest(small_tokens)
    tok = load_tokenizer(small_tokens / "tokenizer.json")
    assert (m.eos_id, m.pad_id, m.dtype) == (0, 1, "uint16")
    seen = set()
    for f in m.files:
        tokens = open_tokens(small_tokens / f.tokens, m.dtype)
        rows = read_index(small_tokens / f.index)
        assert len(tokens) == f.n_tokens == rows[-1].end and len(rows) == f.n_docs
        assert rows[0].start == 0 and all(a.end == b.start for a, b in zip(rows, rows[1:]))
        ends = np.array([r.end for r in rows])
        assert (tokens[ends - 1] == m.eos_id).all()
        assert np.count_nonzero(tokens == m.eos_id) == len(rows)  # EOS nowhere else
        assert {r.path for r in rows} == {f.input}
        assert f.n_bytes == sum(len(corpus_docs[r.id]["text"].encode()) for r in rows)
        for r in rows[:: max(1, len(rows) // 5)]:  # a sample of each file
            assert tok.decode(tokens[r.start: r.end - 1].tolist()) == corpus_docs[r.id]["text"]
            assert corpus_docs[r.id]["source"] == f.source
        seen.update(r.id for r in rows)
    assert seen == set(corpus_docs)  # every document, once


def test_layout_and_manifest(small_tokens, small_corpus):
    m = verify(small_tokens)  # every sha256 and size matches
    assert sorted(p.name for p in small_tokens.iterdir()) == [MARKER, "manifest.json", "tokenizer.json", "train", "val"]
    assert m.tokenizer_sha256 == sha256_file(small_tokens / "tokenizer.json")
    assert m.vocab_size == 512 and m.val_fraction == 0.05 and m.sources == ["code", "docs", "prose"]
    for f in m.files:
        assert f.tokens == f"{f.split}/{f.source}/{f.input.split('/')[-1].removesuffix('.json.gz')}.npy"
        assert f.index == f.tokens.removesuffix(".npy") + ".csv.gz"
        assert f.tokens_sha256 == sha256_file(small_tokens / f.tokens)
        assert f.input_sha256 == sha256_file(small_corpus / f.input)
    raw = json.loads((small_tokens / "manifest.json").read_text())
    assert raw["format"] == "optimus-tokens" and raw["version"] == 1
    assert raw["skipped"] == {"total": 0, "by_reason": {}}
    for split in ("train", "val"):
        for source in m.sources:  # every source is held out, and the totals add up
            files = m.files_for(split, [source])
            assert files and raw["totals"][split][source] == {
                "docs": sum(f.n_docs for f in files), "tokens": sum(f.n_tokens for f in files),
                "bytes": sum(f.n_bytes for f in files)}
    assert len(raw["inputs"]) == len(list(small_corpus.glob("*/*.json.gz")))


def test_split_follows_the_hash_of_the_id(small_tokens):
    m = load_manifest(small_tokens)
    for source in m.sources:
        docs = []  # (score, split, tokens)
        for f in m.files_for("train", [source]) + m.files_for("val", [source]):
            docs += [(val_score(r.id, 0), f.split, r.end - r.start) for r in read_index(small_tokens / f.index)]
        assert all(split == "val" for score, split, _ in docs if score < 0.05)
        topped_up = sorted(d for d in docs if d[0] >= 0.05 and d[1] == "val")
        if topped_up:  # only the guarantee overrides the hash: the lowest-scoring rest, until 5% of tokens
            rest = sorted(d for d in docs if d[0] >= 0.05)
            assert topped_up == rest[: len(topped_up)]
            val_tokens = sum(n for _, split, n in docs if split == "val")
            total = sum(n for *_, n in docs)
            assert val_tokens >= 0.05 * total > val_tokens - topped_up[-1][2]


def test_output_does_not_depend_on_workers(small_tokens, small_corpus, tmp_path):
    tokenize_dir(small_corpus, tmp_path / "tokens", workers=2, vocab_size=512)
    assert (tmp_path / "tokens" / "manifest.json").read_bytes() == (small_tokens / "manifest.json").read_bytes()


def test_given_tokenizer_is_used_and_copied(small_tokens, write_corpus, tmp_path):
    corpus = write_corpus({"a/x.jsonl": records(5), "b/y.json.zst": zstandard.ZstdCompressor().compress(records(3, "b"))})
    result = tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json")
    assert not result.trained_tokenizer
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (small_tokens / "tokenizer.json").read_bytes()
    assert sum(t.docs for split in result.totals.values() for t in split.values()) == 8
    assert load_manifest(tmp_path / "out").tokenizer["origin"] == "given"


def test_reads_an_indexed_download(small_tokens, tmp_path):
    download = tmp_path / "mix" / "data" / "wiki" / "sub"
    download.mkdir(parents=True)
    (download / "w-0.json.zst").write_bytes(zstandard.ZstdCompressor().compress(records(4, "w")))
    run_corpus(CorpusConfig(), CorpusInputs(from_dir=tmp_path / "mix"), CorpusOutputs(tmp_path / "corpus"))
    tokenize_dir(tmp_path / "corpus", tmp_path / "out", small_tokens / "tokenizer.json")
    m = verify(tmp_path / "out")
    assert {(f.split, f.tokens, f.input) for f in m.files} == {
        (s, f"{s}/wiki/sub/w-0.npy", "data/wiki/sub/w-0.json.zst") for s in ("train", "val")}


def test_every_source_of_two_or_more_documents_gets_a_val_document(small_tokens, write_corpus, tmp_path):
    corpus = write_corpus({"two/a.jsonl": records(1, "a"), "two/b.jsonl": records(1, "b"), "one/c.jsonl": records(1, "c")})
    tok = small_tokens / "tokenizer.json"
    m = load_manifest(tokenize_dir(corpus, tmp_path / "out", tok, val_fraction=1e-12).out_dir)
    assert [(f.split, f.source, f.n_docs) for f in m.files_for("val")] == [("val", "two", 1)]
    # the held-out one is the lowest-scoring document; its file has no train part left
    held = "a-0" if val_score("a-0", 0) < val_score("b-0", 0) else "b-0"
    assert read_index(tmp_path / "out" / m.files_for("val")[0].index)[0].id == held
    assert sum(f.n_docs for f in m.files_for("train")) == 2
    m = load_manifest(tokenize_dir(corpus, tmp_path / "none", tok, val_fraction=0.0).out_dir)
    assert m.files_for("val") == []


def test_a_source_far_short_of_val_fraction_is_topped_up(small_tokens, write_corpus, tmp_path):
    # one tiny document held out by the hash, five long ones that are not: the held-out tokens
    # are far below 30%, so the lowest-scoring long ones join until they reach it
    ids = [f"d{i}" for i in range(100)]
    tiny = next(i for i in ids if val_score(i, 0) < 0.3)
    long = sorted((i for i in ids if val_score(i, 0) >= 0.3), key=lambda i: val_score(i, 0))[:5]
    lines = [json.dumps({"id": tiny, "text": "x"})] + [json.dumps({"id": i, "text": f"{i} " * 200}) for i in long]
    corpus = write_corpus({"s/a.jsonl": "\n".join(lines[::-1]).encode()})
    m = load_manifest(tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json", val_fraction=0.3).out_dir)
    val = [r.id for r in read_index(tmp_path / "out" / m.files_for("val")[0].index)]
    assert sorted(val) == sorted([tiny] + long[:2])  # 2 of 5 equal long documents pass 30% of the tokens
    assert m.totals["val"]["s"].tokens >= 0.3 * (m.totals["val"]["s"].tokens + m.totals["train"]["s"].tokens)


def test_large_vocab_is_stored_as_uint32(write_corpus, tmp_path):
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({f"filler{i}": len(vocab) + i for i in range(70_000)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>", "<|padding|>"])
    tok.save(str(tmp_path / "big.json"))
    corpus = write_corpus({"a/x.jsonl": records(3)})
    tokenize_dir(corpus, tmp_path / "out", tmp_path / "big.json", val_fraction=0.0)
    m = verify(tmp_path / "out")
    assert m.dtype == "uint32" and m.eos_id == tok.token_to_id("<|endoftext|>") > 65535
    tokens = open_tokens(tmp_path / "out" / m.files[0].tokens, m.dtype)
    assert tokens.dtype == np.dtype("<u4") and (tokens[[r.end - 1 for r in read_index(tmp_path / "out" / m.files[0].index)]] == m.eos_id).all()


def test_tokenizer_without_the_eos_token_is_a_config_error(small_tokens, write_corpus, tmp_path):
    corpus = write_corpus({"a/x.jsonl": records(2)})
    with pytest.raises(ConfigError, match=r"tokenize.eos_token = '</s>': .* has no such token"):
        tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json", eos_token="</s>")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value", [("workers", 0), ("vocab_size", 100), ("val_fraction", 1.0),
                                          ("skip_bad_records", "yes"), ("eos_token", "")])
def test_config_errors_name_field_and_value(field, value):
    with pytest.raises(ConfigError, match=rf"tokenize\.{field} = {value!r}: must be"):
        TokenizeConfig(**{field: value})


# ----------------------------------------------------------------------------- bad input

def gz(data):
    return gzip.compress(data, mtime=0)


GOOD = records(3)
BAD_INPUTS = {  # name: (file name, bytes, line named in the error, reason counted when skipped)
    "not gzip": ("x.json.gz", GOOD, 1, "unreadable or truncated file"),
    "truncated gzip": ("x.json.gz", gz(records(5000))[:20_000], None, "unreadable or truncated file"),
    "truncated zstd": ("x.json.zst", zstandard.ZstdCompressor().compress(records(5000))[:-10], None,
                       "unreadable or truncated file"),
    "not zstd": ("x.json.zst", b"\x28\xb5\x2f\xfd garbage", 1, "unreadable or truncated file"),
    "not JSON": ("x.jsonl", GOOD + b'{"id": "broken", "text": \n' + GOOD, 4, "not JSON"),
    "not an object": ("x.jsonl", GOOD + b'["a list"]\n', 4, "not a JSON object"),
    "no text": ("x.jsonl", b'{"id": "t"}\n' + GOOD, 1, "no 'text' string"),
    "text not a string": ("x.json.gz", gz(GOOD + b'{"id": "t", "text": 5}\n'), 4, "no 'text' string"),
    "not UTF-8": ("x.jsonl", GOOD + b'{"id": "u", "text": "caf\xe9"}\n', 4, "not UTF-8"),
    "lone surrogate": ("x.jsonl", b'{"id": "s", "text": "\\ud800"}\n' + GOOD, 1, "not UTF-8"),
    "empty file": ("x.jsonl", b"", None, "empty file"),
    "empty gzip": ("x.json.gz", gz(b""), None, "empty file"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_stops_naming_file_and_line(case, small_tokens, write_corpus, tmp_path):
    name, data, line, _ = BAD_INPUTS[case]
    corpus = write_corpus({"good/a.jsonl": records(4, "g"), f"bad/{name}": data})
    with pytest.raises(CorpusError) as info:
        tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json")
    bad = str(corpus / "bad" / name)
    assert info.value.path == bad and str(info.value).startswith(bad)
    if line is not None:
        assert info.value.line == line and str(info.value).startswith(f"{bad}:{line}: ")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_skipped_and_counted(case, small_tokens, write_corpus, tmp_path):
    name, data, _, reason = BAD_INPUTS[case]
    corpus = write_corpus({"good/a.jsonl": records(4, "g"), f"bad/{name}": data})
    result = tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json", skip_bad_records=True)
    m = verify(tmp_path / "out")  # complete and consistent
    assert result.skipped == {reason: 1} and m.skipped == {"total": 1, "by_reason": {reason: 1}}
    per_input = {i["path"]: i for i in m.inputs}
    assert per_input[f"bad/{name}"]["skipped"] == {reason: 1} and per_input["good/a.jsonl"]["skipped"] == {}
    assert sum(f.n_docs for f in m.files if f.source == "good") == 4
    kept = sum(f.n_docs for f in m.files if f.source == "bad")
    assert kept == per_input[f"bad/{name}"]["records"]
    if "truncated" in case:  # the records before the damage are kept
        assert kept > 0


def test_bad_input_stops_tokenizer_training_the_same_way(write_corpus, tmp_path):
    corpus = write_corpus({"a/x.jsonl": GOOD + b"oops\n"})
    with pytest.raises(CorpusError, match=rf"^{tmp_path / 'in' / 'a' / 'x.jsonl'}:4: not JSON"):
        tokenize_dir(corpus, tmp_path / "out", vocab_size=300)


def test_worker_errors_reach_the_parent_unchanged(small_tokens, write_corpus, tmp_path):
    corpus = write_corpus({"a/x.jsonl": records(3), "b/y.jsonl": records(3, "b") + b"oops\n", "c/z.jsonl": records(3)})
    errors = []
    for workers in (1, 2):
        with pytest.raises(CorpusError) as info:
            tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json", workers=workers)
        errors.append((type(info.value), str(info.value), info.value.path, info.value.line))
    assert errors[0] == errors[1] and errors[0][3] == 4


# ----------------------------------------------------------------------------- interruption

def test_interrupted_run_leaves_nothing_and_keeps_the_old_output(small_tokens, write_corpus, tmp_path, monkeypatch):
    corpus = write_corpus({"a/x.jsonl": records(5)})
    out = tmp_path / "out"
    tokenize_dir(corpus, out, small_tokens / "tokenizer.json")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenize, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize_dir(corpus, out, small_tokens / "tokenizer.json", val_fraction=0.5)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    shutil.rmtree(out)
    with pytest.raises(KeyboardInterrupt):
        tokenize_dir(corpus, out, small_tokens / "tokenizer.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no temporary


def test_a_long_document_is_encoded_in_pieces_to_the_same_tokens(small_tokens, corpus_docs, write_corpus, tmp_path,
                                                                  monkeypatch):
    """A document over _PIECE_CHARS is encoded piece by piece (bounded memory, a line saying so),
    cut only where the whole text's tokens do not change: the same ids as one encode."""
    from stages import tokenize

    tok = load_tokenizer(small_tokens / "tokenizer.json")
    # every document of the small corpus joined: code, prose, indented lines, blank lines, unicode
    text = "\n".join(r["text"] for r in corpus_docs.values()) + "\n  indented\n\n\tx\n é\nlast"
    pieces = list(tokenize._pieces(text, size=500))
    assert len(pieces) > 20 and "".join(pieces) == text
    assert all(p.endswith("\n") for p in pieces[:-1]) and all(not p[0].isspace() for p in pieces[1:])
    whole = tok.encode(text, add_special_tokens=False).ids
    assert [t for p in pieces for t in tok.encode(p, add_special_tokens=False).ids] == whole
    assert list(tokenize._pieces("no newline at all " * 100, size=50)) == ["no newline at all " * 100]

    monkeypatch.setattr(tokenize, "_PIECE_CHARS", 500)
    corpus = write_corpus({"src/a.jsonl": json.dumps({"id": "big", "text": text}).encode() + b"\n"})
    logged = []
    monkeypatch.setattr(tokenize._log, "info", lambda msg, *a: logged.append(msg % a))
    tokenize_dir(corpus, tmp_path / "out", small_tokens / "tokenizer.json", val_fraction=0.0)
    ids = np.fromfile(next((tmp_path / "out" / "train").rglob("*.npy")), dtype="<u2").tolist()
    assert ids[:-1] == whole and ids[-1] == tok.token_to_id("<|endoftext|>")
    assert any("a document of" in line and "pieces" in line for line in logged)
