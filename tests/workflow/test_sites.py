"""Sites and job planning: the PBS lines, queue and mpiexec line of Aurora jobs, errors before
submission, the Parsl Config they become, and the paper-scale dry run with its node-hour total."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_core.config import ConfigError
from parsl.providers import PBSProProvider

from workflow import sites
from workflow.experiments import dag, get
from workflow.launch import command_line, pretrain_argv
from workflow.parsl_sites import parsl_config
from workflow.plan import plan, plan_table

REPO = Path(__file__).resolve().parents[2]
CPU_BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"


@pytest.fixture
def aurora(monkeypatch):
    monkeypatch.delenv(sites.ACCOUNT_ENV, raising=False)
    return sites.load_site("aurora", account="MyProj")


@pytest.mark.parametrize("run, nodes, queue, walltime", [
    ("scaling-mula-220b-a10b-384", 32, "debug-scaling", "01:00:00"),
    ("scaling-mula-220b-a10b-3072", 256, "debug-scaling", "01:00:00"),
    ("scaling-mula-220b-a10b-12288", 1024, "prod", "01:00:00"),
    ("pretrain-mula-7b-a1b", 256, "prod", "24:00:00"),
])
def test_aurora_job_pbs_lines_and_mpiexec(aurora, run, nodes, queue, walltime):
    job = plan(get(run).paper, aurora)
    assert (job.nodes, job.ranks, job.queue, job.walltime) == (nodes, nodes * 12, queue, walltime)
    assert job.pbs_lines() == [
        "#PBS -A MyProj", f"#PBS -q {queue}", f"#PBS -l select={nodes}:ncpus=208",
        f"#PBS -l walltime={walltime}", "#PBS -l filesystems=home:flare", "#PBS -l place=scatter",
    ]
    assert job.scheduler_options == "#PBS -l filesystems=home:flare\n#PBS -l place=scatter"
    assert job.mpiexec == f"mpiexec -n {nodes * 12} --ppn 12 --cpu-bind {CPU_BIND}"
    assert job.env == {"CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi", "CCL_KVS_MODE": "mpi",
                       "FI_MR_CACHE_MONITOR": "userfaultfd"}


@pytest.mark.parametrize("nodes, walltime_h, queue", [
    (1, 1, "debug"), (2, 0.5, "debug"), (3, 1, "debug-scaling"), (256, 1, "debug-scaling"),
    (8, 48, "capacity"), (16, 168, "capacity"), (17, 2, "prod"), (257, 1, "prod"), (1024, 24, "prod"),
])
def test_queue_follows_node_count_and_walltime(aurora, nodes, walltime_h, queue):
    assert plan(None, aurora, ranks=12 * nodes, walltime_h=walltime_h).queue == queue


def test_planning_errors_name_field_value_and_allowed(aurora, monkeypatch):
    run = get("scaling-mula-220b-a10b-384").paper
    with pytest.raises(ConfigError, match=r"account = '': missing; set site.account .* or the OPTIMUS_ACCOUNT"):
        plan(run, sites.load_site("aurora"))
    monkeypatch.setenv(sites.ACCOUNT_ENV, "FromEnv")
    assert plan(run, sites.load_site("aurora")).account == "FromEnv"
    with pytest.raises(ConfigError, match=r"tiles = 100: must be a multiple of tiles_per_node \(12\); nearest: 96 or 108"):
        plan(None, aurora, ranks=100)
    with pytest.raises(ConfigError, match=r"nodes = 32: queue 'debug' allows 1-2 nodes"):
        plan(run, sites.load_site("aurora", account="A", queue="debug"))
    with pytest.raises(ConfigError, match=r"walltime_h = 2: over queue 'debug-scaling''s limit of 1h"):
        plan(run, sites.load_site("aurora", account="A", queue="debug-scaling"), walltime_h=2)
    with pytest.raises(ConfigError, match=r"nodes = 11000, walltime_h = 1: no queue fits; allowed: debug: 1-2 nodes"):
        plan(None, aurora, ranks=12 * 11000)
    with pytest.raises(ConfigError, match=r"walltime_h = 30: no queue fits"):
        plan(None, aurora, ranks=12 * 100, walltime_h=30)
    with pytest.raises(ConfigError, match=r"queue = 'gpu': unknown; allowed: auto, debug, debug-scaling"):
        sites.load_site("aurora", queue="gpu")
    with pytest.raises(ConfigError, match=r"site.acount: unknown field"):
        sites.load_site("aurora", acount="x")
    with pytest.raises(ConfigError, match=r"mpiexec = .*unknown placeholder 'tiles'"):
        sites.load_site("aurora", mpiexec="mpiexec -n {tiles}")
    with pytest.raises(ConfigError, match=r"site = 'polaris': unknown; known: local, aurora"):
        sites.load_site("polaris")
    with pytest.raises(ConfigError, match=r"site.queues.debug = .*needs min_nodes, max_nodes, walltime_h"):
        sites.load_site("aurora", queues={"debug": {"max_nodes": 2}})


def test_parsl_config_for_aurora(aurora, tmp_path):
    job = plan(get("pretrain-mula-7b-a1b").paper, aurora)  # longer than one 24 h job
    cfg = parsl_config(aurora, job, tmp_path / "parsl")
    (ex,) = cfg.executors
    p = ex.provider
    assert isinstance(p, PBSProProvider) and p.status_polling_interval == 60 and type(p.launcher).__name__ == "SimpleLauncher"
    assert (p.account, p.queue, p.nodes_per_block, p.walltime, p.cpus_per_node) == ("MyProj", "prod", 256, "24:00:00", 208)
    assert (p.init_blocks, p.max_blocks) == (1, 1) and ex.max_workers_per_node == 1
    assert p.scheduler_options == job.scheduler_options
    init = p.worker_init.splitlines()
    assert init[0] == "module load frameworks" and "export CCL_KVS_MODE=mpi" in init
    assert job.jobs == math.ceil(job.est_hours / 24) > 1
    assert cfg.retries == aurora.retries + job.jobs - 1 and cfg.run_dir == str(tmp_path / "parsl")
    local = sites.load_site("local")
    lcfg = parsl_config(local, plan(None, local, ranks=1), tmp_path / "p2")
    assert type(lcfg.executors[0].provider).__name__ == "LocalProvider"


def test_command_line_is_the_laptop_command_under_mpiexec(aurora):
    job = plan(get("scaling-mula-220b-a10b-768").paper, aurora)
    argv = pretrain_argv({"experiment": "scaling-mula-220b-a10b-768", "scale": "paper", "data": Path("/d/tok"),
                          "out": "/r/x", "preset": None, "quiet": True, "dtype": None, "set": ["a=1", "b=2"],
                          "launcher": "parsl", "site": "aurora", "nproc": 1})
    line = command_line(job, argv)
    assert job.gpu_affinity == aurora.gpu_affinity.wrapper() and job.gpu_affinity.startswith("sh -c ")
    assert line == (f"mpiexec -n 768 --ppn 12 --cpu-bind {CPU_BIND} {job.gpu_affinity} optimus pretrain --experiment "
                    "scaling-mula-220b-a10b-768 --scale paper --data /d/tok --out /r/x --quiet --set a=1 "
                    "--set b=2 --launcher local")


def test_node_hours_follow_the_throughput_assumption():
    throughput = sites.load_site("aurora", account="MyProj", machine="")  # no performance model
    run = get("pretrain-mula-220b-a10b").paper
    job = plan(run, throughput)
    expected_h = run.flops() / (3072 * 419e12 * 0.25) / 3600
    assert job.est_hours == pytest.approx(expected_h) and job.node_hours == pytest.approx(256 * expected_h)
    faster = plan(run, sites.load_site("aurora", account="A", mfu=0.5, machine=""))
    assert faster.node_hours == pytest.approx(job.node_hours / 2)
    table, plans = plan_table(dag("paper"), throughput)
    total = sum(p.node_hours for p in plans)
    assert table.splitlines()[-1].startswith(f"TOTAL 15 jobs, {total:,.0f} node-hours")


def test_paper_dry_run_lists_every_job_and_the_node_hour_total(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OPTIMUS_ACCOUNT="CIProj")
    cmd = [sys.executable, "-m", "snakemake", "--profile", "workflow/profiles/aurora", "-n", "--nolock",
           "--config", f"results={tmp_path / 'results'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    counts = {"corpus": 1, "tokenize": 1, "pretrain": 15, "evaluate": 5, "figure": 9, "report": 1,
              "ingest_bench": 4, "perfmodel": 1, "total": 38}  # no CPU scaling sweep at paper scale
    for rule, count in counts.items():
        assert any(line.split() == [rule, str(count)] for line in text.splitlines()), rule
    for exp in dag("paper"):
        assert re.search(rf"^{exp.name} +{exp.paper.devices} +{exp.paper.nodes} ", text, re.M), exp.name
        assert f"--experiment {exp.name} --scale paper" in text
    site = sites.load_site("aurora", account="CIProj")
    assert site.machine == "aurora"  # workflow/config/aurora.yaml: node-hours from the performance model
    _, plans = plan_table(dag("paper"), site)
    total = f"{sum(p.node_hours for p in plans):,.0f}"
    # every paper run has a layout the model prices (a whole number of sequences per tile)
    assert all(p.est_source == "perfmodel:aurora" for p in plans)
    assert f"TOTAL 15 jobs, {total} node-hours (performance model on machine aurora for 15 jobs)" in text
    assert "--launcher parsl --site aurora" in text
    # tokenization fans out through the site's CPU executor, its shards kept beside the tokens
    assert f"--launcher parsl --site aurora --shards {tmp_path / 'results'}/data/tokens.shards" in text
    assert not (tmp_path / "results").exists()
    # Without an account the plan stops the dry run, naming the field.
    env.pop("OPTIMUS_ACCOUNT")
    bad = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "account = '': missing" in bad.stdout + bad.stderr


def test_pretrain_on_site_plans_and_submits_the_local_command(tmp_path, monkeypatch, capsys):
    """The CLI path without Parsl: what `optimus pretrain --launcher parsl` hands to submit()."""
    from workflow import launch
    from workflow.cli import main

    seen = {}

    def fake_submit(site, job, command, run_dir, name):
        seen.update(site=site.name, nodes=job.nodes, queue=job.queue, command=command, run_dir=run_dir)
        (tmp_path / "o").write_text("x: 2 steps\n")
        return launch.Submitted(0, tmp_path / "o", tmp_path / "e", 0.0)

    monkeypatch.setattr(launch, "submit", fake_submit)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(sites.ACCOUNT_ENV, "EnvProj")
    base = ["pretrain", "--data", "tok", "--out", "runs/x", "--launcher", "parsl"]
    assert main([*base, "--preset", "mula-1b@laptop", "--nproc", "2", "--site", "local", "--steps", "2"]) == 0
    assert seen["nodes"] == 1 and seen["queue"] is None
    assert seen["command"].startswith("optimus pretrain --preset mula-1b@laptop --scale laptop --data /")
    assert seen["command"].endswith("--run-id x --steps 2 --nproc 2 --launcher local")
    assert f"--data {tmp_path}/tok --out {tmp_path}/runs/x" in seen["command"] and "--site" not in seen["command"]
    assert "x: 2 steps" in capsys.readouterr().out
    assert main([*base, "--experiment", "scaling-mula-220b-a10b-6144", "--scale", "paper", "--site", "aurora"]) == 0
    assert (seen["site"], seen["nodes"], seen["queue"]) == ("aurora", 512, "prod")
    wrapper = sites.load_site("aurora").gpu_affinity.wrapper()  # each rank sees only its tile
    assert seen["command"].startswith(f"mpiexec -n 6144 --ppn 12 --cpu-bind {CPU_BIND} {wrapper} optimus pretrain "
                                      "--experiment")
    assert seen["run_dir"].name == "paper-scaling-mula-220b-a10b-6144"
