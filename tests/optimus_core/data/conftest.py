"""A synthetic token directory whose token values are their positions in the split's stream,
so any example's expected content is known: example i of seq_len L is arange(i*(L+1), (i+1)*(L+1))."""
from pathlib import Path

import numpy as np
import pytest

from optimus_core.data.shards import IndexRow, Manifest, TokenFile, sha256_file, token_dtype, write_index, write_manifest


def make_token_dir(root: Path, layout: dict, vocab_size: int = 65536) -> Path:
    """layout: {(split, source): [tokens of file 0, tokens of file 1, ...]}; every file is one
    document. Token values count up through each split's files in sorted path order."""
    root.mkdir(parents=True)
    (root / "tokenizer.json").write_text("{}")
    dtype = token_dtype(vocab_size)
    paths = {(split, source, i): f"{split}/{source}/part-{i:04d}"
             for (split, source), lengths in layout.items() for i in range(len(lengths))}
    next_value = {"train": 0, "val": 0}
    files = []
    for (split, source, i), stem in sorted(paths.items(), key=lambda kv: kv[1]):
        n = layout[(split, source)][i]
        (root / stem).parent.mkdir(parents=True, exist_ok=True)
        np.arange(next_value[split], next_value[split] + n, dtype=dtype).tofile(root / f"{stem}.npy")
        next_value[split] += n
        write_index(root / f"{stem}.csv.gz", [IndexRow(0, n, f"{source}/in-{i}.jsonl", f"{source}-{i}")])
        files.append(TokenFile(split, source, f"{stem}.npy", f"{stem}.csv.gz", n_tokens=n, n_docs=1, n_bytes=4 * n,
                               tokens_sha256=sha256_file(root / f"{stem}.npy"),
                               index_sha256=sha256_file(root / f"{stem}.csv.gz"),
                               input=f"{source}/in-{i}.jsonl", input_sha256="0" * 64))
    write_manifest(root, Manifest(vocab_size=vocab_size, eos_id=0, pad_id=1, dtype=str(dtype),
                                  tokenizer_sha256=sha256_file(root / "tokenizer.json"), val_fraction=0.1,
                                  files=tuple(files)))
    return root


@pytest.fixture
def token_dir(tmp_path):
    """make(layout, vocab_size=65536) -> a fresh synthetic token directory."""
    return lambda layout, vocab_size=65536: make_token_dir(tmp_path / f"tokens{len(list(tmp_path.iterdir()))}",
                                                           layout, vocab_size)


@pytest.fixture
def simple_dir(token_dir):
    """train: a = 100 + 57 tokens, b = 80; val: a = 30, b = 5 (shorter than most examples)."""
    return token_dir({("train", "a"): [100, 57], ("train", "b"): [80], ("val", "a"): [30], ("val", "b"): [5]})
