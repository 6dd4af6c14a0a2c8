"""The whole registry: scale-up, strong-scaling and ablation runs, at paper and laptop scale."""
import pytest

from optimus_core.config import ConfigError
from optimus_core.execution import resolve_choices
from workflow.cli import build_parser
from workflow.commands import resolve_run_config
from optimus_core import presets
from workflow.experiments import (ABLATION_ARMS, ABLATION_LAYOUTS, EXPERIMENTS, LAPTOP_SCALEUP_STEPS, SCALING_STEPS, SCALING_TILES,
                                  TILES_PER_NODE, RunScale, dag, get, of_kind, pretraining, scaleup, scaleup_figure)


def test_every_paper_run_of_the_study_is_registered():
    assert {e.paper.preset: e.paper.tokens for e in pretraining()} == {
        "mula-1b": 4 * 10**12, "mula-7b-a1b": 4 * 10**12, "mula-20b-a2b": 10**11, "mula-100b-a7b": 10**11,
        "mula-220b-a10b": 10**11}
    assert [e.paper.devices for e in of_kind("scaling")] == [384, 768, 1536, 3072, 6144, 12288] == list(SCALING_TILES)
    assert [e.name for e in of_kind("ablation")] == [
        "ablation-dp12-loop", "ablation-dp12-fast", "ablation-ep12-loop", "ablation-ep12-fast",
        "ablation-ep12-dp_sharded", "ablation-dp8-ep12-loop", "ablation-dp8-ep12-fast", "ablation-dp8-ep12-dp_sharded",
        "ablation-dp2-pp4-ep12-loop", "ablation-dp2-pp4-ep12-fast", "ablation-dp2-pp4-ep12-dp_sharded"]
    assert len(EXPERIMENTS) == 22


def test_paper_layouts_fit_aurora():
    for exp in EXPERIMENTS.values():
        p = exp.paper
        assert p.devices % TILES_PER_NODE == 0 and p.walltime_h == 0, exp.name  # the plan picks it (queue table)
        assert p.timed == (exp.kind != "pretrain"), exp.name
        cfg = p.run_config()
        if cfg.model.moe is not None:
            assert cfg.model.moe.n_experts % p.ep == 0 and p.devices % p.ep == 0, exp.name



def test_every_paper_batch_is_whole_micro_batches_on_every_rank():
    for exp in EXPERIMENTS.values():
        p = exp.paper
        cfg = p.run_config()
        assert cfg.train.micro_batch == 1, exp.name  # one sequence per tile per forward / backward
        assert cfg.train.global_batch == p.batch and p.batch % (p.devices * cfg.train.micro_batch) == 0, exp.name
        # how it executes is the plan's (no execution override): bf16 on the tiles, and for an MoE
        # model the Triton experts unless the ablation picks its backend
        assert cfg.execution.dtype == "auto", exp.name
        plan = resolve_choices(cfg, "xpu", p.devices, probe=False)
        assert plan.dtype == "bfloat16", exp.name
        if exp.kind != "ablation":
            assert cfg.execution.experts == "auto", exp.name
            assert plan.experts == ("triton" if cfg.model.moe is not None else None), exp.name
    four_t = [e.paper for e in pretraining() if e.paper.tokens == 4 * 10**12]
    assert [(r.devices, r.batch, r.tokens_per_step) for r in four_t] == [(3072, 3072, 3072 * 2048)] * 2
    with pytest.raises(ConfigError, match=r"global_batch = 1024: must be a multiple of devices x micro_batch "
                                          r"\(3072 x 1 = 3072 sequences\)"):
        RunScale("mula-7b-a1b", 4 * 10**12, devices=3072, global_batch=1024, extra={"train.micro_batch": 1})
    with pytest.raises(ConfigError, match=r"global_batch = 3072: must be a multiple of devices x micro_batch "
                                          r"\(768 x 8 = 6144"):
        RunScale("mula-1b", 10**11, devices=768, global_batch=3072, extra={"train.micro_batch": 8})
    with pytest.raises(ConfigError, match=r"global_batch = 3072: must be a multiple of devices x micro_batch "
                                          r"\(2048 x 1 = 2048"):  # no micro_batch: 1.5 sequences per rank
        RunScale("mula-1b", 4 * 10**12, devices=2048)


def test_strong_scaling_changes_only_the_tiles():
    runs = [e.paper for e in of_kind("scaling")]
    assert {(r.preset, r.steps, r.batch, r.tokens, r.ep) for r in runs} == {("mula-220b-a10b", SCALING_STEPS, 12288, SCALING_STEPS * 12288 * 2048, 12)}
    assert [r.nodes for r in runs] == [32, 64, 128, 256, 512, 1024]


def test_the_ablations_are_the_authors_layouts_and_arms():
    """OLMoE-1B-7B SE1.125 (72 experts), 32 steps of one sequence per tile at context 2048, in
    DP12, EP12, DP8-EP12 and DP2-PP4-EP12 (4 micro-batches of one sequence per pipeline); the
    kernel arm everywhere, the optimizer arm where EP > 1."""
    for exp in of_kind("ablation"):
        layout, arm = exp.name[len("ablation-"):].rsplit("-", 1)
        (tiles, ep, pp), (backend, optimizer) = ABLATION_LAYOUTS[layout], ABLATION_ARMS[arm]
        assert backend in ("loop", "triton")  # what runs on Aurora's XPUs (no torch._grouped_mm there)
        for scale in ("paper", "laptop"):
            cfg = exp.scale(scale).run_config()
            assert (cfg.execution.experts, cfg.parallel.optimizer) == (backend, optimizer)
            assert resolve_choices(cfg, "xpu", exp.scale(scale).devices, probe=False).experts == backend
        p = exp.paper
        assert (p.preset, p.devices, p.ep, p.pp, p.batch, p.steps) == ("olmoe-1b-7b--SE1.125", tiles, ep, pp, tiles, 32)
        assert p.run_config().train.global_batch // (tiles // pp) // p.run_config().train.micro_batch == pp
        assert p.run_config().model.moe.n_experts == 72 and p.run_config().data.seq_len == 2048
        assert exp.laptop.preset == "olmoe-1b-7b@laptop--SE1.125"


def test_an_ep_group_that_does_not_fit_a_node_is_refused_unless_asked_for():
    with pytest.raises(ConfigError, match=r"ep = 8: an EP group must sit on one node of 12 tiles"):
        RunScale.for_steps("mula-20b-a2b", 2, 96, ep=8, global_batch=96)
    asked = RunScale.for_steps("mula-20b-a2b", 2, 96, ep=8, global_batch=96,
                               extra={"parallel.ep_across_nodes": True})
    assert asked.run_config().parallel.ep_across_nodes


def test_laptop_proxies_and_the_laptop_dag():
    for exp in EXPERIMENTS.values():
        base, _, tag = exp.paper.preset.partition("--")
        assert exp.laptop.preset == base + "@laptop" + (f"--{tag}" if tag else "") and exp.laptop.devices == 1
    # every pretraining run, the scale-up runs after the two 4T runs; no scaling or ablation run
    assert [e.name for e in dag("laptop")] == ["pretrain-mula-1b", "pretrain-mula-7b-a1b", "pretrain-mula-20b-a2b",
                                               "pretrain-mula-100b-a7b", "pretrain-mula-220b-a10b"]
    assert len(dag("paper")) == len(EXPERIMENTS)
    with pytest.raises(ConfigError, match="scale = 'huge'"):
        dag("huge")
    with pytest.raises(ConfigError, match="kind = 'sweep': must be one of pretrain, scaling, ablation"):
        of_kind("sweep")


def test_scaleup_runs_keep_the_papers_order_at_both_scales():
    names = ["pretrain-mula-20b-a2b", "pretrain-mula-100b-a7b", "pretrain-mula-220b-a10b"]
    assert [e.name for e in scaleup()] == names
    for scale in ("laptop", "paper"):
        models = [presets.get(e.scale(scale).preset).model for e in scaleup()]
        totals, actives = [m.num_params() for m in models], [m.num_active_params() for m in models]
        assert totals == sorted(set(totals)) and actives == sorted(set(actives)), scale  # strictly increasing
        # the figure draws them beside mula-7b-a1b, the smallest MoE model
        assert [e.name for e in scaleup_figure(scale)] == ["pretrain-mula-7b-a1b", *names]
        reference = presets.get(get("pretrain-mula-7b-a1b").scale(scale).preset).model
        assert reference.num_params() < totals[0] and reference.num_active_params() < actives[0]


def test_scaleup_proxies_train_on_the_4t_proxies_batch_with_held_out_curves():
    reference = get("pretrain-mula-7b-a1b").laptop.run_config()
    for exp in scaleup():
        cfg = exp.laptop.run_config()
        assert exp.laptop_dag and exp.paper.tokens == 10**11
        assert (cfg.train.global_batch, cfg.data.seq_len) == (reference.train.global_batch, reference.data.seq_len)
        assert cfg.train.steps == LAPTOP_SCALEUP_STEPS < reference.train.steps
        # the 4T proxies' schedule, their length its horizon: the scale-up proxies stop early on it,
        # as the paper's 100B-token runs stop early on the 4T runs' epoch
        assert cfg.schedule == reference.schedule and cfg.schedule.decay_horizon == reference.train.steps
        assert cfg.schedule.warmup_steps < cfg.train.steps
        assert cfg.train.eval_every and cfg.train.steps // cfg.train.eval_every >= 3  # a curve, not a point


def test_cli_resolves_registry_runs_at_both_scales(tmp_path):
    args = build_parser().parse_args(["pretrain", "--experiment", "scaling-mula-220b-a10b-1536", "--scale", "paper",
                                      "--data", "d", "--out", str(tmp_path / "r")])
    cfg, run_id, experiment = resolve_run_config(args)
    assert (run_id, experiment) == ("paper-scaling-mula-220b-a10b-1536", "scaling-mula-220b-a10b-1536")
    assert (cfg.train.steps, cfg.train.global_batch, cfg.parallel.ep, cfg.execution.dtype) == (SCALING_STEPS, 12288, 12, "auto")
    assert resolve_choices(cfg, "xpu", 1536, probe=False).dtype == "bfloat16"
    args = build_parser().parse_args(["pretrain", "--experiment", "pretrain-mula-100b-a7b", "--data", "d",
                                      "--out", str(tmp_path / "r")])
    cfg, run_id, _ = resolve_run_config(args)
    assert run_id == "laptop-pretrain-mula-100b-a7b" and cfg.preset == "mula-100b-a7b@laptop"
    assert cfg.train.steps == LAPTOP_SCALEUP_STEPS and cfg.schedule.warmup_steps == 20


def test_bad_layouts_fail_at_import_time():
    with pytest.raises(ConfigError, match=r"parallel.ep = 7: must divide model.moe.n_experts \(240\)"):
        RunScale("mula-220b-a10b", 10**11, devices=384, ep=7)
    with pytest.raises(ConfigError, match="devices = 0: must be >= 1"):
        RunScale("mula-1b", 10**11, devices=0)
    assert RunScale.for_steps("mula-1b", 7, 12, global_batch=12).steps == 7
