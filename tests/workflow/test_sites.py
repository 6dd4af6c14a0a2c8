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
CPU_BIND = "list:2-8:10-16:18-24:26-32:34-40:42-48:54-60:62-68:70-76:78-84:86-92:94-100"


@pytest.fixture
def aurora(monkeypatch):
    monkeypatch.delenv(sites.ACCOUNT_ENV, raising=False)
    return sites.load_site("aurora", account="MyProj")


@pytest.mark.parametrize("run, nodes, queue, walltime", [
    ("scaling-mula-220b-a10b-384", 32, "debug-scaling", "00:25:00"),   # a timed run: its estimate + room
    ("scaling-mula-220b-a10b-3072", 256, "debug-scaling", "00:20:00"),
    ("scaling-mula-220b-a10b-12288", 1024, "prod", "00:20:00"),
    ("pretrain-mula-7b-a1b", 256, "prod", "12:00:00"),                  # the longest prod's small tier allows
])
def test_aurora_job_pbs_lines_and_mpiexec(aurora, run, nodes, queue, walltime):
    job = plan(get(run).paper, aurora)
    assert (job.nodes, job.ranks, job.queue, job.walltime) == (nodes, nodes * 12, queue, walltime)
    assert job.pbs_lines() == [
        "#PBS -A MyProj", f"#PBS -q {queue}", f"#PBS -l select={nodes}:ncpus=208",
        f"#PBS -l walltime={walltime}", "#PBS -l filesystems=home:flare", "#PBS -l place=scatter", "#PBS -k doe",
    ]
    assert job.scheduler_options == "#PBS -l filesystems=home:flare\n#PBS -l place=scatter\n#PBS -k doe"
    assert job.mpiexec == f'mpiexec -n {nodes * 12} --ppn 12 --hostfile "$OPTIMUS_HOSTFILE" --cpu-bind {CPU_BIND}'
    assert job.gpu_affinity == ""  # FLAT: each rank binds tile <local rank> itself, no mask
    minimal = {"CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi", "CCL_KVS_MODE": "mpi",
               "FI_MR_CACHE_MONITOR": "userfaultfd"}
    scale = {"CCL_ALLREDUCE_SCALEOUT": "direct:0-1048576;rabenseifner:1048577-max",
             "CCL_KVS_CONNECTION_TIMEOUT": "600", "CCL_ATL_SYNC_COLL": "1", "CCL_OP_SYNC": "1"}
    authors = {"CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD": "32768", "CCL_SYCL_SCALEOUT_HOST_BUF_SIZE": "2147483648",
               "CCL_WORKER_COUNT": "1", "MPIR_CVAR_REQUEST_ERR_FATAL": "1"}
    assert job.env.items() >= {**minimal, **scale, **authors}.items()
    assert "ForceExtendedUSMBufferSize" not in job.env  # a driver debug key their runs never enabled


def test_aurora_sets_oneccls_scale_settings_only_where_alcf_prescribes_them(aurora):
    """ALCF's tuning and hang-avoidance lists are for more than 16 nodes; a small job runs on the
    minimal set, and the all-to-all avoids oneCCL's empty-split bug at every size."""
    small, large = plan(None, aurora, ranks=12 * 16), plan(None, aurora, ranks=12 * 17)
    for name in ("CCL_ATL_SYNC_COLL", "CCL_OP_SYNC", "CCL_ALLREDUCE_SCALEOUT", "CCL_KVS_CONNECTION_TIMEOUT"):
        assert name not in small.env and name in large.env, name
    for job in (small, large):
        assert job.env["CCL_ALLTOALLV"] == job.env["CCL_ALLTOALLV_SCALEOUT"] == "naive"
        assert job.env["CCL_PROCESS_LAUNCHER"] == "pmix"


def test_cpu_binding_leaves_each_rank_a_core_for_oneccl_and_the_os_its_own(aurora):
    sets = [range(int(a), int(b) + 1) for a, b in (c.split("-") for c in aurora.cpu_bind[5:].split(":"))]
    workers = [int(c) for c in aurora.env["CCL_WORKER_AFFINITY"].split(",")]
    cores = [c for s in sets for c in s]
    assert len(sets) == len(workers) == 12 and len(set(cores)) == len(cores)
    assert not set(workers) & set(cores) and not {0, 52} & set(cores + workers)
    assert all(w == s.start - 1 for w, s in zip(workers, sets))  # each rank's worker beside its cores
    assert int(aurora.env["OMP_NUM_THREADS"]) == len(sets[0])


@pytest.mark.parametrize("nodes, walltime_h, queue, granted", [
    (1, 1, "debug", 1), (2, 0.5, "debug", 0.5), (3, 1, "debug-scaling", 1), (256, 1, "debug-scaling", 1),
    (8, 48, "capacity", 48), (16, 168, "capacity", 168), (257, 1, "prod", 1), (1024, 12, "prod", 12),
    (1500, 18, "prod", 18), (2000, 24, "prod", 24),
    (8, 0, "capacity", 168), (256, 0, "prod", 12), (1025, 0, "prod", 18), (32, 0, "debug-scaling", 1),
])
def test_queue_follows_node_count_and_walltime(aurora, nodes, walltime_h, queue, granted):
    job = plan(None, aurora, ranks=12 * nodes, walltime_h=walltime_h)  # walltime 0: the longest allowed
    assert (job.queue, job.walltime_h) == (queue, granted)


def test_no_queue_takes_it_is_an_error_naming_the_table(aurora):
    with pytest.raises(ConfigError, match=r"nodes = 1024, walltime_h = 13: no queue fits; allowed: .*prod: small "
                                          r"256-1024 nodes <= 12h, medium 1025-1999 nodes <= 18h"):
        plan(None, aurora, ranks=12 * 1024, walltime_h=13)
    with pytest.raises(ConfigError, match=r"nodes = 20, walltime_h = 2: no queue fits"):
        plan(None, aurora, ranks=12 * 20, walltime_h=2)  # over capacity's 16 nodes, debug-scaling's 1 h
    with pytest.raises(ConfigError, match=r"walltime_h = 13: over queue 'prod''s limit of 12h at 300 nodes"):
        plan(None, sites.load_site("aurora", account="A", queue="prod"), ranks=12 * 300, walltime_h=13)
    with pytest.raises(ConfigError, match=r"nodes = 32: queue 'prod' allows small 256-1024"):
        plan(None, sites.load_site("aurora", account="A", queue="prod"), ranks=12 * 32)


def test_a_timed_run_fits_one_job_with_room_or_is_refused(aurora):
    from workflow.experiments import RunScale
    from workflow.plan import timed_walltime

    run = get("scaling-mula-220b-a10b-384").paper
    job = plan(run, aurora)
    assert job.jobs == 1 and job.walltime_h >= job.est_hours * 1.25 + aurora.startup_h
    assert job.walltime_h == timed_walltime(aurora, job.est_hours) <= 1
    longer = RunScale.for_steps(run.preset, 40, 384, timed=True, ep=12, global_batch=run.global_batch,
                                extra=run.extra, dp_shard=run.dp_shard)
    with pytest.raises(ConfigError, match=r"no queue fits.*a timed run: .* h estimated, asking .* with room; fewer steps"):
        plan(longer, aurora)
    with pytest.raises(ConfigError, match=r"walltime_h = 0.25: a timed run needs .* h"):
        plan(run, aurora, walltime_h=aurora.startup_h)  # the start-up allowance alone


def test_a_long_run_is_chained_jobs_that_each_fit(aurora):
    job = plan(get("pretrain-mula-7b-a1b").paper, aurora)
    assert job.walltime_h == 12 and job.jobs == math.ceil(job.est_hours / (12 - aurora.startup_h)) > 1


def test_planning_errors_name_field_value_and_allowed(aurora, monkeypatch):
    run = get("scaling-mula-220b-a10b-384").paper
    with pytest.raises(ConfigError, match=r"account = '': missing; set site.account .* or the OPTIMUS_ACCOUNT"):
        plan(run, sites.load_site("aurora"))
    # a dry run plans without one, the account visibly unset in its PBS lines
    dry = plan(run, sites.load_site("aurora"), dry_run=True)
    assert "#PBS -A <set site.account or OPTIMUS_ACCOUNT>" in dry.pbs_lines()
    monkeypatch.setenv(sites.ACCOUNT_ENV, "FromEnv")
    assert plan(run, sites.load_site("aurora")).account == "FromEnv"
    with pytest.raises(ConfigError, match=r"tiles = 100: must be a multiple of tiles_per_node \(12\); nearest: 96 or 108"):
        plan(None, aurora, ranks=100)
    with pytest.raises(ConfigError, match=r"nodes = 32: queue 'debug' allows 1-2 nodes"):
        plan(run, sites.load_site("aurora", account="A", queue="debug"))
    with pytest.raises(ConfigError, match=r"walltime_h = 0.25: a timed run needs"):
        plan(run, sites.load_site("aurora", account="A", queue="debug-scaling"), walltime_h=0.25)
    with pytest.raises(ConfigError, match=r"walltime_h = 2: over queue 'debug-scaling''s limit of 1h"):
        plan(None, sites.load_site("aurora", account="A", queue="debug-scaling"), ranks=12 * 32, walltime_h=2)
    with pytest.raises(ConfigError, match=r"nodes = 11000: no queue takes 11000 nodes; allowed: debug: 1-2 nodes"):
        plan(None, aurora, ranks=12 * 11000)
    with pytest.raises(ConfigError, match=r"walltime_h = 30: no queue fits"):
        plan(None, aurora, ranks=12 * 300, walltime_h=30)
    with pytest.raises(ConfigError, match=r"queue = 'gpu': unknown; allowed: auto, debug, debug-scaling"):
        sites.load_site("aurora", queue="gpu")
    with pytest.raises(ConfigError, match=r"site.acount: unknown field"):
        sites.load_site("aurora", acount="x")
    with pytest.raises(ConfigError, match=r"mpiexec = .*unknown placeholder 'tiles'"):
        sites.load_site("aurora", mpiexec="mpiexec -n {tiles}")
    with pytest.raises(ConfigError, match=r"site = 'polaris': unknown; known: local, aurora"):
        sites.load_site("polaris")
    with pytest.raises(ConfigError, match=r"site.queues.debug = .*needs min_nodes, max_nodes, walltime_h .or tiers.; "
                                          r"missing min_nodes, walltime_h"):
        sites.load_site("aurora", queues={"debug": {"max_nodes": 2}})
    bad_site_fields = [
        ({"queues": {"prod": {"tiers": {"small": {"min_nodes": 256, "max_nodes": 1024}}}}},
         r"site.queues.prod.tiers.small = .*needs exactly min_nodes, max_nodes, walltime_h"),
        ({"queues": {"prod": {"tiers": {"s": {"min_nodes": 1, "max_nodes": 2, "walltime_h": 1}}, "walltime_h": 3}}},
         r"site.queues.prod: a routing queue's limits are its tiers'"),
        ({"queues": {"debug": {"min_nodes": 1, "max_nodes": "2", "walltime_h": 1}}},
         r"site.queues.debug.max_nodes = '2': must be an integer"),
        ({"queues": {"debug": {"min_nodes": 1, "max_nodes": 2, "walltime_h": 1, "jobs": 1}}},
         r"site.queues.debug.jobs: unknown field"),
        ({"queues": {"debug": {"min_nodes": 1, "max_nodes": 2, "walltime_h": 1, "max_jobs_per_user": -1}}},
         r"max_jobs_per_user = -1: must be >= 0"),
        ({"tiles_per_node": "12"}, r"site.tiles_per_node = '12': must be an integer"),
        ({"startup_h": "soon"}, r"site.startup_h = 'soon': must be a number"),
        ({"env": None, "worker_init": {"a": 1}}, r"site.worker_init = \{'a': 1\}: must be a list of strings"),
        ({"device": "gpu"}, r"device = 'gpu': must be one of auto, cpu, cuda, xpu"),
        ({"checkpoint_every_minutes": -5}, r"checkpoint_every_minutes = -5: must be >= 0"),
    ]
    for change, message in bad_site_fields:
        with pytest.raises(ConfigError, match=message):
            sites.load_site("aurora", **change)


def test_parsl_config_for_aurora(aurora, tmp_path, monkeypatch):
    import parsl.addresses

    monkeypatch.setattr(parsl.addresses, "address_by_interface", lambda name: f"10.0.0.1 ({name})")
    job = plan(get("pretrain-mula-7b-a1b").paper, aurora)  # longer than one 12 h job
    cfg = parsl_config(aurora, job, tmp_path / "parsl")
    (ex,) = cfg.executors
    p = ex.provider
    assert isinstance(p, PBSProProvider) and p.status_polling_interval == 60 and type(p.launcher).__name__ == "SimpleLauncher"
    assert (p.account, p.queue, p.nodes_per_block, p.walltime, p.cpus_per_node) == ("MyProj", "prod", 256, "12:00:00", 208)
    assert (p.init_blocks, p.max_blocks) == (1, 1) and ex.max_workers_per_node == 1
    assert ex.address == "10.0.0.1 (hsn0)"  # the login node's high-speed interface (ALCF's Parsl page)
    assert p.scheduler_options == job.scheduler_options
    assert cfg.retries == 0 and cfg.strategy == "none"  # a new attempt is a new job, not a new block
    assert cfg.run_dir == str(tmp_path / "parsl")
    local = sites.load_site("local")
    lcfg = parsl_config(local, plan(None, local, ranks=1), tmp_path / "p2")
    assert type(lcfg.executors[0].provider).__name__ == "LocalProvider"


def test_the_aurora_job_script_line_by_line(aurora):
    """What the generated job runs, against ALCF's pages: a login shell's `module`, the pinned
    frameworks module, the venv made on top of it, TMPDIR, MASTER_ADDR on the high-speed network,
    the oneCCL sets, no gpu.tile mask under FLAT, no login-node thread count."""
    from workflow.parsl_sites import worker_init

    job = plan(get("scaling-mula-220b-a10b-768").paper, aurora)
    init = worker_init(aurora, job).splitlines()
    assert init[0] == "type module >/dev/null 2>&1 || source /etc/profile"
    version = re.fullmatch(r"module is-avail (frameworks/\d{4}\.\d+\.\d+) \|\| \{ echo (.*) >&2; exit 1; \}", init[1])
    assert version and "is not available" in version.group(2)  # one line before any rank starts
    assert init[2] == f"module load {version.group(1)}"  # pinned, not "frameworks"
    assert re.fullmatch(r"source \S+/\.venv/bin/activate", init[3])
    assert "export TMPDIR=/tmp" in init
    assert "export MPI_PROVIDER=$FI_PROVIDER" in init
    for name, value in (("CCL_KVS_MODE", "mpi"), ("CCL_ATL_SYNC_COLL", "1"), ("OMP_NUM_THREADS", "7"),
                        ("CCL_ALLREDUCE_SCALEOUT", "'direct:0-1048576;rabenseifner:1048577-max'")):
        assert f"export {name}={value}" in init, name
    argv = pretrain_argv({"experiment": "scaling-mula-220b-a10b-768", "scale": "paper", "threads": 1, "quiet": True})
    line = command_line(job, argv, hosts=("optimus", Path("/p/parsl/x"), Path("/r/x/node-faults.json")))
    assert "ZE_AFFINITY_MASK" not in line and "--threads" not in line
    # the hostfile of the job's healthy nodes first, rank 0's address on the high-speed network
    # from its first host, then the ranks on it
    steps = line.split(" && ")
    assert steps[:3] == ['export OPTIMUS_HOSTFILE=/p/parsl/x/hostfile."${PBS_JOBID:-local}"',
                         'optimus hosts --nodes 64 --faults /r/x/node-faults.json --out "$OPTIMUS_HOSTFILE"',
                         'export MASTER_ADDR=$(head -n 1 "$OPTIMUS_HOSTFILE" | cut -d. -f1).hsn.cm.aurora.alcf.anl.gov']
    assert steps[3].startswith(f'mpiexec -n 768 --ppn 12 --hostfile "$OPTIMUS_HOSTFILE" --cpu-bind {CPU_BIND} '
                               'optimus pretrain ')


def test_command_line_is_the_laptop_command_under_mpiexec(aurora):
    job = plan(get("scaling-mula-220b-a10b-768").paper, aurora)
    argv = pretrain_argv({"experiment": "scaling-mula-220b-a10b-768", "scale": "paper", "data": Path("/d/tok"),
                          "out": "/r/x", "preset": None, "quiet": True, "dtype": None, "set": ["a=1", "b=2"],
                          "launcher": "parsl", "site": "aurora", "nproc": 1})
    line = command_line(job, argv, hosts=("optimus", Path("/p"), None)).split(" && ")[-1]
    assert line == (f'mpiexec -n 768 --ppn 12 --hostfile "$OPTIMUS_HOSTFILE" --cpu-bind {CPU_BIND} optimus pretrain '
                    "--experiment scaling-mula-220b-a10b-768 --scale paper --data /d/tok --out /r/x --quiet --set a=1 "
                    "--set b=2 --launcher local")
    with pytest.raises(ValueError, match="hostfile"):
        command_line(job, argv)  # the line needs its hostfile's directory
    flat = sites.load_site("aurora", account="A", gpu_affinity={"variable": "ZE_AFFINITY_MASK"})
    assert "export ZE_AFFINITY_MASK=$r;" in plan(get("scaling-mula-220b-a10b-768").paper, flat).gpu_affinity


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
    *_, last_job, foot = table.splitlines()
    assert foot.startswith(f"TOTAL 22 jobs, {total:,.0f} node-hours")
    assert last_job.startswith("ablation-dp2-pp4-ep12-dp_sharded ")  # every layout of the study runs


def test_paper_dry_run_lists_every_job_and_the_node_hour_total(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OPTIMUS_ACCOUNT="CIProj")
    cmd = [sys.executable, "-m", "snakemake", "--profile", "workflow/profiles/aurora", "-n", "--nolock",
           "--config", f"results={tmp_path / 'results'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    counts = {"corpus": 1, "tokenize": 1, "pretrain": 22, "evaluate": 5, "figure": 10, "report": 1,
              "ingest_bench": 5, "perfmodel": 1, "reference": 1, "paper_plan": 1, "window_order": 1,
              "compile_cache": 1, "task_data": 1, "downstream": 3, "total": 55}
    # no CPU scaling sweep at paper scale; one window order: every run's is 2048 / 42; one
    # warm-up job fills the compile cache before the training jobs; the nine lm-eval tasks on the
    # three pretraining runs whose bf16 weights fit a tile, their data cached once before
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
    assert f"TOTAL 22 jobs, {total} node-hours (performance model on machine aurora for 22 jobs)" in text
    assert "--launcher parsl --site aurora" in text
    assert "optimus window-order --data" in text and "--seq-len 2048 --seed 42 --launcher parsl --site aurora" in text
    assert "optimus warm-cache --site aurora" in text
    assert "optimus task-data --tasks arc_easy arc_challenge hellaswag piqa boolq sciq winogrande openbookqa mmlu" in text
    assert re.search(r"optimus evaluate --run \S+pretrain-mula-7b-a1b .*--tasks arc_easy .* --downstream-all-checkpoints "
                     r"--dtype bfloat16 .*--launcher parsl --site aurora", text)
    assert "downstream tasks not run on paper-pretrain-mula-100b-a7b (186 GiB" in text
    # each evaluation is a compute job of the site too (the model sharded as trained), in bf16
    assert re.search(r"optimus evaluate --run \S+ .*--dtype bfloat16 .*--launcher parsl --site aurora", text)
    # tokenization fans out through the site's CPU executor, its shards kept beside the tokens
    assert f"--launcher parsl --site aurora --shards {tmp_path / 'results'}/data/tokens.shards" in text
    assert not (tmp_path / "results").exists()
    # Without an account the dry run plans, with the account visibly unset, and says what to set
    # before submitting (a submission refuses: tests/workflow/test_parsl_pbs.py); a placeholder
    # path of the config is named too.
    env.pop("OPTIMUS_ACCOUNT")
    dry = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    said = dry.stdout + dry.stderr
    assert dry.returncode == 0, said[-3000:]
    assert "no account: set site.account in the site YAML or the OPTIMUS_ACCOUNT environment variable" in said
    assert "config results = " not in said  # given on the command line here, no placeholder
    as_shipped = subprocess.run(cmd[:cmd.index("--config")], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=120)
    assert "config results = /lus/flare/projects/CHANGE_ME/optimus/results: a placeholder" in \
        as_shipped.stdout + as_shipped.stderr


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
    monkeypatch.setenv("HOME", str(tmp_path))  # the queue slots' default directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(sites.ACCOUNT_ENV, "EnvProj")
    base = ["pretrain", "--data", "tok", "--out", "runs/x", "--launcher", "parsl"]
    assert main([*base, "--preset", "mula-1b@laptop", "--nproc", "2", "--site", "local", "--steps", "2"]) == 0
    assert seen["nodes"] == 1 and seen["queue"] is None
    assert seen["command"].startswith("optimus pretrain --preset mula-1b@laptop --data /")
    assert seen["command"].endswith("--run-id x --steps 2 --nproc 2 --launcher local")
    assert f"--data {tmp_path}/tok --out {tmp_path}/runs/x" in seen["command"] and "--site" not in seen["command"]
    assert "x: 2 steps" in capsys.readouterr().out
    assert main([*base, "--experiment", "scaling-mula-220b-a10b-6144", "--scale", "paper", "--site", "aurora"]) == 0
    assert (seen["site"], seen["nodes"], seen["queue"]) == ("aurora", 512, "prod")
    # no mask: each rank binds its tile; the site's device and checkpoint interval lead the --set list
    hostfile, *_, line = seen["command"].split(" && ")
    assert hostfile.startswith(f"export OPTIMUS_HOSTFILE={seen['run_dir']}/hostfile.")
    assert f"optimus hosts --nodes 512 --faults {tmp_path}/runs/x/node-faults.json" in seen["command"]
    assert line.startswith(f'mpiexec -n 6144 --ppn 12 --hostfile "$OPTIMUS_HOSTFILE" --cpu-bind {CPU_BIND} '
                           "optimus pretrain --experiment")
    assert "--set train.device=xpu --set train.checkpoint_every_minutes=30" in seen["command"]
    assert seen["run_dir"].name == "paper-scaling-mula-220b-a10b-6144"


def test_evaluate_on_site_is_a_compute_job_of_the_runs_tiles(tmp_path, monkeypatch, capsys):
    from workflow import launch
    from workflow.cli import main

    seen = {}

    def fake_submit(site, job, command, run_dir, name):
        seen.update(nodes=job.nodes, queue=job.queue, command=command, name=name)
        return launch.Submitted(0, tmp_path / "o", tmp_path / "e", 0.0)

    monkeypatch.setattr(launch, "submit", fake_submit)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(sites.ACCOUNT_ENV, "EnvProj")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "meta.json").write_text('{"run_id": "paper-x"}')
    assert main(["evaluate", "--run", str(run), "--launcher", "parsl", "--site", "aurora", "--nproc", "24",
                 "--dtype", "bfloat16", "--store", "s.zarr"]) == 0
    assert (seen["nodes"], seen["queue"], seen["name"]) == (2, "debug", "evaluate-paper-x")
    assert f"optimus hosts --nodes 2 --faults {run}/node-faults.json" in seen["command"]
    assert seen["command"].split(" && ")[-1].startswith(
        f'mpiexec -n 24 --ppn 12 --hostfile "$OPTIMUS_HOSTFILE" --cpu-bind {CPU_BIND} optimus evaluate --run {run} ')
    assert "--device xpu" in seen["command"] and "--dtype bfloat16" in seen["command"]
    assert seen["command"].endswith("--launcher local") and "--nproc" not in seen["command"]
    assert f"--store {Path('s.zarr').resolve()}" in seen["command"]  # the job's working directory is not ours
    # lm-eval's tasks on every checkpoint: one node, its 12 tiles sharing the checkpoints, one
    # process each (stages/evaluate.py), the site's device
    assert main(["evaluate", "--run", str(run), "--launcher", "parsl", "--site", "aurora", "--tasks", "arc_easy",
                 "piqa", "--all-checkpoints", "--downstream-all-checkpoints", "--dtype", "bfloat16"]) == 0
    assert (seen["nodes"], seen["name"]) == (1, "downstream-paper-x")
    assert seen["command"].split(" && ")[-1].startswith(
        f'mpiexec -n 12 --ppn 12 --hostfile "$OPTIMUS_HOSTFILE" --cpu-bind {CPU_BIND} optimus evaluate --run {run} '
        f'--tasks arc_easy piqa ')
    assert "--device xpu" in seen["command"] and "--nproc" not in seen["command"]
    # the newest checkpoint alone: one process on one tile, no mpiexec
    assert main(["evaluate", "--run", str(run), "--launcher", "parsl", "--site", "aurora", "--tasks", "piqa"]) == 0
    assert seen["nodes"] == 1 and seen["command"].startswith(f"optimus evaluate --run {run} --tasks piqa ")
    assert "mpiexec" not in seen["command"] and "--nproc" not in seen["command"]
    seen.clear()
    assert main(["evaluate", "--run", str(run), "--launcher", "parsl", "--site", "aurora", "--tasks", "piqa",
                 "--nproc", "24"]) == 2  # the site's job decides the processes: said before anything is submitted
    assert not seen
