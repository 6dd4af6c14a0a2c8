"""A node fault: a loss that is not finite on some ranks only names their hosts and stops the run
(exit 76) with nothing updated or saved; on every rank it stays the model's (the loss guard's)."""
import json
import socket

import pytest
import torch

from optimus_core import presets
from optimus_core.parallel.launch import spawn_local
from optimus_core.train import checkpoint as ckpt
from optimus_core.train import node_faults
from optimus_core.train.node_faults import NodeFault, same_host, select_hosts


def test_same_host_ignores_the_domain_only():
    assert same_host("x4102c5s0b0n0", "x4102c5s0b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov")
    assert same_host("x4102c5s0b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov", "x4102c5s0b0n0")
    assert not same_host("x4102c5s0b0n0", "x4102c5s0b0n01")
    assert not same_host("127.0.0.1", "127.0.0.2")


def _rank(rank, host, bad, pipeline=(), loss_rank=True):
    return {"rank": rank, "host": host, "bad": bad, "loss_rank": loss_rank, "pipeline": list(pipeline)}


def test_select_names_the_hosts_of_some_ranks_not_of_all():
    assert select_hosts([_rank(0, "a", False), _rank(1, "a", False), _rank(2, "b", True), _rank(3, "b", False)]) == ["b"]
    assert select_hosts([_rank(0, "a", True), _rank(1, "b", True)]) == []  # every rank: the model's
    assert select_hosts([_rank(0, "a", False), _rank(1, "b", False)]) == []
    # Pipeline stages 0 (host a) and 1 (host b); only the last stage computes a loss: its whole
    # pipeline is named, since a fault on any stage reaches the loss there.
    ranks = [_rank(0, "a", False, (0, 2), loss_rank=False), _rank(1, "a", False, (1, 3), loss_rank=False),
             _rank(2, "b", True, (0, 2)), _rank(3, "c", False, (1, 3))]
    assert select_hosts(ranks) == ["a", "b"]


def test_record_keeps_earlier_hosts_and_refuses_a_foreign_file(tmp_path):
    node_faults.record(tmp_path, 5, ["b"])
    node_faults.record(tmp_path, 9, ["a"])
    data = node_faults.read(tmp_path / node_faults.FAULTS_FILE)
    assert data["hosts"] == ["a", "b"] and [e["step"] for e in data["events"]] == [5, 9]
    (tmp_path / "other.json").write_text('["not", "ours"]')
    with pytest.raises(ValueError, match="not a node-faults file"):
        node_faults.read(tmp_path / "other.json")
    assert node_faults.read(tmp_path / "absent.json") == {"hosts": [], "events": []}


STEPS, EVERY, FAULT_STEP = 6, 2, 4


def _cfg():
    return presets.get("mula-7b-a1b@laptop").run_config(**{
        "train.steps": STEPS, "train.checkpoint_every": EVERY, "train.eval_batches": 1, "train.device": "cpu",
        "train.global_batch": 4, "data.seq_len": 32, "schedule.warmup_steps": 2, "model.n_layers": 1,
        "model.moe.n_experts": 4, "model.moe.top_k": 2, "train.eval_every": 0})


def _faulty_rank(cfg_json, tokens_dir, run_dir, out_dir, bad_ranks):
    """A rank whose loss turns NaN at FAULT_STEP where its rank is in ``bad_ranks`` (a faulty tile)."""
    from optimus_core.config import RunConfig
    from optimus_core.parallel import init_distributed, shutdown
    from optimus_core.train import step as step_module
    from optimus_core.train.loop import Trainer

    torch.set_num_threads(1)
    cfg = RunConfig.from_json(cfg_json)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts, device="cpu")
    real, calls = step_module.micro_batch_loss, []

    def loss(*args, **kwargs):
        calls.append(1)
        value = real(*args, **kwargs)
        steps_done = (len(calls) - 1)  # one micro-batch a step, evaluations aside (none: eval_every 0)
        return value * float("nan") if mesh.rank in bad_ranks and steps_done + 1 == FAULT_STEP else value

    step_module.micro_batch_loss = loss
    trainer = Trainer(cfg, tokens_dir, run_dir, progress=False, mesh=mesh)
    try:
        trainer.fit()
        outcome = {"finished": trainer.step}
    except NodeFault as e:
        outcome = {"fault": e.hosts, "step": e.step, "exit_code": e.exit_code, "at": trainer.step}
    finally:
        shutdown(mesh)
    outcome["events"] = [e["kind"] for e in trainer.events]
    (out_dir / f"rank{mesh.rank}.json").write_text(json.dumps(outcome))


def _run(tmp_path, tokens_dir, bad_ranks):
    run_dir = tmp_path / "run"
    spawn_local(_faulty_rank, 2, (_cfg().to_json(), tokens_dir, run_dir, tmp_path, bad_ranks), start_method="fork")
    return run_dir, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_loss_not_finite_on_one_rank_names_its_host_and_stops_every_rank(tmp_path, tokens_dir):
    run_dir, outcomes = _run(tmp_path, tokens_dir, bad_ranks={1})
    host = socket.gethostname()  # both ranks run here: the faulty rank's host is this one
    for o in outcomes:
        assert o["fault"] == [host] and o["step"] == FAULT_STEP and o["exit_code"] == 76, o
        assert o["at"] == FAULT_STEP - 1  # no update at the faulty step
    assert "node_fault" in outcomes[0]["events"]
    data = node_faults.read(run_dir / node_faults.FAULTS_FILE)
    assert data["hosts"] == [host] and data["events"][0]["step"] == FAULT_STEP
    # nothing saved past the last good checkpoint
    assert [p.name for p in ckpt.list_step_dirs(run_dir)] == ["step_000002"]


def test_a_loss_not_finite_on_every_rank_stays_the_models(tmp_path, tokens_dir):
    run_dir, outcomes = _run(tmp_path, tokens_dir, bad_ranks={0, 1})
    for o in outcomes:
        assert o == {"finished": STEPS, "events": ["nonfinite"]}, o  # skipped by the guard, as before
    assert not (run_dir / node_faults.FAULTS_FILE).exists()
