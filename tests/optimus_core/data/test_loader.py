"""TokenDataset, BatchLoader and heldout_batches: exact examples, deterministic and resumable order."""
import json

import numpy as np
import pytest
import torch

from optimus_core.data.loader import BatchLoader, TokenDataset, _Permutation, heldout_batches
from optimus_core.data.shards import ShardError


def expected(i, seq_len, offset=0):
    w = seq_len + 1
    return torch.arange(offset + i * w, offset + (i + 1) * w, dtype=torch.int64)


def test_examples_are_consecutive_windows_across_files(simple_dir):
    ds = TokenDataset(simple_dir, "train", seq_len=9)  # 237 tokens -> 23 examples of 10
    assert len(ds) == 23 and ds.n_tokens == 237
    for i in range(len(ds)):  # examples 9 and 15 straddle file boundaries (100, 157)
        assert torch.equal(ds[i], expected(i, 9))
    assert ds[0].dtype == torch.int64 and ds[0].shape == (10,)
    assert torch.equal(ds[-1], ds[22])
    with pytest.raises(IndexError, match="example 23 out of range"):
        ds[23]


def test_sources_select_files(simple_dir):
    ds = TokenDataset(simple_dir, "train", seq_len=9, sources=["b"])
    assert len(ds) == 8 and torch.equal(ds[0], expected(0, 9, offset=157))  # b's values follow a's
    with pytest.raises(ValueError, match="'c' is not in the data"):
        TokenDataset(simple_dir, "train", seq_len=9, sources=["c"])


def test_truncated_token_file_is_refused(simple_dir):
    path = simple_dir / "train" / "a" / "part-0001.npy"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ShardError, match="56 tokens, the manifest says 57"):
        TokenDataset(simple_dir, "train", seq_len=9)


def test_permutation_is_a_bijection_keyed_by_seed_and_epoch():
    for n in (1, 2, 3, 7, 16, 17, 1000, 4099):
        assert sorted(_Permutation(n, 0, 0)(np.arange(n)).tolist()) == list(range(n))
    orders = {(s, e): tuple(_Permutation(1000, s, e)(np.arange(1000))) for s in (0, 1) for e in (0, 1)}
    assert len(set(orders.values())) == 4


def loader(ds, seed=0, global_batch=4, **kw):
    return BatchLoader(ds, global_batch=global_batch, seed=seed, **kw)


def test_same_seed_same_batches_and_each_epoch_visits_every_example_once(simple_dir):
    ds = TokenDataset(simple_dir, "train", seq_len=9)  # 23 examples; 5 batches of 4 per epoch
    a, b = loader(ds), loader(ds)
    batches = [a.next_batch() for _ in range(15)]
    assert all(torch.equal(x, b.next_batch()) for x in batches)
    assert not torch.equal(torch.stack(batches), torch.stack([loader(ds, seed=1).next_batch() for _ in range(15)]))
    starts = [(x[:, 0] // 10).tolist() for x in batches]  # example index of every row
    for epoch in range(3):
        seen = sum(starts[5 * epoch: 5 * epoch + 5], [])
        assert len(set(seen)) == 20 and set(seen) <= set(range(23))
    assert starts[:5] != starts[5:10]  # a new order every epoch
    for x in batches:  # every row is a whole example
        assert all(torch.equal(row, expected(int(row[0]) // 10, 9)) for row in x)
    assert a.state_dict()["epoch"] == 2


def test_ranks_get_disjoint_slices_of_the_same_global_batch(simple_dir):
    ds = TokenDataset(simple_dir, "train", seq_len=9)
    single = loader(ds, global_batch=4)
    ranks = [loader(ds, global_batch=4, rank=r, world_size=2) for r in range(2)]
    for _ in range(12):
        parts = [r.next_batch() for r in ranks]
        assert parts[0].shape == (2, 10)
        assert torch.equal(torch.cat(parts), single.next_batch())
        assert not set(parts[0][:, 0].tolist()) & set(parts[1][:, 0].tolist())


def test_resume_gives_the_batches_of_a_loader_that_never_stopped(simple_dir):
    ds = TokenDataset(simple_dir, "train", seq_len=9)
    reference = loader(ds, seed=7)
    want = [reference.next_batch() for _ in range(14)]
    for k in (0, 3, 5, 9):  # 5: exactly at an epoch's end
        first = loader(ds, seed=7)
        for _ in range(k):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        resumed = loader(ds, seed=7)
        resumed.load_state_dict(state)
        assert all(torch.equal(resumed.next_batch(), want[s]) for s in range(k, 14))
    # on another number of ranks: each rank's slice of the same global batches
    half = loader(ds, seed=7, rank=1, world_size=2)
    half.load_state_dict(state)
    assert torch.equal(half.next_batch(), want[9][2:])


def test_loader_refuses_other_data_or_batch(simple_dir):
    ds = TokenDataset(simple_dir, "train", seq_len=9)
    state = loader(ds).state_dict()
    with pytest.raises(ValueError, match="loader state global_batch = 4, but this loader has 2"):
        loader(ds, global_batch=2).load_state_dict(state)
    with pytest.raises(ValueError, match="loader state seed = 0, but this loader has 3"):
        loader(ds, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch = 6: must be >= 1 and divisible by world_size \\(4\\)"):
        loader(ds, global_batch=6, world_size=4)
    with pytest.raises(ValueError, match="global_batch = 24: the train split has only 23 examples of 10 tokens"):
        loader(ds, global_batch=24)
    with pytest.raises(ValueError, match="rank = 2, world_size = 2"):
        loader(ds, rank=2, world_size=2)


def test_heldout_batches_in_order_with_a_short_last_batch(simple_dir):
    got = list(heldout_batches(simple_dir, "a", seq_len=4, batch_size=4))  # 30 tokens -> 6 examples
    assert [tuple(x.shape) for x in got] == [(4, 5), (2, 5)]
    assert torch.equal(torch.cat(got), torch.stack([expected(i, 4) for i in range(6)]))
    assert [tuple(x.shape) for x in heldout_batches(simple_dir, "a", 4, 4, max_batches=1)] == [(4, 5)]
    assert list(heldout_batches(simple_dir, "b", seq_len=9, batch_size=4)) == []  # 5 tokens: not one example
    with pytest.raises(ValueError, match="'c' is not in the data"):
        list(heldout_batches(simple_dir, "c", seq_len=4, batch_size=4))


def test_source_without_val_files_yields_nothing(token_dir):
    d = token_dir({("train", "a"): [50], ("train", "b"): [50], ("val", "a"): [50]})
    assert list(heldout_batches(d, "b", seq_len=4, batch_size=2)) == []


def test_uint32_tokens_load_exactly(token_dir):
    d = token_dir({("train", "a"): [30]}, vocab_size=100_000)
    assert TokenDataset(d, "train", seq_len=4)[5].tolist() == list(range(25, 30))
