"""The paper DAG against Aurora's queue table: a stand-in qsub (tests/workflow/fixtures/pbs/)
that refuses what the table in workflow/config/aurora.yaml refuses -- account, nodes and
walltime by prod tier, jobs per user -- takes every planned job, submitted all at once through
the launcher's chain and queue slots; and the same jobs without the slots are refused."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from workflow import sites
from workflow.experiments import dag
from workflow.launch import Submitted, launch_chain
from workflow.parsl_sites import worker_init
from workflow.plan import plan

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pbs"
SITE_YAML = REPO / "workflow" / "config" / "aurora.yaml"


def qsub(tmp_path, job, name, site, dry=True):
    """The job's script as Parsl writes it (#PBS lines, then worker_init) to the stand-in qsub."""
    script = tmp_path / f"{name}.submit"
    script.write_text("\n".join(["#!/bin/bash", *job.pbs_lines()[2:], worker_init(site, job), "true", ""]))
    env = dict(os.environ, STANDIN_PBS_DIR=str(tmp_path / "pbs"), STANDIN_PBS_SITE=str(SITE_YAML),
               STANDIN_PBS_PYTHON=sys.executable)
    if dry:
        env["STANDIN_PBS_DRY_RUN"] = "1"
    args = [str(FIXTURES / "qsub"), *(["-q", job.queue] if job.queue else []), *(["-A", job.account] if job.account else []),
            str(script)]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)


def finish(tmp_path, job_id):
    (tmp_path / "pbs" / f"{job_id}.state").write_text("F\n")


@pytest.fixture
def aurora(tmp_path, monkeypatch):
    monkeypatch.delenv(sites.ACCOUNT_ENV, raising=False)
    return sites.load_site("aurora", account="CIProj", slots_dir=str(tmp_path / "slots"))


def test_the_standin_refuses_what_aurora_would(tmp_path, aurora):
    job = plan(None, aurora, ranks=12 * 300, walltime_h=12)
    ok = qsub(tmp_path, job, "ok", aurora)
    assert ok.returncode == 0, ok.stderr
    # a 13 h job of 300 nodes (prod's small tier allows 12 h), written by hand as a user might
    script = tmp_path / "long.submit"
    script.write_text("\n".join(["#!/bin/bash", "#PBS -l select=300", "#PBS -l walltime=13:00:00", ""]))
    env = dict(os.environ, STANDIN_PBS_DIR=str(tmp_path / "pbs"), STANDIN_PBS_SITE=str(SITE_YAML), STANDIN_PBS_DRY_RUN="1",
               STANDIN_PBS_PYTHON=sys.executable)
    long = subprocess.run([str(FIXTURES / "qsub"), "-q", "prod", "-A", "CIProj", str(script)], env=env,
                          capture_output=True, text=True)
    assert long.returncode == 188 and "walltime 13:00:00 over 12 h at 300 nodes" in long.stderr
    no_account = subprocess.run([str(FIXTURES / "qsub"), "-q", "prod", str(script)], env=env, capture_output=True,
                                text=True)
    assert no_account.returncode == 188 and "Account_Name is required" in no_account.stderr
    # debug-scaling takes one job per user: the second is refused while the first is queued
    small = plan(None, aurora, ranks=12 * 32, walltime_h=1)
    assert small.queue == "debug-scaling" and job.queue == "prod"
    first = qsub(tmp_path, small, "s1", aurora)
    second = qsub(tmp_path, small, "s2", aurora)
    assert first.returncode == 0 and second.returncode == 38, second.stderr
    assert "Maximum number of jobs already in queue debug-scaling" in second.stderr
    finish(tmp_path, first.stdout.strip())
    assert qsub(tmp_path, small, "s3", aurora).returncode == 0


def test_the_paper_dag_submitted_at_once_is_taken_by_the_queue_table(tmp_path, aurora):
    """Every paper job through launch_chain at the same time (as Snakemake starts them), each
    submit a dry run of the stand-in qsub that holds the job queued a moment and then ends it:
    none is refused, because the queue slots let only one job per user into the debug queues."""
    jobs = {e.name: plan(e.paper, aurora) for e in dag("paper")}
    assert sum(j.queue.startswith("debug") for j in jobs.values()) >= 8  # the case the slots are for
    refused, lock = [], threading.Lock()

    def submit(site, job, command, run_dir, name):
        out = qsub(tmp_path, job, name, site)
        if out.returncode != 0:
            with lock:
                refused.append((name, out.stderr))
            return Submitted(out.returncode, tmp_path / "o", tmp_path / "e", 0.0)
        threading.Event().wait(0.05)  # queued, then run and ended while the slot is held
        finish(tmp_path, out.stdout.strip())
        return Submitted(0, tmp_path / "o", tmp_path / "e", 0.0)

    threads = [threading.Thread(target=launch_chain, args=(aurora, job, "true", tmp_path, name),
                                kwargs=dict(submit_fn=submit, log=lambda m: None, poll_s=0.02)) for name, job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not refused, refused
    submitted = [l for l in (tmp_path / "pbs" / "qsub.log").read_text().splitlines() if l.startswith("qsub ")]
    assert len(submitted) == len(jobs) == 22


def test_each_attempt_is_a_new_job_until_one_succeeds(tmp_path, aurora):
    job = plan(dag("paper")[1].paper, aurora)  # mula-7b-a1b: chained 12 h jobs
    codes = iter([1] * (job.jobs - 1) + [0])
    calls = []

    def submit(site, job, command, run_dir, name):
        calls.append(name)
        return Submitted(next(codes), tmp_path / "o", tmp_path / "e", 0.0)

    logs = []
    assert launch_chain(aurora, job, "true", tmp_path, "r", submit_fn=submit, log=logs.append).returncode == 0
    assert len(calls) == job.jobs > 1
    assert "resumes from the newest checkpoint" in logs[1]
    always_failing = launch_chain(aurora, job, "true", tmp_path, "r",
                                  submit_fn=lambda *a, **k: Submitted(3, tmp_path / "o", tmp_path / "e", 0.0),
                                  log=logs.append)
    assert always_failing.returncode == 3
    assert sum("job" in l and "ended with status 3" in l for l in logs) == job.jobs + aurora.retries

    refused = launch_chain(aurora, job, "true", tmp_path, "r",
                           submit_fn=lambda *a, **k: Submitted(2, tmp_path / "o", tmp_path / "e", 0.0), log=logs.append)
    assert refused.returncode == 2 and sum("ended with status 2" in l for l in logs) == 0  # one job, no resubmit


def test_jobs_that_make_progress_are_followed_by_more_than_the_retries(tmp_path, aurora):
    """An evaluation of many checkpoints keeps what each job made (its progress count): a job
    cut short after it got further is followed by another, beyond the retries; jobs that get
    nowhere still end the chain after the retries."""
    from workflow.plan import plan as plan_job

    job = plan_job(None, aurora, ranks=12)
    attempts = job.jobs + aurora.retries
    made, calls = [0], []

    def submit(site, job, command, run_dir, name):  # each job evaluates 10 checkpoints of 40, then its walltime
        calls.append(name)
        made[0] = min(40, made[0] + 10)
        return Submitted(0 if made[0] == 40 else 271, tmp_path / "o", tmp_path / "e", 0.0)

    logs = []
    done = launch_chain(aurora, job, "true", tmp_path, "e", submit_fn=submit, log=logs.append, progress=lambda: made[0])
    assert done.returncode == 0 and len(calls) == 4 > attempts
    assert "[optimus launch] e: job 1 got from 0 to 10 before it ended: the next goes on" in logs
    stuck = launch_chain(aurora, job, "true", tmp_path, "e", log=logs.append, progress=lambda: 40,
                         submit_fn=lambda *a, **k: Submitted(1, tmp_path / "o", tmp_path / "e", 0.0))
    assert stuck.returncode == 1 and sum("ended with status 1" in l for l in logs) == attempts
