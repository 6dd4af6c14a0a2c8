"""The token-shard format: dtype choice, index files, manifest loading and verification."""
import gzip
import json

import numpy as np
import pytest

from optimus_core.data.shards import (IndexRow, ShardError, load_manifest, open_tokens, read_index, token_dtype,
                                      verify, write_index)


def test_dtype_is_uint16_up_to_65536_ids_then_uint32():
    assert token_dtype(4096) == np.dtype("<u2")
    assert token_dtype(50304) == np.dtype("<u2")  # OLMoE's padded vocabulary
    assert token_dtype(65536) == np.dtype("<u2")  # ids 0..65535
    assert token_dtype(65537) == np.dtype("<u4")
    assert token_dtype(151_936) == np.dtype("<u4")
    with pytest.raises(ValueError, match="vocab_size = 0"):
        token_dtype(0)


def test_index_round_trips_awkward_ids_reproducibly(tmp_path):
    rows = [IndexRow(0, 5, "src/a.json.gz", "plain"), IndexRow(5, 9, "src/a.json.gz", 'comma, "quote"'),
            IndexRow(9, 12, "src/b,c.jsonl", "new\nline")]
    write_index(tmp_path / "a.csv.gz", rows)
    write_index(tmp_path / "b.csv.gz", rows)
    assert read_index(tmp_path / "a.csv.gz") == rows
    assert (tmp_path / "a.csv.gz").read_bytes() == (tmp_path / "b.csv.gz").read_bytes()
    assert gzip.decompress((tmp_path / "a.csv.gz").read_bytes()).startswith(b"0,5,src/a.json.gz,plain\n")


def test_tokens_are_raw_little_endian_without_header(tmp_path):
    values = np.array([0, 1, 70_000, 2**32 - 1], dtype="<u4")
    (tmp_path / "t.npy").write_bytes(values.tobytes())
    tokens = open_tokens(tmp_path / "t.npy", "uint32")
    assert isinstance(tokens, np.memmap) and tokens.tolist() == values.tolist()
    (tmp_path / "e.npy").write_bytes(b"")
    assert len(open_tokens(tmp_path / "e.npy", "uint16")) == 0


def test_manifest_reads_back(simple_dir):
    m = load_manifest(simple_dir)
    assert (m.vocab_size, m.eos_id, m.pad_id, m.dtype, m.root) == (65536, 0, 1, "uint16", simple_dir)
    assert m.sources == ["a", "b"]
    assert [f.tokens for f in m.files_for("train")] == ["train/a/part-0000.npy", "train/a/part-0001.npy",
                                                        "train/b/part-0000.npy"]
    assert [f.tokens for f in m.files_for("val", ["b"])] == ["val/b/part-0000.npy"]
    assert m.totals["train"]["a"].tokens == 157 and m.totals["val"]["b"].bytes == 20
    raw = json.loads((simple_dir / "manifest.json").read_text())
    assert raw["totals"]["train"]["a"] == {"docs": 2, "tokens": 157, "bytes": 628}
    with pytest.raises(ValueError, match=r"'zzz' is not in the data \(known: a, b\)"):
        m.files_for("train", ["zzz"])
    with pytest.raises(ValueError, match="split = 'test'"):
        m.files_for("test")


def test_missing_or_foreign_manifest(tmp_path, simple_dir):
    with pytest.raises(ShardError, match="not a complete `optimus tokenize` output"):
        load_manifest(tmp_path / "nothing")
    raw = json.loads((simple_dir / "manifest.json").read_text())
    (simple_dir / "manifest.json").write_text(json.dumps(dict(raw, version=99)))
    with pytest.raises(ShardError, match="version 99"):
        load_manifest(simple_dir)


def test_verify_names_the_file_that_differs(simple_dir):
    assert verify(simple_dir).files  # intact
    target = simple_dir / "train" / "b" / "part-0000.npy"
    data = bytearray(target.read_bytes())
    data[3] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{target}: sha256 .* does not match"):
        verify(simple_dir)
    target.write_bytes(bytes(data[:-2]))
    with pytest.raises(ShardError, match=rf"{target}: 158 bytes, the manifest says 160"):
        verify(simple_dir)
    target.unlink()
    with pytest.raises(ShardError, match=rf"{target}: listed in the manifest but missing"):
        verify(simple_dir)
