"""The parallel checkpoint reader (optimus_core.train.checkpoint_reader) against DCP's own: a
part written in several files loads the same, whatever the threads; a truncated file fails
the load (a resume checks the files' checksums first: this is the reader's own behaviour)."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from optimus_core.train.checkpoint_reader import ParallelFileReader


def _save(path, files):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(64 + i, 33, generator=gen) for i in range(11)}
    tensors["ints"] = torch.arange(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path, thread_count=files), no_dist=True)
    return tensors


def _load(path, like, reader):
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_a_part_in_several_files_loads_as_dcps_reader_loads_it(tmp_path, threads):
    saved = _save(tmp_path, files=4)
    assert len(list(tmp_path.glob("*.distcp"))) == 4
    want = _load(tmp_path, saved, dcp.FileSystemReader(tmp_path))
    got = _load(tmp_path, saved, ParallelFileReader(tmp_path, threads=threads))
    for name in saved:
        assert torch.equal(got[name], saved[name]) and torch.equal(want[name], saved[name]), name


def test_a_truncated_file_fails_the_load(tmp_path):
    saved = _save(tmp_path, files=4)
    victim = sorted(tmp_path.glob("*.distcp"))[2]
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointException, match="EOFError"):  # DCP's (a BaseException), raised from a thread
        _load(tmp_path, saved, ParallelFileReader(tmp_path))


def test_threads_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="threads = 0"):
        ParallelFileReader(tmp_path, threads=0)
