"""Aurora's Python environment: the frameworks module's torch satisfies ours, and the install
script installs everything else without touching torch or triton."""
import re
import subprocess
from pathlib import Path

from packaging.requirements import Requirement

from workflow.requirements import dist_name, requirements

REPO = Path(__file__).resolve().parents[2]


def test_the_frameworks_modules_torch_satisfies_the_requirement():
    (torch,) = [Requirement(r) for r in requirements() if dist_name(r) == "torch"]
    for version in ("2.10.0a0+git449b176", "2.10.0", "2.11.0+cu128", "2.14.1"):
        assert torch.specifier.contains(version, prereleases=True), version
    assert not torch.specifier.contains("2.15.0") and not torch.specifier.contains("2.9.1")


def test_requirements_without_the_modules_packages():
    kept = requirements(without=("torch", "Triton"), extras=("aurora",))
    names = [dist_name(r) for r in kept]
    assert "torch" not in names and "triton" not in names
    assert {"numpy", "snakemake", "parsl", "zarr", "mpi4py"} <= set(names)
    assert len(kept) == len(requirements(extras=("aurora",))) - 2


def test_the_environment_script_never_installs_torch_or_triton():
    script = (REPO / "workflow" / "aurora_env.sh").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "workflow" / "aurora_env.sh")]).returncode == 0
    installs = [line for line in script.splitlines() if re.search(r"\bpip install\b", line)]
    assert installs == ['pip install -r "$VENV/optimus-requirements.txt"', "pip install --no-deps -e ."]
    assert "python3 -m venv --system-site-packages" in script and "--without torch triton" in script
    # the module the script pins is the one the site's jobs load
    pinned = re.search(r"FRAMEWORKS:-(frameworks/\S+)\}", script).group(1)
    assert f"module load {pinned}" in (REPO / "workflow" / "config" / "aurora.yaml").read_text()
