"""Pipeline parallelism (optimus_core.parallel.pipeline): the stages' cut, the routing sums that
carry the load-balancing loss down the pipeline, and runs of 2 and 4 gloo ranks (PP 2, PP 2 x
DP 2, PP 2 x EP 2, PP 4) against the one-process run of the same model, data and global batch,
checkpoints across pipeline degrees included."""
import json
import subprocess
import sys
import shutil

import pytest
import torch

from optimus_core.config import (ConfigError, DataConfig, ExecutionConfig, ModelConfig, MoEConfig, ParallelConfig,
                                 RunConfig, ScheduleConfig, TrainConfig)
from optimus_core.execution import plan_execution
from optimus_core.model.transformer import Transformer
from optimus_core.parallel import init_distributed, shutdown
from optimus_core.parallel.mesh import pipeline_layout
from optimus_core.parallel.pipeline import add_routing_sums, aux_from_routing_sums, keep_stage
from optimus_core.train.loop import Trainer
from ranks import train_on_ranks
from sinks import ListSink

STEPS = 10


def _cfg(pp=1, ep=1, steps=STEPS, recompute="none", schedule="cosine", lb_form="per_layer", micro_batch=2, chunks=1,
         gathers="auto", dp_shard=0):
    # micro_batch 2 everywhere: the load-balancing loss is a per-forward statistic, so the
    # 1-process run must see the same 2-sequence forwards as the stages do (global batch 8)
    return RunConfig(
        model=ModelConfig(vocab_size=4096, d_model=32, n_layers=4, n_heads=4, max_seq_len=32,
                          moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, bias_update_rate=1e-3, z_loss_coef=1e-3,
                                        lb_loss_form=lb_form)),
        train=TrainConfig(steps=steps, global_batch=8, micro_batch=micro_batch, device="cpu", eval_batches=1),
        data=DataConfig(seq_len=32), schedule=ScheduleConfig(kind=schedule, warmup_steps=3),
        parallel=ParallelConfig(ep=ep, pp=pp, pp_chunks=chunks, dp_shard=dp_shard,
                                pp_schedule="interleaved_1f1b" if chunks > 1 else "1f1b"),
        execution=ExecutionConfig(activation_checkpointing=recompute, weight_gathers=gathers))


def _rows(sink):
    train = sink.rows["train"]
    return {key: [float(r[key]) for r in train] for key in ("step", "loss", "grad_norm", "lb_loss", "z_loss")} | {
        "eval": [r["loss"] for r in sink.rows.get("eval", [])], "load": [r["expert_load"].tolist() for r in train]}


def _single(cfg, tokens_dir, run_dir):
    sink = ListSink()
    Trainer(cfg, tokens_dir, run_dir, writer=sink, progress=False).fit()
    return _rows(sink)


def _ranks(nproc, cfg, tokens_dir, run_dir, out_path):
    return train_on_ranks(nproc, cfg, tokens_dir, run_dir, out_path, _rows)


def _close(got, ref):
    assert got["step"] == ref["step"]
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])) < 1e-5
    assert max(abs(a - b) for a, b in zip(got["eval"], ref["eval"])) < 1e-5
    assert max(abs(a - b) for a, b in zip(got["lb_loss"], ref["lb_loss"])) < 1e-6
    assert max(abs(a - b) for a, b in zip(got["z_loss"], ref["z_loss"])) < 1e-6
    # the clip's norm spans the stages; the routing counts are every layer's, every rank's
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(got["load"]), torch.tensor(ref["load"]))


# ----------------------------------------------------------------------------- the cut

def test_stage_layers_cut_evenly_or_as_given():
    assert ParallelConfig(pp=4).stage_layers(8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert ParallelConfig(pp=2, pp_split=(3, 4)).stage_layers(7) == [(0, 3), (3, 7)]
    assert ParallelConfig().stage_layers(5) == [(0, 5)]


@pytest.mark.parametrize("parallel, layers, message", [
    ({"pp": 9}, 8, "parallel.pp = 9: more pipeline stages than the model's 8 layers"),
    ({"pp": 3}, 8, "give each stage's layers in parallel.pp_split (e.g. [2,3,3])"),
    ({"pp": 2, "pp_split": (3, 3)}, 8, "its layers add up to 6, the model has 8"),
])
def test_a_cut_that_does_not_fit_the_model_names_the_field(parallel, layers, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ParallelConfig(**parallel).stage_layers(layers)
    base = _cfg()
    with pytest.raises(ConfigError):  # the run config checks its cut when it is made
        base.replace(model=base.model.replace(n_layers=layers), parallel=ParallelConfig(**parallel))


@pytest.mark.parametrize("parallel, message", [
    ({"pp": 2, "pp_split": (4,)}, "parallel.pp_split"), ({"pp": 2, "pp_split": (0, 4)}, "a stage of no layers"),
    ({"pp": 0}, "parallel.pp"),
])
def test_bad_pipeline_fields_are_refused(parallel, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**parallel)


def test_the_global_load_balancing_statistic_is_refused_under_stages():
    cfg = _cfg()
    with pytest.raises(ConfigError, match="lb_loss_scope"):
        cfg.replace(model=cfg.model.replace(moe=cfg.model.moe.replace(lb_loss_scope="global")),
                    parallel=ParallelConfig(pp=2))


def test_the_rank_order_is_dp_pp_ep():
    stages, pipelines = pipeline_layout(12, 2, 3)
    assert stages == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]  # an EP group: 3 consecutive ranks
    assert pipelines[:3] == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ConfigError, match=r"parallel.pp = 4 x parallel.ep = 2: must divide the world size \(12"):
        pipeline_layout(12, 4, 2)


def test_a_launch_the_stages_do_not_divide_stops_before_any_collective():
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="parallel.pp = 2 x parallel.ep = 1: must divide the world size"):
        init_distributed(ParallelConfig(pp=2), 4, device="cpu", env=env)


def test_the_plan_names_the_stages_and_the_bubble():
    plan = plan_execution(_cfg(pp=2), "cpu", 2, budget_bytes=None)
    assert plan.pipeline == "2 stages (2 layers each), 1f1b, 4 micro-batches of 2 sequences"
    assert plan.why["pipeline"] == "idle 1/5 = 20% of the step (the bubble)"
    few = plan_execution(_cfg(pp=4, micro_batch=0), "cpu", 8, budget_bytes=None)
    assert few.pipeline == "4 stages (1 layer each), 1f1b, 1 micro-batch of 4 sequences"
    assert few.why["pipeline"].endswith("75% of the step (the bubble): fewer micro-batches than stages")
    assert "pipeline" in plan.describe()
    with pytest.raises(ConfigError, match="parallel.pp = 2: must divide the world size"):
        plan_execution(_cfg(pp=2), "cpu", 3, budget_bytes=None)


def test_stages_keep_the_whole_models_names_and_initial_weights():
    cfg = _cfg(pp=2).model
    whole = Transformer(cfg)
    whole.init_weights(seed=3)
    parts = []
    for stage in range(2):
        part = keep_stage(Transformer(cfg), [stage], ParallelConfig(pp=2).stage_layers(cfg.n_layers))
        part.init_weights(seed=3)
        parts.append(dict(part.named_parameters()))
    assert parts[0].keys().isdisjoint(parts[1].keys())
    assert parts[0].keys() | parts[1].keys() == dict(whole.named_parameters()).keys()
    assert "embed.weight" in parts[0] and "lm_head.weight" in parts[1] and "blocks.2.attn.w_q.weight" in parts[1]
    for name, p in whole.named_parameters():
        assert torch.equal(p, (parts[0] | parts[1])[name]), name


@pytest.mark.parametrize("form", ["per_layer", "all_layers"])
def test_routing_sums_carried_over_stages_give_the_one_process_auxiliary_loss(form):
    """The sums of layers 0-1 passed on and added to by layers 2-3 make the same auxiliary,
    load-balancing and z-losses as the whole model's, and the same router gradients."""
    cfg = _cfg(lb_form=form).model
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model.hidden(tokens)
    ref_lb, ref_z = model.lb_loss(), torch.stack([m.last_z_loss for m in model.moe_layers()]).mean()
    ref = model.aux_loss()
    ref_grads = torch.autograd.grad(ref, [m.router.gate.weight for m in model.moe_layers()])
    model.clear_routing()
    model.hidden(tokens)
    layers = model.moe_layers()
    sums = add_routing_sums(layers[2:], add_routing_sums(layers[:2], None))
    aux, lb, z = aux_from_routing_sums(sums, cfg.moe, cfg.n_layers)
    grads = torch.autograd.grad(aux, [m.router.gate.weight for m in layers])
    torch.testing.assert_close(aux, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(lb, ref_lb, rtol=0, atol=1e-6)
    torch.testing.assert_close(z, ref_z, rtol=0, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------- runs on gloo

@pytest.fixture(scope="module")
def single(tokens_dir, tmp_path_factory):
    return _single(_cfg(), tokens_dir, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("nproc, pp, ep, recompute, chunks", [
    (2, 2, 1, "none", 1), (2, 2, 1, "level7", 1),  # the 220B's recompute level: MoE block, attention, norms
    (4, 2, 1, "none", 1),  # two data-parallel pipelines, each stage sharded over its 2 ranks
    (4, 2, 2, "level1", 1),  # each stage's experts split over an EP group of 2; the 100B's level
    (4, 2, 2, "full", 1),
    (4, 4, 1, "moe", 1),  # one layer a stage, as many micro-batches as stages; the experts recomputed
    (2, 2, 1, "none", 2),  # interleaved: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
    (4, 2, 2, "level7", 2),
])
def test_stages_follow_the_one_process_run(single, tokens_dir, tmp_path, nproc, pp, ep, recompute, chunks):
    cfg = _cfg(pp=pp, ep=ep, recompute=recompute, chunks=chunks)
    got = _ranks(nproc, cfg, tokens_dir, tmp_path / "run", tmp_path / "rows.json")
    _close(got, single)


@pytest.mark.parametrize("pp, ep, recompute, chunks, gathers, dp_shard", [
    (2, 1, "none", 1, "per_step", 0),  # the paper's granularity: each stage's weights gathered once a step
    (2, 2, "level1", 1, "per_step", 0),  # the 100B's: EP 2 within each stage, the MoE block recomputed
    (2, 1, "level7", 2, "per_step", 0),  # interleaved: each chunk of the rank reduces after its own last backward
    (2, 1, "none", 1, "per_micro_batch", 1),  # each stage replicated over its 2 ranks: all-reduced once a step
    (2, 1, "full", 1, "per_step", 1),
])
def test_stages_synchronise_once_a_step_and_follow_the_one_process_run(single, tokens_dir, tmp_path, pp, ep,
                                                                       recompute, chunks, gathers, dp_shard):
    cfg = _cfg(pp=pp, ep=ep, recompute=recompute, chunks=chunks, gathers=gathers, dp_shard=dp_shard)
    got = _ranks(4, cfg, tokens_dir, tmp_path / "run", tmp_path / "rows.json")
    _close(got, single)


def _count_collectives(cfg_json, tokens_dir, run_dir, out_path):
    """One gloo rank training ``cfg_json`` with torch.distributed's gathers, reductions and
    all-reduces counted (global rank 0 writes the counts)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = RunConfig.from_json(cfg_json)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts, device="cpu")
    counts = {}

    def counted(kind, real):
        def call(*args, **kwargs):
            counts[kind] = counts.get(kind, 0) + 1
            return real(*args, **kwargs)
        return call

    kinds = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",  # (FSDP2's, by torch version)
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "all_reduce": "all_reduce"}
    names = [name for name in kinds if hasattr(dist, name)]
    real = {name: getattr(dist, name) for name in names}
    try:
        for name in names:
            setattr(dist, name, counted(kinds[name], real[name]))
        Trainer(cfg, tokens_dir, run_dir, progress=False, mesh=mesh).fit()
    finally:
        for name in names:
            setattr(dist, name, real[name])
        shutdown(mesh)
    if mesh.rank == 0:
        out_path.write_text(json.dumps(counts))


@pytest.mark.parametrize("gathers, dp_shard, constant, growing", [
    ("per_micro_batch", 1, "all_reduce", None),  # the replicas' all-reduce: once a step
    ("per_micro_batch", 0, "all_reduce", "reduce_scatter"),
    ("per_step", 0, "all_gather", None),  # gathered and reduced once a step
    ("per_step", 0, "reduce_scatter", None),
])
def test_stages_synchronise_once_a_step_whatever_the_micro_batches(tokens_dir, tmp_path, gathers, dp_shard,
                                                                  constant, growing):
    """PP 2 x DP 2, 2 steps: with 2 and with 4 micro-batches a step, the collectives the step
    synchronises once are as many; those of every micro-batch grow with them."""
    from optimus_core.parallel.launch import spawn_local

    counts = []
    for micro_batch in (2, 1):  # 4 sequences per data-parallel rank: 2, then 4 micro-batches
        cfg = _cfg(pp=2, steps=2, micro_batch=micro_batch, gathers=gathers, dp_shard=dp_shard)
        out = tmp_path / f"counts{micro_batch}.json"
        spawn_local(_count_collectives, 4, (cfg.to_json(), tokens_dir, tmp_path / f"run{micro_batch}", out),
                    start_method="fork")
        counts.append(json.loads(out.read_text()))
    assert counts[0][constant] == counts[1][constant] > 0
    if growing:
        assert counts[1][growing] > counts[0][growing]


def test_a_checkpoint_loads_across_pipeline_degrees(tokens_dir, tmp_path):
    """Steps 1-4 on PP 2 x EP 2 (4 ranks), then from its checkpoint steps 5-6 on one process and,
    apart, on PP 4: the losses of the uninterrupted one-process run."""
    ref = _single(_cfg(steps=6, schedule="constant"), tokens_dir, tmp_path / "single")
    first = _ranks(4, _cfg(pp=2, ep=2, steps=4, schedule="constant"), tokens_dir, tmp_path / "a", tmp_path / "a.json")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    one = _single(_cfg(steps=6, schedule="constant"), tokens_dir, tmp_path / "a")
    four = _ranks(4, _cfg(pp=4, steps=6, schedule="constant"), tokens_dir, tmp_path / "b", tmp_path / "b.json")
    assert first["step"] == [1, 2, 3, 4] and one["step"] == four["step"] == [5, 6]
    for got in (first["loss"] + one["loss"], first["loss"] + four["loss"]):
        assert max(abs(a - b) for a, b in zip(got, ref["loss"])) < 1e-5


def test_cli_pp_2_starts_the_stages(tokens_dir, tmp_path):
    out = tmp_path / "cli-run"
    cmd = [sys.executable, "-m", "workflow.cli", "pretrain", "--preset", "mula-7b-a1b@laptop",
           "--data", str(tokens_dir), "--out", str(out), "--nproc", "2", "--pp", "2", "--steps", "2", "--quiet",
           "--set", "train.eval_batches=1", "--set", "train.global_batch=4", "--set", "train.micro_batch=2",
           "--set", "train.device=cpu", "--set", "model.n_layers=2", "--set", "model.moe.n_experts=4",
           "--set", "model.moe.top_k=2", "--set", "data.seq_len=32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["config"]["parallel"]["pp"] == 2
    assert meta["execution_plan"]["pipeline"] == "2 stages (1 layer each), 1f1b, 2 micro-batches of 2 sequences"
    # its checkpoint evaluates whole on one process and sharded on two ranks (no stages there)
    losses = []
    for nproc in ("1", "2"):
        done = subprocess.run([sys.executable, "-m", "workflow.cli", "evaluate", "--run", str(out), "--nproc", nproc,
                               "--max-batches", "1", "--device", "cpu", "--out", str(tmp_path / f"eval{nproc}.json")],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(json.loads((tmp_path / f"eval{nproc}.json").read_text())["loss"])
    assert abs(losses[0] - losses[1]) < 1e-5


def test_cli_a_bad_pipeline_is_a_clear_error_before_any_rank_starts(tokens_dir, tmp_path, capsys):
    from workflow.cli import main

    code = main(["pretrain", "--preset", "mula-7b-a1b@laptop", "--data", str(tokens_dir),
                 "--out", str(tmp_path / "r"), "--nproc", "3", "--pp", "2", "--steps", "1",
                 "--set", "train.device=cpu", "--set", "model.n_layers=2"])
    assert code == 2
    assert "parallel.pp = 2 x parallel.ep = 1: must divide the world size (3 ranks)" in capsys.readouterr().err


def test_the_interleaved_schedule_holds_every_pp_th_stage_and_is_checked_before_it_runs():
    parallel = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_chunks=2)
    assert parallel.stage_layers(4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert parallel.rank_stages(0) == [0, 2] and parallel.rank_stages(1) == [1, 3]
    names = set(dict(keep_stage(Transformer(_cfg().model), [1, 3], parallel.stage_layers(4)).named_parameters()))
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {"1", "3"} and "lm_head.weight" in names
    with pytest.raises(ConfigError, match="interleaved_1f1b holds 2 or more stages per rank, 1f1b one"):
        ParallelConfig(pp=2, pp_chunks=2)
    with pytest.raises(ConfigError, match="interleaved_1f1b holds 2 or more stages per rank"):
        ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")
    with pytest.raises(ConfigError, match=r"parallel.pp = 2: x pp_chunks 4: more pipeline stages than the model's 4"):
        _cfg(pp=2, chunks=4)
    cfg = _cfg(pp=2, chunks=2)
    plan = plan_execution(cfg, "cpu", 2, budget_bytes=None)
    assert plan.pipeline == "2 ranks x 2 stages (1 layer each), interleaved_1f1b, 4 micro-batches of 2 sequences"
    assert plan.why["pipeline"] == "idle 1/9 = 11% of the step (the bubble)"  # 1/5 under 1f1b
    with pytest.raises(ConfigError, match=r"3 micro-batches a step must be a multiple of parallel.pp \(2\)"):
        plan_execution(cfg.replace(train=cfg.train.replace(global_batch=6)), "cpu", 2, budget_bytes=None)
