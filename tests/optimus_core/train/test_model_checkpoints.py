"""Model-only checkpoints (train.model_checkpoint_every): the weights alone every N steps, all
kept beside the pruned full ones, equal to the full checkpoint's model of the same step, and
evaluated with them."""
import json

import torch

from optimus_core import presets
from optimus_core.parallel.launch import spawn_local
from optimus_core.train import checkpoint as ckpt
from optimus_core.train.loop import Trainer
from ranks import fit_on_rank
from stages.evaluate import _checkpoints


def _cfg(ep=1):
    return presets.get("mula-7b-a1b@laptop").run_config(**{
        "train.steps": 5, "train.checkpoint_every": 2, "train.keep_checkpoints": 2, "train.model_checkpoint_every": 2,
        "train.eval_batches": 1, "train.device": "cpu", "train.global_batch": 4, "data.seq_len": 32,
        "schedule.warmup_steps": 2, "model.n_layers": 1, "model.moe.n_experts": 4, "model.moe.top_k": 2,
        "parallel.ep": ep})


def _steps(run_dir, kind):
    return [int(p.name.split("_")[1]) for p in ckpt.list_step_dirs(run_dir, kind)]


def _check(run_dir):
    # full: the newest two (4 and the final 5); model-only: every 2nd step, none pruned
    assert _steps(run_dir, ckpt.FULL) == [4, 5] and _steps(run_dir, ckpt.MODEL_ONLY) == [2, 4]
    model_only = {c.step: c for c in ckpt.valid_checkpoints(run_dir, kind=ckpt.MODEL_ONLY)}
    full = {c.step: c for c in ckpt.valid_checkpoints(run_dir)}
    assert model_only[4].meta["model_only"] and "model_only" not in full[4].meta
    a, b = model_only[4].load_model_state(), full[4].load_model_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    size = lambda c: sum(p.stat().st_size for p in c.path.glob("*.distcp"))  # noqa: E731
    assert size(model_only[4]) < size(full[4]) / 2  # no AdamW moments
    # every checkpoint an evaluation reads: model-only 2, then full 4 (both hold step 4), 5
    points = _checkpoints(run_dir, every=True)
    assert [(p.found.step, p.found.path.parent.name) for p in points] == [
        (2, "model_checkpoints"), (4, "checkpoints"), (5, "checkpoints")]


def test_model_only_checkpoints_one_process(tmp_path, tokens_dir):
    torch.manual_seed(0)
    Trainer(_cfg(), tokens_dir, tmp_path / "run", progress=False).fit()
    _check(tmp_path / "run")


def test_model_only_checkpoints_of_two_expert_parallel_ranks_load_whole(tmp_path, tokens_dir):
    spawn_local(fit_on_rank, 2, (_cfg(ep=2).to_json(), tokens_dir, tmp_path / "run"), start_method="fork")
    _check(tmp_path / "run")
    meta = json.loads((ckpt.checkpoints_dir(tmp_path / "run", ckpt.MODEL_ONLY) / "step_000004" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["manifests"] == 2
