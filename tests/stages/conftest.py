"""Fixtures for the corpus and tokenize stages: one small stdlib corpus and its tokens per test
run (a few seconds), and a writer of hand-made corpus files."""
import gzip
import json
import shutil
from pathlib import Path

import pytest

from stages.corpus import CorpusConfig, CorpusInputs, CorpusOutputs, run_corpus
from stages.tokenize import TokenizeConfig, TokenizeInputs, TokenizeOutputs, run_tokenize

# small caps keep a build well under a second; prose is capped too
SMALL = CorpusConfig(prose_bytes=60_000, code_bytes=80_000, docs_bytes=40_000, parts=2)
SMALL_VOCAB = 512


@pytest.fixture(scope="session")
def small_config() -> CorpusConfig:
    return SMALL


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "corpus"
    run_corpus(SMALL, CorpusInputs(), CorpusOutputs(out))
    return out


@pytest.fixture(scope="session")
def small_tokens(small_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "tokens"
    run_tokenize(TokenizeConfig(vocab_size=SMALL_VOCAB), TokenizeInputs(small_corpus), TokenizeOutputs(out))
    return out


@pytest.fixture(scope="session")
def corpus_docs(small_corpus) -> dict:
    """id -> record of every document of the small corpus."""
    docs = {}
    for path in sorted(small_corpus.glob("*/*.json.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                docs[record["id"]] = record
    return docs


@pytest.fixture
def write_corpus(tmp_path):
    """write_corpus({"src/a.jsonl": b"...", ...}) -> a corpus directory holding those files."""
    def write(files: dict) -> Path:
        root = tmp_path / "in"
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        return root
    return write


@pytest.fixture(scope="module")
def finished_run(small_tokens, tmp_path_factory) -> Path:
    """A tiny run trained for one step (tiny_runs.pretrain), once per test module; ``run`` is a copy."""
    from tiny_runs import pretrain

    run = tmp_path_factory.mktemp("finished") / "run-a"
    assert pretrain(small_tokens, run, 1) == 0
    return run


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A test's own copy of ``finished_run``, at tmp_path/run-a."""
    copy = tmp_path / "run-a"
    shutil.copytree(finished_run, copy)
    return copy
