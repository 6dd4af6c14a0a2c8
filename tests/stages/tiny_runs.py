"""Tiny `optimus pretrain` runs for the tests of run directories (locks, resumes): one layer of
the dense laptop preset, 4 sequences of 32 tokens a step, on the CPU."""
import hashlib
from pathlib import Path

from workflow.cli import main

TINY = ["--quiet", "--threads", "1", "--set", "train.eval_batches=1", "--set", "model.n_layers=1",
        "--set", "train.global_batch=4", "--set", "data.seq_len=32", "--set", "train.device=cpu"]


def pretrain(tokens: Path, run: Path, steps: int, *sets: str) -> int:
    """`optimus pretrain` of ``steps`` steps into ``run``, with ``--set`` of each of ``sets``: its exit status."""
    extra = [a for s in sets for a in ("--set", s)]
    return main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens), "--out", str(run),
                 "--steps", str(steps), *TINY, *extra])


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path: what a refusal must leave as it was."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
