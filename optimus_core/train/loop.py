"""The training loop: build, resume, then step / evaluate / checkpoint / log until done.

    from optimus_core.train.loop import Trainer
    summary = Trainer(cfg, data_dir="results/data/tokens", run_dir="results/runs/x", writer=w).fit()

The step itself lives in optimus_core.train.step; this module only arranges what happens around
it. A run directory that holds a valid checkpoint is resumed from it, with no flag.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from ..config import RunConfig
from ..data import BatchLoader, TokenDataset, load_manifest
from ..device import DeviceInfo, device_info
from ..model.linear_cross_entropy import use_softmax_kernel
from ..model.transformer import Transformer
from ..parallel import Mesh, ShardedAdamW, parallelize
from . import checkpoint as ckpt
from .evaluate import heldout_metrics
from .optim import build_optimizer, use_bf16_expert_grads
from .resilience import LossGuard, Preempted, StopRequest
from .schedule import lr_at
from .step import train_step
from .update_stream import settle_updates
from .watchdog import Watchdog


class MetricsSink(Protocol):
    """What the loop needs of a results-store writer (optimus_core.store.RunWriter)."""

    def log(self, table: str, row: dict[str, Any], dims: dict | None = None) -> None: ...
    def update_attrs(self, **attrs: Any) -> None: ...
    def flush(self) -> None: ...


@dataclass
class TrainSummary:
    steps: int  # the last step reached
    tokens: int
    resumed_from: int | None  # step of the checkpoint the run resumed from
    final_loss: float
    final_eval: dict[str, float]
    tokens_per_s: float  # median over the steps of this process's life
    wall_time_s: float


def build_model(cfg: RunConfig, device: torch.device | str = "cpu") -> Transformer:
    """The model of ``cfg``, initialised deterministically from ``cfg.train.seed``, or, with
    ``cfg.train.init_from`` (a Hugging Face export, optimus_core.hf), with its weights; its
    architecture must be ``cfg.model``'s (ValueError listing the fields that differ). A resumed
    run loads its checkpoint over these weights (the export is read all the same: keep it)."""
    model = Transformer(cfg.model)
    if cfg.train.init_from:
        from ..hf import ExportError, import_hf  # safetensors: only when asked

        where = f"train.init_from = {cfg.train.init_from!r}"
        try:
            source, source_cfg = import_hf(cfg.train.init_from)
        except (ExportError, FileNotFoundError) as e:
            raise ValueError(f"{where}: {e}") from None

        def arch(m) -> dict:  # what fixes the weights' shapes and the function they compute
            moe = m.moe
            return {"padded vocab_size": m.padded_vocab_size, "d_model": m.d_model, "n_layers": m.n_layers,
                    "n_heads": m.n_heads, "kv heads": m.kv_heads, "qk_norm": m.qk_norm, "rope_theta": m.rope_theta,
                    "norm_eps": m.norm_eps, "d_ff": None if moe else m.d_ff, "moe": moe is not None,
                    "moe.n_experts": moe and moe.n_experts, "moe.top_k": moe and moe.top_k,
                    "moe.d_expert": moe and moe.d_expert, "moe.norm_topk_probs": moe and moe.norm_topk_probs}
        ours, theirs = arch(cfg.model), arch(source_cfg)
        differ = [f"{k} {ours[k]} here, {theirs[k]} there" for k in ours if ours[k] != theirs[k]]
        if differ:
            raise ValueError(f"{where}: its model does not match model ({cfg.preset or 'this run'}): "
                             f"{'; '.join(differ)}. Use the preset the export was trained with")
        model.load_state_dict(source.state_dict(), strict=True)
    else:
        generator = torch.Generator().manual_seed(cfg.train.seed)
        model.init_weights(generator)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.lm_loss_kernel = use_softmax_kernel(cfg.train.lm_loss_softmax, device)
    model.set_recast_expert_weights(cfg.train.recast_expert_weights)
    model = model.to(device)
    model.use_expert_weight_casts(cfg.train)  # before the optimizer: it looks the copies up
    if cfg.train.compile:
        model.compile_blocks(cfg.train.compile_mode)
    return model


def check_data_matches_model(cfg: RunConfig, data_dir: Path) -> None:
    manifest = load_manifest(data_dir)
    if manifest.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({manifest.vocab_size}, {data_dir}/manifest.json): the data cannot be embedded")


class Trainer:
    def __init__(self, cfg: RunConfig, data_dir: str | Path, run_dir: str | Path,
                 writer: MetricsSink | None = None, progress: bool = True, device: DeviceInfo | None = None,
                 mesh: Mesh | None = None):
        self.cfg, self.data_dir, self.run_dir = cfg, Path(data_dir), Path(run_dir)
        self.device_info = device or device_info(cfg.train.device)
        self.device = torch.device(self.device_info.type)
        # With several ranks every rank trains, global rank 0 alone records (store, checkpoints).
        self.mesh = mesh or Mesh.single(self.device)
        self.is_lead = self.mesh.rank == 0
        self.writer, self.progress = (writer, progress) if self.is_lead else (None, False)
        check_data_matches_model(cfg, self.data_dir)
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg, self.device)  # the same full model on every rank (same seed)
        if self.mesh.distributed:
            # float32 expert gradients there (the sharded optimizer's buffers); "bfloat16" raises
            use_bf16_expert_grads(self.model, cfg.train, cfg.optim, self.device, ranks=self.mesh.world_size)
            self.model = parallelize(self.model, self.mesh)
            self.optimizer = ShardedAdamW(self.model, self.mesh, cfg.optim, mode=cfg.parallel.optimizer,
                                         overlap=cfg.parallel.overlap_grad_sync,
                                         chunk_mb=cfg.parallel.grad_sync_chunk_mb)
        else:
            self.optimizer = build_optimizer(self.model, cfg.optim, cfg.train)
        dataset = TokenDataset(self.data_dir, split="train", seq_len=cfg.data.seq_len)
        self.loader = BatchLoader(dataset, cfg.train.global_batch, seed=cfg.data.seed,
                                  rank=self.mesh.rank, world_size=self.mesh.world_size)
        self.step = 0
        self.last_loss = float("nan")
        self.events: list[dict] = []  # faults handled while running (skips, rollbacks)
        self.resumed_from = self._resume()
        self.flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)

    def attach_writer(self, writer: MetricsSink | None) -> None:
        """Record into ``writer`` from now on (global rank 0 only, like the constructor's)."""
        self.writer = writer if self.is_lead else None

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> int | None:
        found = ckpt.latest_valid(self.run_dir)
        if found is None:
            return None
        self._load(found)
        return found.step

    def _load(self, found: ckpt.Checkpoint) -> None:
        settle_updates(self.optimizer)  # no update may still be writing what is loaded over
        saved = found.meta.get("config")
        if saved is not None and saved["model"] != self.cfg.model.to_dict():
            raise ValueError(f"{found.path} was saved by a different model configuration; "
                             f"use a new run directory or the same preset")
        if found.sharded and not self.mesh.distributed:  # a run of N ranks continues on one process
            self.model.load_state_dict(found.load_model_state(self.device))
            ckpt.load_plain_optimizer(found.path, self.model, self.optimizer)
        elif found.sharded:  # any layout: each rank reads its own pieces of the layout-free keys
            target = {**ckpt.sharded_model_state(self.model, self.mesh), **self.optimizer.state_dict(sharded=True)}
            ckpt.load_sharded(found.path, target)
            self.model.load_state_dict(ckpt.local_model_state(target))
            self.optimizer.load_state_dict({k: v for k, v in target.items() if not k.startswith(ckpt.MODEL)})
        else:
            self.model.load_state_dict(found.load_model_state(self.device))
            self.optimizer.load_state_dict(found.load_optim_state(self.device))
        state = found.load_state()
        self.loader.load_state_dict(state["loader"])
        per_rank = state.get("rng_per_rank")  # every rank's own; rank 0's on another world size
        rng = per_rank[self.mesh.rank] if per_rank and len(per_rank) == self.mesh.world_size else state
        torch.set_rng_state(rng["torch_rng"])
        if rng.get("device_rng") is not None and self.device.type in ("cuda", "xpu"):
            getattr(torch, self.device.type).set_rng_state(rng["device_rng"], self.device)
        self.step = found.step

    def _roll_back(self, bad_steps: int) -> None:
        """Back to the newest checkpoint, keeping the data position: the window since is skipped."""
        self.publish_checkpoint()
        found = ckpt.latest_valid(self.run_dir)
        if found is None:
            raise RuntimeError(f"{bad_steps} bad losses in a row at step {self.step} and no checkpoint to "
                               f"roll back to (set train.checkpoint_every)")
        position = self.loader.state_dict()
        self._load(found)
        self.loader.load_state_dict(position)

    def _event(self, **event: Any) -> None:
        """A fault handled while running: kept in the run's store attrs (``events``) and printed."""
        self.events.append(event)
        if self.writer is not None:
            self.writer.update_attrs(events=self.events)
        if self.is_lead:
            tqdm.write(f"[{self.cfg.preset or 'train'}] {event}")

    def _stop_agreed(self, stop: StopRequest) -> bool:
        """A stop signal may reach only some ranks: stop when any rank got one."""
        if not self.mesh.distributed:
            return stop.requested
        flag = torch.tensor([float(stop.requested)], device=self.device)
        return bool(self.mesh.all_reduce_sum_(flag).item() > 0)

    def save(self) -> Path | None:
        """Write a checkpoint (a collective when distributed: every rank calls it).

        One process: one file per part (model, optimizer, state). Several ranks: every rank
        writes its own shards at once (torch.distributed.checkpoint), rank 0 the small rest, so
        nothing is gathered and the checkpoint loads on another number of ranks or ep.
        """
        settle_updates(self.optimizer)  # the weights and state saved are those after the last update
        rng = {"torch_rng": torch.get_rng_state(),
               "device_rng": (getattr(torch, self.device.type).get_rng_state(self.device)
                              if self.device.type in ("cuda", "xpu") else None)}
        per_rank = [rng]
        if self.mesh.distributed:
            per_rank = [None] * self.mesh.world_size
            torch.distributed.all_gather_object(per_rank, rng)
        state = {"loader": self.loader.state_dict(), **rng, "rng_per_rank": per_rank}
        meta = {"config": self.cfg.to_dict(), "tokens": self.tokens, "data_position": self.loader.state_dict(),
                "world_size": self.mesh.world_size, "ep": self.mesh.ep}
        if self.is_lead and self.writer is not None:
            self.writer.flush()  # metrics up to a checkpoint survive a kill, as the weights do
        keep = {"keep": self.cfg.train.keep_checkpoints, "keep_every": self.cfg.train.keep_every}
        self.publish_checkpoint()  # one background write at a time
        # The last checkpoint of a run is written in the foreground: the run's outputs follow it.
        background = self.cfg.train.async_checkpoint and self.step < self.cfg.train.steps
        if self.mesh.distributed:
            sharded = {**ckpt.sharded_model_state(self.model, self.mesh), **self.optimizer.state_dict(sharded=True)}
            path = ckpt.save_sharded_checkpoint(self.run_dir, self.step, sharded_state=sharded, state=state, meta=meta,
                                                rank=self.mesh.rank, process_group=ckpt.checkpoint_group(
                                                    self.mesh, timedelta(seconds=self.cfg.parallel.collective_timeout_s)),
                                                asynchronous=background, **keep)
        elif background:
            path = ckpt.save_checkpoint_async(self.run_dir, self.step, model_state=self.model.state_dict(),
                                              optim_state=self.optimizer.state_dict(), state=state, meta=meta, **keep)
        else:
            return ckpt.save_checkpoint(self.run_dir, self.step, model_state=self.model.state_dict(),
                                        optim_state=self.optimizer.state_dict(), state=state, meta=meta, **keep)
        if isinstance(path, ckpt.PendingSave):
            self._pending_save = path
            return None
        torch.distributed.barrier()  # nobody reads or resumes before rank 0 has published it
        return path

    def publish_checkpoint(self) -> Path | None:
        """Finish a background checkpoint write, if one is under way (every rank calls it)."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        if pending is None:
            return None
        path = pending.wait()
        if self.mesh.distributed:
            torch.distributed.barrier()
        return path

    @property
    def tokens(self) -> int:
        return self.step * self.cfg.tokens_per_step

    # ------------------------------------------------------------------ hooks around the step
    def evaluate(self) -> dict[str, float]:
        settle_updates(self.optimizer)  # (each stage's forward would wait for its own; all at once here)
        t = self.cfg.train
        row = heldout_metrics(self.model, self.data_dir, seq_len=self.cfg.data.seq_len,
                              batch_size=self.cfg.train.micro_batch or t.global_batch,
                              max_batches=t.eval_batches, dtype=t.dtype, device=self.device)
        self._log("eval", {"step": self.step, "tokens": self.tokens, **row})
        return row

    def _log(self, table: str, row: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.log(table, row, dims={"expert_load": ("layer", "expert")} if "expert_load" in row else None)

    def _train_row(self, stats, lr: float, step_time: float) -> dict[str, Any]:
        tokens_per_s = self.cfg.tokens_per_step / step_time
        peak = self.device_info.peak_flops
        row = {"step": self.step, "tokens": self.tokens, "loss": stats.loss, "aux_loss": stats.aux_loss,
               "lb_loss": stats.lb_loss, "z_loss": stats.z_loss, "lr": lr, "grad_norm": float(stats.grad_norm),
               "tokens_per_s": tokens_per_s, "step_time_s": step_time,
               "mfu": self.flops_per_token * tokens_per_s / peak if peak else float("nan")}
        if stats.tokens_per_expert_LE is not None:
            load_LE = stats.tokens_per_expert_LE.float()
            share_LE = load_LE / load_LE.sum(-1, keepdim=True).clamp_min(1)
            row["expert_load"] = share_LE.cpu().numpy()
            row["moe_imbalance"] = float((load_LE.max(-1).values / load_LE.mean(-1).clamp_min(1e-9)).mean())
        return row

    def _should(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainSummary:
        t = self.cfg.train
        start = time.perf_counter()
        if self.resumed_from is None:
            self.evaluate()  # the step-0 point of every held-out curve
        if self.writer is not None:
            self.writer.update_attrs(resumed_from=self.resumed_from)
        step_times: list[float] = []
        guard = LossGuard(t.loss_spike_factor, t.max_bad_steps)
        bar = tqdm(total=t.steps, initial=self.step, desc=self.cfg.preset or "train", unit="step",
                   disable=not self.progress, dynamic_ncols=True)
        # A stuck rank (a hung collective, a dead file system) ends the process with a clear
        # message instead of hanging the job: optimus_core.train.watchdog. A checkpoint written
        # in the background (train.async_checkpoint) is published however the loop ends.
        with StopRequest() as stop, Watchdog(t.watchdog_timeout_s, self.mesh.rank).start(self.step) as watchdog, \
                ckpt.finished_on_exit(self.publish_checkpoint):
            while self.step < t.steps:
                self._one_step(guard, step_times, bar)
                watchdog.beat(self.step)
                if self._stop_agreed(stop):
                    self.save()
                    bar.close()
                    raise Preempted(self.step, stop.signal_name or "a signal on another rank")
            bar.close()
            final_eval = self.evaluate()
            self.save()
        if self.writer is not None:
            self.writer.flush()
        median = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
        return TrainSummary(self.step, self.tokens, self.resumed_from, self.last_loss, final_eval,
                            self.cfg.tokens_per_step / median if step_times else float("nan"),
                            time.perf_counter() - start)

    def _one_step(self, guard: LossGuard, step_times: list[float], bar) -> None:
        """One batch: an update, or a rejected loss (skipped, perhaps rolled back); then the hooks."""
        t = self.cfg.train
        t0 = time.perf_counter()
        batch = self.loader.next_batch().to(self.device, non_blocking=True)
        lr = lr_at(self.step, t.steps, self.cfg.optim.lr, self.cfg.schedule)
        stats = train_step(self.model, self.optimizer, batch, micro_batch=t.micro_batch,
                           grad_clip=self.cfg.optim.grad_clip, lr=lr, dtype=t.dtype, mesh=self.mesh,
                           accept=guard.accept, fused_lm_loss=t.fused_lm_loss)
        if stats.skipped:
            self._event(kind=guard.judge(stats.loss), step=self.step + 1, loss=stats.loss)
            if guard.should_roll_back:
                bad, at = guard.consecutive_bad, self.step
                self._roll_back(bad)
                guard.reset()
                bar.reset(total=t.steps)
                bar.update(self.step)
                self._event(kind="rollback", step=at, to_step=self.step, bad_steps=bad)
            return
        self.step += 1
        step_time = time.perf_counter() - t0
        step_times.append(step_time)
        self.last_loss = stats.loss
        if self._should(t.log_every) or self.step == t.steps:
            self._log("train", self._train_row(stats, lr, step_time))
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{self.cfg.tokens_per_step / step_time:,.0f}")
        if self._should(t.eval_every) and self.step < t.steps:
            self.evaluate()
        if self._should(t.checkpoint_every) and self.step < t.steps:
            self.save()
