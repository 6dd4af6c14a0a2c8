"""Aurora's rank placement: one rank per tile, 12 per node, each training on tile <local rank> of
the 12 that FLAT mode shows (no mask) and bound to cores of that tile's socket; and the per-rank
mask wrapper a site may still ask for (a flat ZE_AFFINITY_MASK=<local rank>, CUDA_VISIBLE_DEVICES).

The generated job line is run for real under a stand-in for Aurora's PALS mpiexec that does what
PALS does with `-n N --ppn P --cpu-bind list:...`: it starts N ranks, P per node, gives each
PALS_RANKID / PALS_LOCAL_RANKID and the local rank's core set of the list (reported here in
STANDIN_CORES, since this machine has no 104 cores to bind to)."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_core.config import ConfigError
from workflow import sites
from workflow.launch import command_line
from workflow.plan import plan

PALS_STANDIN = '''\
import os, subprocess, sys
args = sys.argv[1:]
n = ppn = None
cores = []
while args[0].startswith("-"):
    flag, value = args.pop(0), args.pop(0)
    if flag == "-n": n = int(value)
    elif flag == "--ppn": ppn = int(value)
    elif flag == "--cpu-bind":
        assert value.startswith("list:"), value
        cores = value[5:].split(":")
    else: sys.exit(f"stand-in mpiexec: unknown flag {flag}")
assert n % ppn == 0 and len(cores) == ppn, (n, ppn, cores)
for rank in range(n):
    env = dict(os.environ, PALS_RANKID=str(rank), PALS_LOCAL_RANKID=str(rank % ppn), PALS_NODEID=str(rank // ppn),
               STANDIN_CORES=cores[rank % ppn])
    if subprocess.run(args, env=env).returncode: sys.exit(1)
'''
# Aurora's node: 2 sockets of 52 cores (0-51, 52-103), GPUs 0-2 on socket 0, GPUs 3-5 on socket 1;
# in FLAT mode device t is tile t % 2 of GPU t // 2.
SOCKET_OF_GPU = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
FLAT_TILES = [f"Intel(R) Data Center GPU Max 1550 (GPU {t // 2} tile {t % 2})" for t in range(12)]


def socket_of_cores(cores: str) -> int:
    first, last = map(int, cores.split("-"))
    (socket,) = {c // 52 for c in range(first, last + 1)}  # every core of the set on one socket
    return socket


@pytest.fixture
def aurora(monkeypatch):
    monkeypatch.delenv(sites.ACCOUNT_ENV, raising=False)
    return sites.load_site("aurora", account="MyProj")


def run_ranks(line: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a job line with the PALS stand-in as `mpiexec`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    standin = bin_dir / "mpiexec"
    standin.write_text(f"#!{sys.executable}\n{PALS_STANDIN}")
    standin.chmod(0o755)
    launcher = ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK", "ZE_AFFINITY_MASK")
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, **(env or {}),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, timeout=60)


def test_two_nodes_each_rank_binds_its_own_tile_on_its_own_cores(aurora, tmp_path):
    from optimus_core.device import binding_index
    from optimus_core.parallel.mesh import read_launch_env

    # the site's launch line without its hostfile step (workflow/hostfile.py has its own tests)
    bare = sites.load_site("aurora", account="MyProj", master_addr="",
                           mpiexec=aurora.mpiexec.replace(" --hostfile {hostfile}", ""))
    job = plan(None, bare, ranks=24)
    assert (job.nodes, job.ppn) == (2, 12) and job.gpu_affinity == ""
    show = ["sh", "-c", 'echo "$PALS_RANKID $PALS_NODEID $PALS_LOCAL_RANKID ${ZE_AFFINITY_MASK:-none} $STANDIN_CORES"']
    line = command_line(job, show)
    assert line == f"{job.mpiexec} {shlex.join(show)}"
    out = run_ranks(line, tmp_path)
    assert out.returncode == 0, out.stderr
    rows = sorted((line.split() for line in out.stdout.splitlines()), key=lambda r: int(r[0]))
    assert [int(r[0]) for r in rows] == list(range(24))
    tiles = {}
    for rank, node, local, mask, cores in rows:
        rank, node, local = int(rank), int(node), int(local)
        assert (node, local) == divmod(rank, 12) and mask == "none"  # FLAT: no gpu.tile mask
        launch = read_launch_env({"PMI_RANK": str(rank), "PMI_SIZE": "24", "PALS_LOCAL_RANKID": str(local),
                                  "MASTER_ADDR": "h", "MASTER_PORT": "1"})
        tile = binding_index("xpu", launch.local_rank, launch.local_world, FLAT_TILES, rank=rank)
        assert cores == aurora.cpu_bind[5:].split(":")[local]
        assert socket_of_cores(cores) == SOCKET_OF_GPU[tile // 2]  # the tile's own socket
        tiles.setdefault(node, []).append(tile)
    # on each node, every one of the 6 GPUs x 2 tiles is trained on by exactly one rank
    assert tiles == {0: list(range(12)), 1: list(range(12))}


def test_a_flat_mask_wrapper_reads_the_first_local_rank_variable_that_is_set(aurora, tmp_path):
    site = sites.load_site("aurora", account="A", gpu_affinity={
        "variable": "ZE_AFFINITY_MASK", "local_rank_env": ["PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID"]})
    wrapper = site.gpu_affinity.wrapper()
    show = f'{wrapper} sh -c "echo \\$ZE_AFFINITY_MASK"'
    assert run_ranks(show, tmp_path, {"MPI_LOCALRANKID": "7"}).stdout == "7\n"  # MPICH's Hydra
    assert run_ranks(show, tmp_path, {"PALS_LOCAL_RANKID": "4", "MPI_LOCALRANKID": "7"}).stdout == "4\n"
    missing = run_ranks(show, tmp_path)  # no launcher: the rank fails, naming what it looked for
    assert missing.returncode != 0
    assert "gpu_affinity: none of PALS_LOCAL_RANKID PMI_LOCAL_RANK MPI_LOCALRANKID is set" in missing.stderr


def test_cuda_style_affinity_is_a_yaml_edit(tmp_path):
    site = sites.site_from_dict({"name": "gpu", "kind": "local", "mpiexec": "mpiexec -n {ranks}",
                                 "gpu_affinity": {"variable": "CUDA_VISIBLE_DEVICES", "local_rank_env": "LOCAL_RANK"}})
    wrapper = plan(None, site, ranks=4).gpu_affinity
    out = run_ranks(f'{wrapper} sh -c "echo \\$CUDA_VISIBLE_DEVICES"', tmp_path, {"LOCAL_RANK": "3"})
    assert out.stdout == "3\n"


def test_bad_affinity_and_binding_fail_at_load_time_naming_the_field():
    with pytest.raises(ConfigError, match=r"site.gpu_affinity.value = '\{card\}': .*unknown placeholder 'card'"):
        sites.load_site("aurora", account="A", gpu_affinity={"variable": "ZE_AFFINITY_MASK", "value": "{card}"})
    with pytest.raises(ConfigError, match=r"site.gpu_affinity.value = '\{gpu\}; rm': must be letters"):
        sites.load_site("aurora", account="A", gpu_affinity={"variable": "ZE_AFFINITY_MASK", "value": "{gpu}; rm"})
    with pytest.raises(ConfigError, match=r"site.gpu_affinity.variable = 'ZE MASK': must be an environment variable"):
        sites.load_site("aurora", account="A", gpu_affinity={"variable": "ZE MASK"})
    with pytest.raises(ConfigError, match=r"gpu_affinity.tiles_per_gpu = 5: must divide tiles_per_node \(12\)"):
        sites.load_site("aurora", account="A", gpu_affinity={"variable": "ZE_AFFINITY_MASK", "tiles_per_gpu": 5})
    with pytest.raises(ConfigError, match=r"site.gpu_affinity = .*needs variable"):
        sites.load_site("aurora", account="A", gpu_affinity={"value": "{gpu}"})
    with pytest.raises(ConfigError, match=r"site aurora: cpu_bind = 'list:1-8:9-16': a list needs one core set per rank "
                                          r"of a node \(tiles_per_node = 12\), not 2"):
        sites.load_site("aurora", account="A", cpu_bind="list:1-8:9-16")
    with pytest.raises(ConfigError, match=r"site aurora: gpu_affinity = .*needs an mpiexec line"):
        sites.load_site("aurora", account="A", mpiexec="", gpu_affinity={"variable": "ZE_AFFINITY_MASK"})
    assert sites.load_site("aurora", account="A", gpu_affinity=None).gpu_affinity is None
