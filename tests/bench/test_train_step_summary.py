"""bench/train_step.py's summary: the ratio to OLMo-core compares median steps on both sides, the
default variant gets its own ratio, and rewriting a summary keeps OLMo-core's line."""
import json

import pytest

from bench.train_step import summarize_file


def _variant(name, tokens_per_s, peak_gib=50.0, reserved_gib=None):
    return {"bench": "train_step", "variant": name, "tokens_per_s": tokens_per_s, "mfu": 0.3,
            "flops_per_token": 1.0, "peak_memory_bytes": peak_gib * 2**30,
            **({"peak_reserved_bytes": reserved_gib * 2**30} if reserved_gib else {})}


def test_ratio_uses_median_steps_and_survives_a_rewrite(tmp_path, capsys):
    path = tmp_path / "train-step-nvidia-h200.jsonl"
    olmo = {"bench": "olmo_core_olmoe_train_step", "tokens_per_s": 40_000.0, "step_ms_median": 200.0,
            "tokens_per_step": 8192, "peak_mem_gib": 55.0, "peak_reserved_gib": 66.0}
    lines = [_variant("7b8l-default", 60_000.0, 60.5, 66.0),
             _variant("7b8l-triton+compile", 61_440.0, 44.0, 70.0),
             _variant("7b8l-loop", 20_000.0), {"bench": "train_step_summary", "dense_matmul_tflops": 800.0}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    olmo_file = tmp_path / "olmo.jsonl"
    olmo_file.write_text(json.dumps(olmo) + "\n")

    from bench.train_step import _olmo_lines
    for given in (_olmo_lines(str(olmo_file)), None):  # the second rewrite finds OLMo-core's line in the file
        summarize_file(path, given, "nvidia-h200")
        out = [json.loads(line) for line in path.read_text().splitlines()]
        summary = out[-1]
        assert [line["bench"] for line in out].count("olmo_core_olmoe_train_step") == 1
        assert summary["olmo_core_tokens_per_s"] == 8192 / 0.2  # 40,960 from the median, not the mean's 40,000
        assert summary["ratio_vs_olmo_core"] == 61_440.0 / 40_960  # the best variant
        assert summary["ratio_default_vs_olmo_core"] == 60_000.0 / 40_960
        # memory: the default variant's, not the fastest one's
        assert summary["memory_vs_olmo_core"] == 60.5 / 55.0
        assert summary["memory_reserved_vs_olmo_core"] == 1.0
        assert summary["ablation_speedup"] == 61_440.0 / 20_000.0
        assert summary["dense_matmul_tflops"] == 800.0
    capsys.readouterr()


def test_back_to_back_steps_are_compared_where_measured(tmp_path, capsys):
    """A variant measured back to back (events between steps, no sync: OLMo-core's method) is
    ranked and compared by that step; the synced ratio is kept beside it."""
    path = tmp_path / "train-step-nvidia-h200.jsonl"
    olmo = {"bench": "olmo_core_olmoe_train_step", "tokens_per_s": 40_000.0, "step_ms_median": 200.0,
            "tokens_per_step": 8192, "peak_mem_gib": 55.0}
    overlapped = {**_variant("7b8l-default", 60_000.0), "tokens_per_s_back_to_back": 65_536.0}
    lines = [overlapped, _variant("7b8l-triton+compile", 62_000.0)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summarize_file(path, [olmo], "nvidia-h200")
    summary = json.loads(path.read_text().splitlines()[-1])
    assert summary["best_variant"] == "7b8l-default"  # 65,536 back to back beats 62,000
    assert summary["ratio_vs_olmo_core"] == summary["ratio_default_vs_olmo_core"] == 65_536.0 / 40_960
    assert summary["ratio_default_synced_vs_olmo_core"] == 60_000.0 / 40_960
    capsys.readouterr()


def test_the_fastest_of_several_olmo_core_runs_is_the_one_compared(tmp_path):
    """One GPU runs OLMo-core before and after ours: the summary compares with its faster run."""
    from bench.train_step import _olmo_lines

    runs = [{"bench": "olmo_core_olmoe_train_step", "tokens_per_s": 42_000.0, "step_ms_median": 195.0,
             "tokens_per_step": 8192},
            {"bench": "olmo_core_olmoe_train_step", "tokens_per_s": 50_000.0, "step_ms_median": 160.0,
             "tokens_per_step": 8192}]
    path = tmp_path / "olmo-core.jsonl"
    path.write_text("".join(json.dumps(run) + "\n" for run in runs))
    [line] = _olmo_lines(str(path))
    assert line["step_ms_median"] == 160.0 and line["olmo_core_runs_step_ms_median"] == [195.0, 160.0]


def test_repeated_passes_are_summarized_by_their_slower_median(tmp_path, capsys):
    """--repeat: each variant by its median pass, the slower middle one of an even count (the
    claim least favourable to us), every pass's tokens/s kept; the best variant is picked by it."""
    path = tmp_path / "train-step-nvidia-h200.jsonl"
    olmo = {"bench": "olmo_core_olmoe_train_step", "tokens_per_s": 40_000.0, "step_ms_median": 200.0,
            "tokens_per_step": 8192, "peak_mem_gib": 55.0}
    passes = [({**_variant("7b8l-default", tps), "pass": i}) for i, tps in enumerate((63_000.0, 61_000.0))]
    passes += [({**_variant("7b8l-triton+compile-xent", tps), "pass": i})
               for i, tps in enumerate((64_000.0, 60_000.0, 62_000.0))]
    path.write_text("".join(json.dumps(line) + "\n" for line in passes))
    summarize_file(path, [olmo], "nvidia-h200")
    summary = json.loads(path.read_text().splitlines()[-1])
    assert summary["ratio_default_vs_olmo_core"] == 61_000.0 / 40_960
    assert summary["best_variant"] == "7b8l-triton+compile-xent" and summary["best_tokens_per_s"] == 62_000.0
    assert summary["tokens_per_s_passes"] == {"7b8l-default": [63_000.0, 61_000.0],
                                              "7b8l-triton+compile-xent": [64_000.0, 60_000.0, 62_000.0]}
    capsys.readouterr()


def test_each_micro_batch_is_compared_with_olmo_cores_line_of_that_micro_batch(tmp_path, capsys):
    """--batch 2 8: every variant at each micro-batch, each compared with OLMo-core's run at the
    same micro-batch (--micro-batch N); the first micro-batch's fields stay at top level."""
    from bench.train_step import _olmo_lines

    def olmo(mb, step_ms):
        return {"bench": "olmo_core_olmoe_train_step", "tokens_per_s": 1.0, "step_ms_median": step_ms,
                "tokens_per_step": mb * 4096, "config": {"micro_batch": mb, "seq_len": 4096}}
    olmo_file = tmp_path / "olmo-core.jsonl"
    olmo_file.write_text("".join(json.dumps(line) + "\n" for line in (olmo(8, 400.0), olmo(2, 200.0), olmo(8, 380.0))))
    records = [{**_variant("7b8l-default", tps), "batch": b, "series": f"7b8l-default@mb{b}"}
               for b, tps in ((2, 60_000.0), (8, 100_000.0))]
    path = tmp_path / "train-step-nvidia-h200.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in records))
    summarize_file(path, _olmo_lines(str(olmo_file)), "nvidia-h200")
    summary = json.loads(path.read_text().splitlines()[-1])
    by = summary["by_micro_batch"]
    assert by["2"]["olmo_core_tokens_per_s"] == 2 * 4096 / 0.2
    assert by["8"]["olmo_core_tokens_per_s"] == 8 * 4096 / 0.38  # the faster of its two runs at 8
    assert by["8"]["ratio_vs_olmo_core"] == 100_000.0 / (8 * 4096 / 0.38)
    assert summary["ratio_vs_olmo_core"] == by["2"]["ratio_vs_olmo_core"] == 60_000.0 / (2 * 4096 / 0.2)
    capsys.readouterr()


def test_ingest_names_old_records_by_their_variant(tmp_path):
    """Files written before the micro-batch axis have no "series": ingested by their variant."""
    pytest.importorskip("zarr")
    from bench.common import ingest
    from optimus_core.store import open_store

    path = tmp_path / "train-step-x.jsonl"
    lines = [_variant("7b8l-default", 1.0), {**_variant("7b8l-default", 2.0), "batch": 8, "series": "7b8l-default@mb8"},
             {"bench": "train_step_summary"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ingest(path, str(tmp_path / "store.zarr"), key="series", fallback="variant")
    store = open_store(str(tmp_path / "store.zarr"), mode="r")
    assert {"7b8l-default", "7b8l-default_mb8"} <= set(store.tables("bench-train-step-x"))


def test_the_best_variant_is_taken_on_its_median_pass():
    """Each variant's passes are reduced to their median before the best is chosen."""
    from bench.train_step import summarize

    records = [_variant("7b8l-default", 100.0), _variant("7b8l-default", 104.0),
               _variant("7b8l-triton", 120.0), _variant("7b8l-triton", 90.0), _variant("7b8l-triton", 95.0)]
    for i, r in enumerate(records):
        r["pass"] = i
    summary = summarize(records, [], None, "nvidia-h200")
    assert summary["best_variant"] == "7b8l-default" and summary["best_tokens_per_s"] == 100.0  # the slower median
