"""A job's hostfile: its node file's hosts, each once, less those a run named faulty; spare nodes
stand in for them, and without enough healthy ones the job stops in one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_core.config import ConfigError
from optimus_core.train import node_faults
from workflow import sites
from workflow.hostfile import NotEnoughHosts, healthy_hosts, job_hosts, write_hostfile
from workflow.plan import plan

FQDN = ".hostmgmt2102.cm.aurora.alcf.anl.gov"


def test_job_hosts_are_the_node_files_each_once_in_order(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text(f"x1{FQDN}\nx1{FQDN}\n\nx2{FQDN}\nx0{FQDN}\n")
    assert job_hosts(nodefile) == [f"x1{FQDN}", f"x2{FQDN}", f"x0{FQDN}"]
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="lists no host"):
        job_hosts(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="node file .*absent"):
        job_hosts(tmp_path / "absent")


def test_named_hosts_are_left_out_and_spares_take_their_place():
    hosts = [f"x{i}{FQDN}" for i in range(4)]
    assert healthy_hosts(hosts, [], 3) == hosts[:3]
    assert healthy_hosts(hosts, ["x1"], 3) == [hosts[0], hosts[2], hosts[3]]  # the rank's short name matches
    with pytest.raises(NotEnoughHosts, match=r"x1.* x2.*named faulty by the run: 2 healthy of the 3 needed.*spare_nodes"):
        healthy_hosts(hosts, ["x1", "x2"], 3, spare=1)
    with pytest.raises(NotEnoughHosts, match="holds 4 node"):
        healthy_hosts(hosts, [], 5)


def test_optimus_hosts_writes_the_hostfile_and_says_what_it_left_out(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("a\nb\nc\n")
    node_faults.record(tmp_path, 7, ["b"])
    env = dict(os.environ, PBS_NODEFILE=str(nodefile))
    cmd = [sys.executable, "-m", "workflow.cli", "hosts", "--nodes", "2", "--out", str(tmp_path / "hostfile"),
           "--faults", str(tmp_path / node_faults.FAULTS_FILE)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "hostfile").read_text() == "a\nc\n"
    assert "leaving out b" in out.stderr
    # one more named: no spare left; one line, exit 1, no hostfile
    node_faults.record(tmp_path, 9, ["c"])
    (tmp_path / "hostfile").unlink()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot be left out" in out.stderr and not (tmp_path / "hostfile").exists()
    no_job = {k: v for k, v in env.items() if k != "PBS_NODEFILE"}
    out = subprocess.run(cmd, env=no_job, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 2 and "$PBS_NODEFILE" in out.stderr


def test_write_hostfile_refuses_a_faults_file_that_is_not_ours(tmp_path):
    (tmp_path / "nodes").write_text("a\n")
    (tmp_path / "faults.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(ValueError, match="not a node-faults file"):
        write_hostfile(tmp_path / "h", nodes=1, faults=tmp_path / "faults.json", nodefile=tmp_path / "nodes")


def test_spare_nodes_are_asked_for_charged_and_checked(monkeypatch):
    monkeypatch.delenv(sites.ACCOUNT_ENV, raising=False)
    site = sites.load_site("aurora", account="A", spare_nodes=2)
    job = plan(None, site, ranks=12 * 32)
    assert job.select_line.startswith("#PBS -l select=34:") and job.nodes == 32 and job.spare_nodes == 2
    with pytest.raises(ConfigError, match="spare_nodes = 2: more than the job's 1 node"):
        plan(None, site, ranks=12)
    with pytest.raises(ConfigError, match="spare_nodes.*hostfile"):
        sites.load_site("aurora", account="A", spare_nodes=1, master_addr="",
                        mpiexec="mpiexec -n {ranks} --ppn {ppn} --cpu-bind {cpu_bind}")
    with pytest.raises(ConfigError, match="spare_nodes = -1: must be >= 0"):
        sites.load_site("aurora", account="A", spare_nodes=-1)


def _site_submitting_to(tmp_path, monkeypatch, **fields):
    """(what the fake submit saw, the site YAML, its block): Aurora's site with ``fields``, its
    jobs recorded instead of submitted (each ends with success)."""
    import yaml

    from workflow import launch

    seen = {}

    def fake_submit(site, job, command, run_dir, name):
        seen.update(job=job, command=command, name=name)
        (tmp_path / "o").write_text("done\n")
        return launch.Submitted(0, tmp_path / "o", tmp_path / "e", 0.0)

    monkeypatch.setattr(launch, "submit", fake_submit)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(sites.ACCOUNT_ENV, "P")
    site = tmp_path / "site.yaml"
    block = yaml.safe_load((Path(__file__).resolve().parents[2] / "workflow/config/aurora.yaml").read_text())["site"]
    block.update(run_dir=str(tmp_path / "parsl"), slots_dir=str(tmp_path / "slots"), **fields)
    site.write_text(yaml.safe_dump({"site": block}))
    return seen, site, block


def test_warm_cache_is_one_process_on_one_node_filling_the_sites_cache(tmp_path, monkeypatch):
    """`optimus warm-cache`: a one-node job of the site whose command is `optimus rehearse` of the
    paper runs (no mpiexec, no hostfile), with the fill flag, after the cache is checked writable;
    every other job of the site carries the cache's place."""
    from workflow.cli import main

    seen, site, block = _site_submitting_to(tmp_path, monkeypatch, compile_cache=str(tmp_path / "cache"))
    assert main(["warm-cache", "--site", str(site), "--experiment", "pretrain-mula-1b", "--steps", "3"]) == 0
    job = seen["job"]
    assert job.nodes == 1 and job.mpiexec == "" and job.env["OPTIMUS_COMPILE_CACHE_FILL"] == "1"
    assert job.env["OPTIMUS_COMPILE_CACHE"] == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    assert seen["command"] == (f"optimus rehearse --no-save --steps 3 --site {site} --device xpu "
                               "--experiment pretrain-mula-1b")
    big = plan(None, sites.load_site(str(site)), ranks=12 * 256)
    assert big.env["OPTIMUS_COMPILE_CACHE"] == str(tmp_path / "cache") and "OPTIMUS_COMPILE_CACHE_FILL" not in big.env
    # a cache no job can write: one line, nothing submitted
    import yaml

    (tmp_path / "flat").write_text("x")
    block["compile_cache"] = str(tmp_path / "flat" / "cache")
    site.write_text(yaml.safe_dump({"site": block}))
    seen.clear()
    assert main(["warm-cache", "--site", str(site)]) == 2 and not seen


def test_window_order_on_a_site_is_one_process_on_one_node(tokens_dir, tmp_path, monkeypatch):
    """`optimus window-order --launcher parsl`: a one-node job of the site (no mpiexec, no
    hostfile) whose command draws the order locally, beside the tokens (absolute paths: the job
    runs elsewhere); tokens that are not there are one line, nothing submitted."""
    from workflow.cli import main

    seen, site, _ = _site_submitting_to(tmp_path, monkeypatch, compile_cache="")
    monkeypatch.chdir(tokens_dir.parent)
    assert main(["window-order", "--data", tokens_dir.name, "--seed", "7", "--launcher", "parsl",
                 "--site", str(site)]) == 0
    job = seen["job"]
    assert job.nodes == 1 and job.ranks == 1 and job.mpiexec == ""
    assert seen["command"] == f"optimus window-order --data {tokens_dir} --seq-len 2048 --seed 7 --epochs 1 --launcher local"
    assert seen["name"] == "window-order-s2048-seed7" and not (tokens_dir / "window-order").exists()
    seen.clear()
    assert main(["window-order", "--data", str(tmp_path / "none"), "--launcher", "parsl", "--site", str(site)]) == 1
    assert not seen
