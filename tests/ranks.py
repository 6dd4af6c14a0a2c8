"""A training run on several local gloo ranks, for the tests (importable: tests/ is on sys.path via conftest)."""
import json

import torch

from optimus_core.config import RunConfig
from optimus_core.parallel import init_distributed, shutdown
from optimus_core.parallel.launch import spawn_local
from optimus_core.train.loop import Trainer
from sinks import ListSink


def _worker(cfg_json, tokens_dir, run_dir, out_path, rows):
    torch.set_num_threads(1)
    cfg = RunConfig.from_json(cfg_json)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts, device=cfg.train.device)
    try:
        sink = ListSink()
        Trainer(cfg, tokens_dir, run_dir, writer=sink, progress=False, mesh=mesh).fit()
        if mesh.rank == 0:
            out_path.write_text(json.dumps(rows(sink)))
        else:
            assert sink.rows == {}  # only global rank 0 records
    finally:
        shutdown(mesh)


def train_on_ranks(nproc, cfg, tokens_dir, run_dir, out_path, rows, start_method="fork"):
    """Train ``cfg`` (an MoE model) on ``nproc`` local ranks (forked: gloo on the CPU; "spawn"
    for GPUs) from ``tokens_dir`` into ``run_dir``; returns ``rows(sink)`` of global rank 0's
    metrics, through ``out_path`` (JSON)."""
    spawn_local(_worker, nproc, (cfg.to_json(), tokens_dir, run_dir, out_path, rows), start_method=start_method)
    return json.loads(out_path.read_text())


def fit_on_rank(cfg_json, tokens_dir, run_dir):
    """One gloo rank (spawn_local's function) training ``cfg_json`` into ``run_dir``, no store."""
    torch.set_num_threads(1)
    cfg = RunConfig.from_json(cfg_json)
    mesh = init_distributed(cfg.parallel, cfg.model.moe.n_experts, device="cpu")
    try:
        Trainer(cfg, tokens_dir, run_dir, progress=False, mesh=mesh).fit()
    finally:
        shutdown(mesh)
