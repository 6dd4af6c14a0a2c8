"""The rehearse stage: records to a JSON-lines file (rewritten after each, newer records replacing
older ones of a layout) and to the store, from which the report's "Memory per tile" is drawn."""
import json

from optimus_core import presets
from optimus_core.store import open_store
from stages.rehearse import Rehearsal, RehearseConfig, RehearseOutputs, ingest, run_rehearse
from stages.report import _memory


def _job(world):
    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{"parallel.ep": 2, "train.global_batch": 16,
                                                          "train.micro_batch": 1, "execution.dtype": "bfloat16"})
    return Rehearsal("laptop-moe", cfg, world, ("none", 1), budget_gib=1.0)


def test_records_go_to_the_file_and_the_store_and_the_report(tmp_path):
    out, store = tmp_path / "rehearsal-meta.jsonl", tmp_path / "store.zarr"
    run_rehearse(RehearseConfig([_job(8), _job(16)], device="meta"), RehearseOutputs(jsonl=out))
    run_rehearse(RehearseConfig([_job(8)], device="meta"), RehearseOutputs(jsonl=out))  # again: replaces its record
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["name"], r["world"]) for r in lines[:-1]] == [("laptop-moe", 16), ("laptop-moe", 8)]
    assert lines[-1]["bench"] == "rehearsal_summary" and lines[-1]["records"] == 2
    assert ingest(out, store) == f"wrote run rehearsal-meta (2 records) to {store}"
    text = "\n".join(_memory(open_store(store, mode="r")))
    assert "## Memory per tile" in text
    rows = [line for line in text.splitlines() if line.startswith("| laptop-moe")]
    assert [row.split(" | ")[1] for row in rows] == ["8", "16"]  # by tile count
    assert rows[0].split(" | ")[2] == "1"  # no pipeline stages
    assert rows[0].split(" | ")[7] == "1.0"  # the budget
