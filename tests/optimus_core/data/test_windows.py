"""The paper's data order: per-file windows (tails dropped), one numpy permutation, strided ranks."""
import numpy as np
import pytest
import torch

from optimus_core.config import DataConfig
from optimus_core.data.loader import BatchLoader
from optimus_core.data.windows import FileWindows, WindowLoader, training_loader


def test_windows_are_cut_per_file_and_tails_dropped(simple_dir):
    # train files in path order: a/0 (100 tokens: values 0..99), a/1 (57: 100..156), b/0 (80: 157..236)
    w = FileWindows(simple_dir, "train", seq_len=9)
    assert len(w) == 11 + 6 + 8  # 100 // 9, 57 // 9, 80 // 9: no window crosses a file
    assert torch.equal(w[0], torch.arange(0, 9))
    assert torch.equal(w[10], torch.arange(90, 99))      # a/0's last whole window; token 99 dropped
    assert torch.equal(w[11], torch.arange(100, 109))    # a/1 starts afresh
    assert torch.equal(w[17], torch.arange(157, 166))    # b/0
    assert w[0].dtype == torch.int64
    with pytest.raises(IndexError, match="window 25 out of range"):
        w[25]


def test_the_order_is_numpys_legacy_permutation_and_ranks_take_every_dth(simple_dir):
    """Step s takes order[s G : (s + 1) G]; data rank r of D its positions s G + i D + r (the
    authors' window perm[(s B + i) D + r], B = G / D); the order is np.random.seed(42) then
    np.random.permutation(N)."""
    windows = FileWindows(simple_dir, "train", seq_len=9)
    np.random.seed(42)
    order = np.random.permutation(len(windows))
    G, D = 6, 3
    loaders = [WindowLoader(windows, G, seed=42, rank=r, world_size=D) for r in range(D)]
    for step in range(len(windows) // G):
        for r, loader in enumerate(loaders):
            got = loader.next_batch()
            want = torch.stack([windows[int(order[step * G + i * D + r])] for i in range(G // D)])
            assert torch.equal(got, want), (step, r)
    assert loaders[0].epoch_steps == len(windows) // G == 4
    # one process sees the same global batch as the D ranks together
    whole = WindowLoader(windows, G, seed=42).next_batch()
    assert sorted(whole[:, 0].tolist()) == sorted(windows[int(w)][0].item() for w in order[:G])


def test_resume_and_another_world_size_continue_the_same_order(simple_dir):
    windows = FileWindows(simple_dir, "train", seq_len=9)
    straight = WindowLoader(windows, 4, seed=42)
    batches = [straight.next_batch() for _ in range(10)]  # past an epoch (6 steps of 4 of 25 windows)
    first = WindowLoader(windows, 4, seed=42)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    halves = [WindowLoader(windows, 4, seed=42, rank=r, world_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for step in range(3, 10):
        rows = [h.next_batch() for h in halves]
        together = torch.cat(rows)
        assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, batches[step].tolist())), step
    assert halves[0].batches_drawn == 10 and halves[0].epoch == 1
    # the second epoch is the generator's next permutation (the authors' second order)
    rng = np.random.RandomState(42)
    rng.permutation(len(windows))
    second = rng.permutation(len(windows))
    assert torch.equal(batches[6], torch.stack([windows[int(w)] for w in second[:4]]))


def test_a_resume_refuses_another_order_or_data(simple_dir):
    windows = FileWindows(simple_dir, "train", seq_len=9)
    stream_state = training_loader(simple_dir, DataConfig(seq_len=9, seed=42), 4).state_dict()
    with pytest.raises(ValueError, match="loader state order = 'stream', but this loader has 'file_windows'"):
        WindowLoader(windows, 4, seed=42).load_state_dict(stream_state)
    old_state = {k: v for k, v in stream_state.items() if k != "order"}  # a checkpoint before the order was named
    with pytest.raises(ValueError, match="order = 'stream'"):
        WindowLoader(windows, 4, seed=42).load_state_dict(old_state)
    with pytest.raises(ValueError, match="loader state seed = 42, but this loader has 7"):
        WindowLoader(windows, 4, seed=7).load_state_dict(WindowLoader(windows, 4, seed=42).state_dict())
    with pytest.raises(ValueError, match="order = 'file_windows', but this loader has 'stream'"):
        training_loader(simple_dir, DataConfig(seq_len=9), 4).load_state_dict(WindowLoader(windows, 4, seed=0).state_dict())


def test_training_loader_follows_data_order(simple_dir):
    assert isinstance(training_loader(simple_dir, DataConfig(seq_len=9), 4), BatchLoader)
    paper = training_loader(simple_dir, DataConfig(seq_len=9, seed=42, order="file_windows"), 4, rank=1, world_size=2)
    assert isinstance(paper, WindowLoader) and paper.next_batch().shape == (2, 9)


def test_too_little_data_is_one_clear_error(simple_dir):
    with pytest.raises(ValueError, match=r"global_batch = 64: the train split has only 25 windows of 9 tokens"):
        WindowLoader(FileWindows(simple_dir, "train", seq_len=9), 64, seed=42)
    with pytest.raises(ValueError, match="seq_len = 1: must be an integer >= 2"):
        FileWindows(simple_dir, "train", seq_len=1)


def test_an_order_drawn_once_into_a_file_is_the_loaders_own_and_every_rank_maps_it(simple_dir, monkeypatch):
    from optimus_core.data import window_order

    windows = FileWindows(simple_dir, "train", seq_len=9)
    drawn = [WindowLoader(windows, 4, seed=42, rank=r, world_size=2) for r in range(2)]
    want = [[loader.next_batch() for _ in range(10)] for loader in drawn]  # two epochs and a half
    paths = [window_order.write_order(windows, 42, e) for e in range(3)]
    assert [p.parent.name for p in paths] == ["window-order"] * 3 and paths[0].name.startswith("train-s9-seed42-e0-")
    assert np.load(paths[0]).dtype == np.uint32
    assert np.array_equal(np.load(paths[1]), window_order.draw_order(len(windows), 42, 1))

    def no_drawing(*args):
        raise AssertionError("drew the order although its file exists")

    monkeypatch.setattr("optimus_core.data.windows.draw_order", no_drawing)
    mapped = [WindowLoader(windows, 4, seed=42, rank=r, world_size=2) for r in range(2)]
    for r, loader in enumerate(mapped):
        for step in range(10):
            assert torch.equal(loader.next_batch(), want[r][step]), (r, step)
    assert window_order.write_order(windows, 42, 0) == paths[0]  # kept, not drawn again


def test_an_order_file_of_other_data_is_not_used_and_a_damaged_one_is_refused(simple_dir):
    from optimus_core.data import window_order

    nine = FileWindows(simple_dir, "train", seq_len=9)
    window_order.write_order(nine, 42, 0)
    eight = FileWindows(simple_dir, "train", seq_len=8)
    assert window_order.read_order(eight, 42, 0) is None and window_order.read_order(nine, 7, 0) is None
    path = window_order.order_path(nine, 42, 0)
    np.save(path, np.arange(3, dtype=np.uint32))  # cut short
    with pytest.raises(ValueError, match=r"3,\) window numbers, the train split has 25 windows; delete it"):
        WindowLoader(nine, 4, seed=42).next_batch()


def test_the_window_order_command_draws_each_epochs_file_once(simple_dir, capsys):
    from workflow.cli import main

    assert main(["window-order", "--data", str(simple_dir), "--seq-len", "9", "--epochs", "2"]) in (0, None)
    out = capsys.readouterr().out
    assert "the order of 25 windows of 9 tokens, seed 42" in out and out.count("window-order/train-s9-seed42-") == 2
    assert main(["window-order", "--data", str(simple_dir), "--epochs", "0"]) == 2
    assert "--epochs = 0: must be >= 1" in capsys.readouterr().err
