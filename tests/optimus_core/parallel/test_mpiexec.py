"""Under a real mpiexec (MPICH's Hydra sets PMI_RANK / PMI_SIZE / MPI_LOCALRANKID): the ranks join
with the layout's groups, and a missing MASTER_ADDR is an error on every rank, not a hang."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_core.parallel.launch import free_port

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on this machine")

ROOT = Path(__file__).resolve().parents[3]
PROBE = """
import torch
from optimus_core.config import ParallelConfig
from optimus_core.parallel import init_distributed, shutdown
m = init_distributed(ParallelConfig(ep=2), n_experts=4, device="cpu")
t = torch.ones(1) * (m.rank + 1)
m.all_reduce_sum_(t)
print(f"rank {m.rank}/{m.world_size} local {m.local_rank} ep_ranks {list(m.ep_ranks)} sum {int(t.item())}", flush=True)
shutdown(m)
"""


def _mpiexec(n, *env_pairs):
    env_args = [a for k, v in (("PYTHONPATH", str(ROOT)),) + env_pairs for a in ("-env", k, v)]
    return subprocess.run(["mpiexec", "-n", str(n), *env_args, sys.executable, "-c", PROBE],
                          capture_output=True, text=True, timeout=90)


def test_ranks_and_groups_under_mpiexec():
    done = _mpiexec(4, ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())))
    assert done.returncode == 0, done.stderr[-2000:]
    # mpiexec forwards the ranks' stdout unsynchronised: lines may run into each other
    lines = sorted(re.findall(r"rank \d+/\d+ local \d+ ep_ranks \[[\d, ]*\] sum \d+", done.stdout))
    assert lines == [f"rank {r}/4 local {r} ep_ranks {[r - r % 2, r - r % 2 + 1]} sum 10" for r in range(4)]


def test_missing_master_addr_fails_on_every_rank():
    done = _mpiexec(2)
    assert done.returncode != 0
    for rank in (0, 1):
        assert f"MASTER_ADDR and MASTER_PORT not set under pmi with world size 2 (rank {rank})" in done.stderr
