"""bench/loss_parity.py: the verdict over seeds, and one small sweep end to end on the CPU."""
import json

import pytest

from bench.loss_parity import compare, main


def _run(side, seed, final):
    return {"side": side, "seed": seed, "loss": [9.0, 8.0, final]}


def test_a_difference_within_the_seeds_spread_passes_and_one_beyond_it_fails():
    close = [_run("A", 0, 5.0), _run("B", 0, 5.01), _run("A", 1, 5.2), _run("B", 1, 5.19)]
    got = compare(close, window=1)
    assert got["window_loss_a"] == [5.0, 5.2] and got["mean_b_minus_a"] == pytest.approx(0.0)
    assert got["seed_std_a"] == pytest.approx(0.1414, abs=1e-4) and got["within_seed_spread"]
    apart = [_run("A", 0, 5.0), _run("B", 0, 5.3), _run("A", 1, 5.1), _run("B", 1, 5.4)]
    got = compare(apart, window=1)
    assert got["mean_b_minus_a"] == pytest.approx(0.3) and not got["within_seed_spread"]
    assert compare(apart, window=3)["window_loss_a"] == pytest.approx([22 / 3, 22.1 / 3])  # the window's mean


def test_a_small_sweep_writes_both_sides_of_every_seed(tokens_dir, tmp_path, capsys):
    main(["--data", str(tokens_dir), "--steps", "2", "--window", "1", "--seeds", "0", "1", "--dtype", "float32",
          "--set", "train.global_batch=2", "--set", "data.seq_len=32", "--set", "train.eval_batches=1",
          "--b", "optim.lr=0.001", "--out", str(tmp_path), "--store", ""])
    lines = [json.loads(line) for line in (tmp_path / "loss-parity-cpu.jsonl").read_text().splitlines()]
    runs, summary = lines[:-1], lines[-1]
    assert [(r["side"], r["seed"]) for r in runs] == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert all(len(r["loss"]) == 2 for r in runs) and runs[1]["overrides"]["optim.lr"] == 0.001
    assert summary["bench"] == "loss_parity_summary" and summary["a"] == {"train.global_batch": 2, "data.seq_len": 32,
                                                                           "train.eval_batches": 1}
    assert "final-window loss" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        main(["--data", "x", "--seeds", "0"])  # one seed: no spread to compare with
    with pytest.raises(SystemExit):
        main(["--data", "x", "--steps", "5", "--window", "6"])
