"""Our package's requirements without the ones a site's module provides (Aurora: torch, triton).

    python -m workflow.requirements --without torch triton > requirements.txt
    pip install -r requirements.txt && pip install --no-deps -e .

ALCF's frameworks module ships its own torch (2.10.0a0+..., xpu + xccl) and Triton for XPU; a plain
`pip install -e .` in a venv on top of it would replace them with PyPI's CUDA builds. This lists
pyproject.toml's dependencies (and the extras asked for) minus the distributions named, so the
environment script (workflow/aurora_env.sh) installs everything else and then our package with
``--no-deps``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def dist_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement ("Torch>=2.10" -> "torch")."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def requirements(without: tuple[str, ...] = (), extras: tuple[str, ...] = (), path: Path = PYPROJECT) -> list[str]:
    project = _toml(path)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        if extra not in project.get("optional-dependencies", {}):
            raise SystemExit(f"extra {extra!r}: unknown; known: {', '.join(project.get('optional-dependencies', {}))}")
        reqs += project["optional-dependencies"][extra]
    drop = {dist_name(w) for w in without}
    return [r for r in reqs if dist_name(r) not in drop]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--without", nargs="*", default=[], help="distributions the environment already provides")
    p.add_argument("--extras", nargs="*", default=[], help="optional dependency groups to add")
    args = p.parse_args(argv)
    print("\n".join(requirements(tuple(args.without), tuple(args.extras))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
