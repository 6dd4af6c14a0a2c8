"""`optimus corpus`: a reproducible stdlib corpus in the Dolma layout, or an index of a download."""
import gzip
import shutil

import pytest
import zstandard

import stages.corpus as corpus
from optimus_core.config import ConfigError
from optimus_core.outputs import MARKER, OutputRefused
from stages.corpus import (ADDED, CorpusConfig, CorpusError, CorpusInputs, CorpusOutputs, list_corpus,
                           run_corpus)


def tree_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_builds_are_byte_identical(small_corpus, small_config, tmp_path):
    again = tmp_path / "again"
    result = run_corpus(small_config, CorpusInputs(), CorpusOutputs(again))
    assert tree_bytes(again) == tree_bytes(small_corpus)
    assert not result.indexed and set(result.docs) == {"prose", "code", "docs"}


def test_rebuild_replaces_its_own_output_whole_and_nothing_else(small_corpus, small_config, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(small_corpus, out)
    (out / "prose" / "stale.txt").write_text("left by an older build")
    run_corpus(small_config, CorpusInputs(), CorpusOutputs(out))
    assert tree_bytes(out) == tree_bytes(small_corpus)
    (out / MARKER).unlink()  # no longer marked as a corpus: it could be anyone's folder of .json.gz files
    with pytest.raises(OutputRefused, match="that `optimus corpus` did not make"):
        run_corpus(small_config, CorpusInputs(), CorpusOutputs(out))


def test_records_are_dolma_and_sources_all_present(corpus_docs, small_corpus, small_config):
    assert sorted(p.name for p in small_corpus.iterdir()) == [MARKER, "code", "docs", "prose"]
    for source in ("code", "docs", "prose"):
        parts = sorted(p.name for p in (small_corpus / source).iterdir())
        assert parts == [f"part-{i:04d}.json.gz" for i in range(len(parts))] and 1 <= len(parts) <= small_config.parts
    by_source = {}
    for ident, r in corpus_docs.items():
        assert set(r) == {"id", "text", "source", "added", "metadata"}
        assert isinstance(r["text"], str) and r["text"].strip()
        assert ident.startswith(r["source"] + "/") and r["added"] == ADDED
        assert isinstance(r["metadata"], dict) and r["metadata"]["license"] == "PSF-2.0"
        by_source.setdefault(r["source"], []).append(r)
    assert set(by_source) == {"code", "docs", "prose"}
    assert all(r["id"].endswith(".py") for r in by_source["code"])
    # each source is about its cap: everything but its last document fits under it
    for source, cap in (("prose", small_config.prose_bytes), ("code", small_config.code_bytes), ("docs", small_config.docs_bytes)):
        sizes = [len(r["text"].encode()) for r in by_source[source]]
        assert cap <= sum(sizes) and sum(sizes) - max(sizes) < cap


def test_code_skips_tests_and_third_party(corpus_docs):
    paths = [r["metadata"]["path"] for r in corpus_docs.values() if r["source"] in ("code", "docs")]
    assert paths and not any(set(p.split("/")) & {"test", "tests", "site-packages", "idle_test"} for p in paths)


def test_docstrings_come_from_ast_with_qualified_names(corpus_docs):
    docs = [r for r in corpus_docs.values() if r["source"] == "docs"]
    assert any("." in r["metadata"]["qualname"] for r in docs)
    assert len({r["id"] for r in docs}) == len(docs)


def test_interrupted_build_leaves_nothing_and_keeps_the_old_output(small_config, tmp_path, monkeypatch):
    out = tmp_path / "out"
    run_corpus(small_config, CorpusInputs(), CorpusOutputs(out))
    before = tree_bytes(out)
    calls = []

    def fail_on_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    real = corpus._write_parts
    monkeypatch.setattr(corpus, "_write_parts", fail_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_corpus(small_config, CorpusInputs(), CorpusOutputs(out))
    assert tree_bytes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left


def make_download(root):
    """A small OLMoE-mix-like download: data/<source>/..., with things to ignore."""
    dclm = root / "data" / "dclm"
    (dclm / "sub").mkdir(parents=True)
    (dclm / "dclm-0000.json.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"id":"a","text":"x"}\n'))
    (dclm / "sub" / "dclm-0001.json.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"id":"b","text":"y"}\n'))
    (root / "data" / "wiki").mkdir()
    (root / "data" / "wiki" / "wiki-0000.json.gz").write_bytes(gzip.compress(b'{"id":"c","text":"z"}\n'))
    (root / "data" / "wiki" / "notes.txt").write_text("not a corpus file")
    (root / "data" / "wiki" / ".cache").mkdir()
    (root / "data" / "wiki" / ".cache" / "partial.json.gz").write_bytes(b"incomplete download")
    (root / "README.md").write_text("readme")


def test_from_dir_writes_an_index_and_copies_nothing(tmp_path):
    download, out = tmp_path / "olmoe-mix", tmp_path / "corpus"
    make_download(download)
    result = run_corpus(CorpusConfig(), CorpusInputs(from_dir=download), CorpusOutputs(out))
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "index.json"]
    assert result.indexed and result.files == {"dclm": 2, "wiki": 1} and result.docs == {}
    files = list_corpus(out)
    assert [(f.source, f.rel) for f in files] == [
        ("dclm", "data/dclm/dclm-0000.json.zst"), ("dclm", "data/dclm/sub/dclm-0001.json.zst"),
        ("wiki", "data/wiki/wiki-0000.json.gz")]
    assert all(f.path == download.resolve() / f.rel and f.size == f.path.stat().st_size for f in files)
    assert list_corpus(download) == files  # the download read directly lists the same files


def test_index_notices_a_changed_or_missing_file(tmp_path):
    download, out = tmp_path / "olmoe-mix", tmp_path / "corpus"
    make_download(download)
    run_corpus(CorpusConfig(), CorpusInputs(from_dir=download), CorpusOutputs(out))
    wiki = download / "data" / "wiki" / "wiki-0000.json.gz"
    wiki.write_bytes(wiki.read_bytes() + b"more")
    with pytest.raises(CorpusError, match="changed since it was indexed"):
        list_corpus(out)
    wiki.unlink()
    with pytest.raises(CorpusError, match="listed in .* but missing"):
        list_corpus(out)


def test_from_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="from_dir"):
        run_corpus(CorpusConfig(), CorpusInputs(from_dir=tmp_path / "nope"), CorpusOutputs(tmp_path / "out"))
    (tmp_path / "empty" / "src").mkdir(parents=True)
    with pytest.raises(CorpusError, match="no corpus files"):
        run_corpus(CorpusConfig(), CorpusInputs(from_dir=tmp_path / "empty"), CorpusOutputs(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value", [("parts", 0), ("code_bytes", -1), ("max_file_bytes", 1.5), ("docs_bytes", True)])
def test_config_errors_name_field_and_value(field, value):
    with pytest.raises(ConfigError, match=rf"corpus\.{field} = {value!r}: must be"):
        CorpusConfig(**{field: value})


def test_corpus_error_pickles_with_its_fields():
    import pickle

    e = pickle.loads(pickle.dumps(CorpusError("f.jsonl:3: not JSON", "f.jsonl", 3)))
    assert (str(e), e.path, e.line) == ("f.jsonl:3: not JSON", "f.jsonl", 3)


def test_files_the_scan_passes_over_are_counted_in_a_warning(tmp_path, caplog):
    """A file with another suffix, or beside the source directories, is not a corpus file: the
    scan says how many it did not read, with the first of them."""
    import logging

    root = tmp_path / "download"
    (root / "wiki").mkdir(parents=True)
    (root / "wiki" / "a.jsonl").write_text('{"id": "1", "text": "x"}\n')
    (root / "wiki" / "b.txt").write_text("notes")
    (root / "top.jsonl").write_text('{"id": "2", "text": "y"}\n')
    (root / "wiki" / ".cache").mkdir()
    (root / "wiki" / ".cache" / "c.jsonl").write_text("")  # hidden: a temp file, not counted
    with caplog.at_level(logging.WARNING):
        files = list_corpus(root)
    assert [f.rel for f in files] == ["wiki/a.jsonl"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith(f"{root}: 2 file(s) not read: not *.jsonl|")
    assert said[0].endswith("under a source directory (top.jsonl, wiki/b.txt)")


def test_a_files_list_indexes_only_the_files_it_names(tmp_path, caplog):
    """The authors' download list (their urls.txt: URLs ending in <source>/<file>) chooses the
    files whose windows the paper numbered; a listed file that is missing is an error."""
    download, out = tmp_path / "olmoe-mix", tmp_path / "corpus"
    make_download(download)
    urls = tmp_path / "urls.txt"
    base = "https://huggingface.co/datasets/allenai/OLMoE-mix-0924/resolve/main/data"
    urls.write_text(f"{base}/dclm/dclm-0000.json.zst\n{base}/wiki/wiki-0000.json.gz\n")
    with caplog.at_level("WARNING"):
        result = run_corpus(CorpusConfig(), CorpusInputs(from_dir=download, files_list=urls), CorpusOutputs(out))
    assert result.files == {"dclm": 1, "wiki": 1}
    assert [f.rel for f in list_corpus(out)] == ["data/dclm/dclm-0000.json.zst", "data/wiki/wiki-0000.json.gz"]
    assert "1 corpus file(s) not in" in caplog.text and "dclm-0001" in caplog.text
    urls.write_text("dclm/dclm-0000.json.zst\npes2o/pes2o-0000.json.gz\n")
    with pytest.raises(CorpusError, match=r"1 listed file\(s\) not in the corpus, e.g. pes2o/pes2o-0000.json.gz"):
        run_corpus(CorpusConfig(), CorpusInputs(from_dir=download, files_list=urls), CorpusOutputs(tmp_path / "o2"))
    assert not (tmp_path / "o2").exists()
