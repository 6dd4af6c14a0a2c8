"""One rank of a layout on the fake process group: it builds its real share, runs real steps
with loopback collectives, writes its part of a checkpoint, and leaves no process group behind."""
import math

import pytest
import torch
import torch.distributed as dist

from optimus_core import presets
from optimus_core.config import ConfigError
from optimus_core.rehearsal import fmt, rehearse


def _cfg(**extra):
    return presets.get("mula-7b-a1b@laptop").run_config(**{
        "parallel.ep": 2, "parallel.dp_shard": 4, "train.global_batch": 16, "train.micro_batch": 1,
        "execution.dtype": "bfloat16", "model.n_layers": 2, "data.seq_len": 32, **extra})


def test_a_rank_of_eight_trains_on_loopback_collectives_and_writes_its_checkpoint(tmp_path):
    cfg = _cfg(**{"execution.activation_checkpointing": "full"})
    record = rehearse(cfg, 8, rank=3, device="cpu", steps=2, micro_batches=2, save_dir=str(tmp_path))
    assert not dist.is_initialized()  # the fake world is gone
    assert record["steps"] == 2 and record["accumulation"] == 2 and record["checkpointing"] == "full/1"
    # a fresh model's loss on random tokens: about ln(vocabulary), as on a real rank of 8
    assert abs(record["loss"] - math.log(cfg.model.vocab_size)) < 0.5
    assert all(math.isfinite(g) and g > 0 for g in record["grad_norms"])
    assert record["shares_gib"] == record["model_shares_gib"]  # the memory model's static terms, exactly
    assert (tmp_path / ".metadata").is_file() and any(tmp_path.glob("*.distcp"))
    assert "8 ranks (ep 2, full/1, gathered per micro batch, rank 3)" in fmt(record)


def test_warm_up_steps_run_untimed_and_either_exchange_rehearses():
    """The paper's exchange on the loopback world (the gathers return this rank's rows for every
    peer); warm-up steps train but are not among the timed ones."""
    record = rehearse(_cfg(**{"execution.expert_exchange": "all_gather"}), 8, rank=2, device="cpu", steps=2,
                      micro_batches=1, warmup=1)
    assert record["exchange"] == "all_gather" and record["warmup"] == 1
    assert len(record["step_s"]) == 2 and len(record["grad_norms"]) == 3
    assert math.isfinite(record["loss"])


def test_a_rehearsed_rank_is_freed_when_the_rehearsal_returns(monkeypatch):
    # The MoE layers' routing losses, left on the modules after the step, would close a cycle
    # through the autograd graph and FSDP2's autograd functions that gc cannot see: every
    # rehearsal of a sweep would be measured with the earlier ones' weights still allocated.
    import gc
    import weakref

    from optimus_core.train import build

    built = []

    def build_model(*args, **kwargs):
        model = real(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    real = build.build_model
    monkeypatch.setattr(build, "build_model", build_model)
    rehearse(_cfg(), 8, rank=1, device="cpu", steps=1, micro_batches=2)
    gc.collect()
    assert len(built) == 1 and built[0]() is None


def test_a_bad_layout_is_an_error_before_any_process_group():
    with pytest.raises(ConfigError, match=r"parallel.dp_shard = 4: must divide the world size \(6 ranks\)"):
        rehearse(_cfg(), 6, device="meta")
    with pytest.raises(ValueError, match=r"--rank 8: must be in \[0, 8\)"):
        rehearse(_cfg(), 8, rank=8, device="meta")
    assert not dist.is_initialized()


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_heaviest_pipeline_stage_is_rehearsed_in_its_one_f_one_b_order(device):
    """PP 2 over 16 ranks: the rank rehearsed is one of the 8 of the stage the memory model puts
    highest, its shares exactly the model's; on the CPU its micro-batches run in 1F1B order
    with random neighbours and it takes its update."""
    from optimus_core.execution import resolve_choices
    from optimus_core.memory import MemoryLayout, estimate, heaviest_stage

    cfg = _cfg(**{"parallel.pp": 2})
    record = rehearse(cfg, 16, rank=1, device=device, steps=1)
    assert not dist.is_initialized()
    plan = resolve_choices(cfg, "cpu", 16)
    layouts = MemoryLayout.of_run(cfg, 16, ("none", 1), plan).stage_layouts()
    heaviest = heaviest_stage(cfg.model, layouts[0])
    assert record["pp"] == 2 and record["stage"] == heaviest.stage
    assert record["model_gib"] == max(estimate(cfg.model, S).peak_gib for S in layouts)
    assert record["in_flight"] == min(2, 2 - heaviest.stage)  # 2 micro-batches of one sequence a step
    assert record["shares_gib"] == record["model_shares_gib"]
    assert f"stage {heaviest.stage} of 2" in fmt(record)
    if device == "cpu":
        assert record["steps"] == 1 and all(math.isfinite(g) and g > 0 for g in record["grad_norms"])
        assert math.isfinite(record["loss"]) == (heaviest.stage == 1)  # the loss is the last stage's


@pytest.mark.parametrize("pp, chunks, micro_batches", [(4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_each_pipeline_rank_runs_its_stages_in_the_schedules_order(pp, chunks, micro_batches):
    """Every forward of each of a rank's stages before its backward, each once; as many in flight
    at the most as the memory model prices (in_flight, in micro-batches of one stage)."""
    from collections import Counter

    from optimus_core.memory import MemoryLayout
    from optimus_core.rehearsal import schedule_order

    for stage in range(pp):
        order = schedule_order(pp, chunks, stage, micro_batches)
        assert Counter(order) == Counter([(op, v, i) for op in "FB" for v in range(chunks)
                                          for i in range(micro_batches)])
        held, peak = set(), 0
        for op, v, i in order:
            if op == "F":
                held.add((v, i))
            else:
                held.remove((v, i))  # (KeyError: a backward before its forward)
            peak = max(peak, len(held))
        layout = MemoryLayout(pp=pp, stage=stage, chunks=chunks, accumulation=micro_batches,
                              cut=tuple((k, k + 1) for k in range(pp * chunks)))
        assert peak == layout.in_flight * chunks
    with pytest.raises(ValueError, match="interleaved stages run them in groups of pp = 4"):
        schedule_order(4, 2, 0, 6)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_rank_of_interleaved_stages_is_rehearsed(device):
    """PP 2 x 2 chunks over 16 ranks (4 layers): the heaviest rank holds two stages, its shares
    the model's; on the CPU both stages' micro-batches run in the interleaved order, the weights
    gathered once a step, and it takes its update. (Stages of 8 ranks: a rehearsed mesh of the
    shape of a later test's real one has been seen to spoil that test's checkpoint in this
    process; optimus_core.rehearsal's module doc.)"""
    cfg = _cfg(**{"parallel.pp": 2, "parallel.pp_chunks": 2, "parallel.pp_schedule": "interleaved_1f1b",
                  "model.n_layers": 4, "parallel.dp_shard": 0, "execution.weight_gathers": "per_step"})
    record = rehearse(cfg, 16, device=device, steps=1)
    assert not dist.is_initialized()
    assert record["pp"] == 2 and record["weight_gathers"] == "per_step"
    assert record["shares_gib"] == record["model_shares_gib"]
    if device == "cpu":
        assert record["steps"] == 1 and all(math.isfinite(g) and g > 0 for g in record["grad_norms"])
