"""End to end without Aurora: the real Parsl PBSProProvider, stand-in qsub/qstat/qdel, real mpiexec.

`optimus pretrain --launcher parsl --site SITE.yaml` plans the job from the Aurora site block
(account, queue and node size pointed at the stand-ins), Parsl writes the PBS script and submits
it with the stand-in qsub (tests/workflow/fixtures/pbs/), which runs it here in the background;
Parsl polls it with `qstat -x -f -F json`, the HTEX worker in it runs the bash app
`mpiexec -n 2 -ppn 2 optimus pretrain ... --launcher local`, the run reaches its last step and
writes its metrics to the store, and Parsl's cleanup ends the job with qdel.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pbs"
VENV_BIN = Path(sys.executable).parent

pytest.importorskip("parsl")


def standin_site(tmp_path: Path, file: str = "site.yaml", **changes) -> Path:
    """workflow/config/aurora.yaml's site block, pointed at this machine and the stand-ins."""
    site = yaml.safe_load((REPO / "workflow/config/aurora.yaml").read_text())["site"]
    site.update(
        account="TestProj", queue="debug", tiles_per_node=2, cpus_per_node=2, walltime_h=0.25,
        worker_init=[f"export PATH={VENV_BIN}:{FIXTURES}:$PATH", f"cd {REPO}",
                     "export MASTER_ADDR=127.0.0.1", f"export MASTER_PORT={free_port()}"],
        mpiexec="mpiexec -n {ranks} -ppn {ppn}",  # MPICH's flags; Aurora's PALS line stays in aurora.yaml
        master_addr="",  # MASTER_ADDR above
        cpu_bind="", optimus=str(VENV_BIN / "optimus"), address="127.0.0.1", retries=0, status_polling_interval=2,
        run_dir=str(tmp_path / "parsl"), slots_dir=str(tmp_path / "slots"),
        # this machine has no XPU, no hsn0 (address above) and no 30-minute patience
        device="cpu", address_interface="", checkpoint_every_minutes=0,
    )
    site.update(changes)
    path = tmp_path / file
    path.write_text(yaml.safe_dump({"site": site}, sort_keys=False))
    return path


def optimus(tmp_path: Path, *args: str, timeout: int = 150, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{FIXTURES}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
               STANDIN_PBS_DIR=str(tmp_path / "pbs"), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(env_vars)
    env.pop("OPTIMUS_ACCOUNT", None)
    return subprocess.run([str(VENV_BIN / "optimus"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(shutil.which("mpiexec") is None,
                    reason="needs a real mpiexec (MPICH: apt-get install mpich; .ci/run installs it)")
def test_pretrain_through_parsl_pbspro_and_mpiexec(tmp_path, tokens_dir, monkeypatch):
    # Two stand-in nodes of 2 "tiles" each (mpiexec -n 4 -ppn 2), admitted by the stand-in qsub
    # against the site's queue table. The first job is cut as if by its walltime right after the
    # first checkpoint; the launcher submits a new job, which resumes; the losses are those of an
    # uninterrupted run of the same 4 ranks.
    site = standin_site(tmp_path, retries=1, heartbeat_period=1, heartbeat_threshold=4)
    run_dir, store = tmp_path / "runs" / "pbs-smoke", tmp_path / "store.zarr"
    monkeypatch.setenv("STANDIN_PBS_CUT_FIRST_JOB_WHEN", str(run_dir / "checkpoints" / "step_000002"))
    monkeypatch.setenv("STANDIN_PBS_SITE", str(site))
    # no --quiet: the launch line read below is an info line
    train = ["--preset", "mula-7b-a1b@laptop", "--data", str(tokens_dir), "--steps", "6", "--checkpoint-every", "2",
             "--threads", "1", "--set", "train.eval_batches=1", "--set", "train.global_batch=8"]
    out = optimus(tmp_path, "pretrain", *train, "--out", str(run_dir), "--run-id", "pbs-smoke", "--store", str(store),
                  "--launcher", "parsl", "--site", str(site), "--nproc", "4", timeout=400)
    log = (tmp_path / "pbs" / "qsub.log").read_text() if (tmp_path / "pbs" / "qsub.log").is_file() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + log
    command = out.stderr.split("[optimus] launch: ")[1].splitlines()[0]  # logged, on stderr
    assert "mpiexec -n 4 -ppn 2 optimus pretrain " in command.replace(str(VENV_BIN / "optimus"), "optimus")
    assert "--launcher local" in command and "ZE_AFFINITY_MASK" not in command  # FLAT: no mask
    assert "--set train.device=cpu" in command and "--threads" not in command
    assert "pbs-smoke: 6 steps" in out.stdout

    # Parsl submitted a job with the site's account, queue and #PBS lines; PBS cut it; the
    # launcher submitted a second, new job (site retries: 1); Parsl's cleanup qdel'ed it.
    events = [line.split()[0] for line in log.splitlines()]
    assert events in (["qsub", "cut", "qsub", "qdel"], ["qsub", "cut", "qdel", "qsub", "qdel"]), log  # no third job
    submits = [line for line in log.splitlines() if line.startswith("qsub ")]
    assert len(submits) == 2 and "-q debug" in submits[0] and "-A TestProj" in submits[0]
    for directive in ("#PBS -l select=2:ncpus=2", "#PBS -l walltime=00:15:00",
                      "#PBS -l filesystems=home:flare", "#PBS -l place=scatter", "#PBS -k doe"):
        assert directive in submits[0], directive
    script = Path(submits[0].split(" | ")[0].split()[-1]).read_text()
    for env in ("CCL_PROCESS_LAUNCHER=pmix", "CCL_ATL_TRANSPORT=mpi", "CCL_KVS_MODE=mpi",
                "FI_MR_CACHE_MONITOR=userfaultfd", "CCL_ALLTOALLV=naive", "OMP_NUM_THREADS=7"):
        assert f"export {env}" in script

    # The run finished, resumed from a checkpoint of the cut job, and its metrics are in the store.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"] in (2, 4), summary
    from optimus_core.store import open_store
    s = open_store(store, mode="r")
    assert s.runs().set_index("run_id").loc["pbs-smoke", "status"] == "completed"
    resumed = s.metrics("pbs-smoke").set_index("step")["loss"]
    # One writer (rank 0). Rows the cut job had not flushed yet may be lost: only the resumed
    # part is guaranteed.
    assert set(range(summary["resumed_from"] + 1, 7)) <= set(resumed.index), list(resumed.index)

    # The same 4 ranks, uninterrupted, here: the same losses, bit for bit.
    straight = optimus(tmp_path, "pretrain", *train, "--out", str(tmp_path / "runs" / "straight"), "--run-id",
                       "straight", "--store", str(store), "--nproc", "4", "--set", "train.device=cpu", timeout=400)
    assert straight.returncode == 0, straight.stderr[-3000:]
    want = open_store(store, mode="r").metrics("straight").set_index("step")["loss"]
    for step, loss in resumed.items():
        assert loss == want[step], (step, loss, want[step])


def test_bad_site_stops_before_submitting(tmp_path, capsys, monkeypatch):
    from workflow.cli import main

    monkeypatch.delenv("OPTIMUS_ACCOUNT", raising=False)
    monkeypatch.setenv("STANDIN_PBS_DIR", str(tmp_path / "pbs"))
    base = ["pretrain", "--preset", "mula-1b@laptop", "--data", str(tmp_path), "--out", str(tmp_path / "r"),
            "--launcher", "parsl"]
    cases = [
        (standin_site(tmp_path, "bad1.yaml", account=""), [], 2, "site aurora: account = '': missing"),
        (standin_site(tmp_path, "bad2.yaml", tiles_per_node=12), ["--nproc", "8"], 2,
         "tiles = 8: must be a multiple of tiles_per_node (12)"),
        (standin_site(tmp_path, "bad3.yaml", queue="debug", tiles_per_node=1), ["--nproc", "3"], 2,
         "nodes = 3: queue 'debug' allows 1-2 nodes"),
        (standin_site(tmp_path, "bad4.yaml", queue="debug", walltime_h=2, tiles_per_node=1), [], 2,
         "walltime_h = 2: over queue 'debug''s limit of 1h"),
        (standin_site(tmp_path, "bad5.yaml", queue="gpu"), [], 2, "queue = 'gpu': unknown; allowed: auto, debug, debug-scaling, capacity, prod"),
        (None, [], 2, "needs --site NAME"),  # a usage error, as tokenize says it
    ]
    for site, extra, code, message in cases:
        got = main(base + (["--site", str(site)] if site else []) + extra)
        err = capsys.readouterr().err
        assert got == code and message in err, (message, err)
    assert not (tmp_path / "pbs").exists() and not (tmp_path / "r").exists()



def _mpich_hosts(names: list[str]) -> bool:
    """Whether this machine's mpiexec starts ranks on each of ``names`` here (MPICH's Hydra does
    for the names of this machine, without ssh)."""
    hostfile = Path(os.environ.get("TMPDIR", "/tmp")) / f"optimus-hosts-probe-{os.getpid()}"
    hostfile.write_text("".join(f"{n}\n" for n in names))
    try:
        done = subprocess.run(["mpiexec", "-f", str(hostfile), "-n", str(len(names)), "-ppn", "1", "true"],
                              capture_output=True, timeout=30)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        hostfile.unlink()


@pytest.mark.skipif(shutil.which("mpiexec") is None,
                    reason="needs a real mpiexec (MPICH: apt-get install mpich; .ci/run installs it)")
def test_a_node_fault_names_the_host_and_the_next_job_runs_without_it(tmp_path, tokens_dir, monkeypatch):
    # Two nodes of 2 ranks and one spare (STANDIN_PBS_HOSTS: three names of this machine). The
    # ranks on the second node see a NaN loss at step 4 (a faulty tile: fixtures/fault); the job
    # stops with status 76 and the host named in the run's node-faults.json, nothing saved past
    # step 2; the next job's hostfile leaves the host out, takes the spare, resumes from step 2,
    # and its losses are those of an uninterrupted run of the same 4 ranks.
    hosts = ["localhost", "127.0.0.1", socket.gethostname()]
    if not _mpich_hosts(hosts):
        pytest.skip(f"mpiexec cannot start ranks on {hosts} here")
    site = standin_site(tmp_path, retries=1, heartbeat_period=1, heartbeat_threshold=4, spare_nodes=1,
                        queue="debug-scaling", mpiexec="mpiexec -n {ranks} -ppn {ppn} -f {hostfile}")
    run_dir, store = tmp_path / "runs" / "faulty", tmp_path / "store.zarr"
    monkeypatch.setenv("STANDIN_PBS_SITE", str(site))
    train = ["--preset", "mula-7b-a1b@laptop", "--data", str(tokens_dir), "--steps", "6", "--checkpoint-every", "2",
             "--threads", "1", "--set", "train.eval_batches=1", "--set", "train.global_batch=8"]
    out = optimus(tmp_path, "pretrain", *train, "--out", str(run_dir), "--run-id", "faulty", "--store", str(store),
                  "--launcher", "parsl", "--site", str(site), "--nproc", "4", timeout=400,
                  STANDIN_PBS_HOSTS=" ".join(hosts), STANDIN_FAULT_HOST="127.0.0.1", STANDIN_FAULT_STEP="4",
                  PYTHONPATH=f"{FIXTURES.parent / 'fault'}{os.pathsep}{REPO}")
    log = (tmp_path / "pbs" / "qsub.log").read_text() if (tmp_path / "pbs" / "qsub.log").is_file() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + log
    assert "#PBS -l select=3:ncpus=2" in log  # the run's 2 nodes and the spare
    assert "job 1 ended with status 76" in out.stderr and "host(s) 127.0.0.1 named in" in out.stderr, out.stderr[-3000:]
    faults = json.loads((run_dir / "node-faults.json").read_text())
    assert faults["hosts"] == ["127.0.0.1"] and faults["events"][0]["step"] == 4
    hostfiles = sorted((tmp_path / "parsl" / "faulty").glob("hostfile.*"))
    assert [p.read_text().split() for p in hostfiles] == [hosts[:2], [hosts[0], hosts[2]]]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"] == 2, summary

    straight = optimus(tmp_path, "pretrain", *train, "--out", str(tmp_path / "runs" / "straight"), "--run-id",
                       "straight", "--store", str(store), "--nproc", "4", "--set", "train.device=cpu", timeout=400)
    assert straight.returncode == 0, straight.stderr[-3000:]
    from optimus_core.store import open_store
    s = open_store(store, mode="r")
    got = s.metrics("faulty").set_index("step")["loss"]
    want = s.metrics("straight").set_index("step")["loss"]
    assert set(range(3, 7)) <= set(got.index)
    for step in range(3, 7):
        assert got[step] == want[step], (step, got[step], want[step])
