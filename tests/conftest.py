"""Shared fixtures: small tokenized corpora, one of each per pytest run, built by the real stages."""
from pathlib import Path

import pytest
import torch

# One intra-op thread: the suite's models are tiny, and OpenMP threads that outnumber free
# cores (pytest beside another process on a 2-core machine) slow a step down by 5-10x.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokens_dir(tmp_path_factory) -> Path:
    """~0.8 MB of the embedded corpus, tokenized with a 4096-token BPE (the laptop vocabulary)."""
    from stages.corpus import CorpusConfig, CorpusInputs, CorpusOutputs, run_corpus
    from stages.tokenize import TokenizeConfig, TokenizeInputs, TokenizeOutputs, run_tokenize

    root = tmp_path_factory.mktemp("data")
    corpus = run_corpus(CorpusConfig(prose_bytes=300_000, code_bytes=300_000, docs_bytes=200_000, parts=2),
                        CorpusInputs(), CorpusOutputs(out_dir=root / "corpus")).out_dir
    return run_tokenize(TokenizeConfig(workers=2, vocab_size=4096), TokenizeInputs(corpus_dir=corpus),
                        TokenizeOutputs(out_dir=root / "tokens")).out_dir


@pytest.fixture(scope="session")
def code_tokens_dir(tmp_path_factory) -> Path:
    """Mostly code, 30% held out: documented functions in the val split, for the docstring task
    (a 512-token BPE; about a second to build)."""
    from stages.corpus import CorpusConfig, CorpusInputs, CorpusOutputs, run_corpus
    from stages.tokenize import TokenizeConfig, TokenizeInputs, TokenizeOutputs, run_tokenize

    root = tmp_path_factory.mktemp("code")
    corpus = run_corpus(CorpusConfig(prose_bytes=20_000, code_bytes=150_000, docs_bytes=20_000, parts=1),
                        CorpusInputs(), CorpusOutputs(out_dir=root / "corpus")).out_dir
    return run_tokenize(TokenizeConfig(vocab_size=512, val_fraction=0.3), TokenizeInputs(corpus_dir=corpus),
                        TokenizeOutputs(out_dir=root / "tokens")).out_dir
