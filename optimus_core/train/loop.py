"""The training loop: build, resume, then step / evaluate / checkpoint / log until done.

    from optimus_core.train.loop import Trainer
    summary = Trainer(cfg, data_dir="results/data/tokens", run_dir="results/runs/x", writer=w).fit()

The step itself lives in optimus_core.train.step; this module only arranges what happens around
it. A run directory that holds a valid checkpoint is resumed from it, with no flag.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from ..config import ConfigError, RunConfig
from ..data import TokenDataset, training_loader
from ..data.identity import check_tokenizer, refuse_other_tokenizer, trained_tokenizer
from ..device import DeviceInfo, device_info
from ..log import get_logger
from ..model.transformer import Transformer
from ..execution import plan_execution
from ..execution.weight_copies import expert_copies, refresh_copies
from ..parallel import Mesh
from ..parallel.pipeline import Pipeline
from . import checkpoint as ckpt
from . import disk_space, node_faults
from .build import build_model, build_run_optimizer
from .evaluate import heldout_metrics
from .resilience import Diverged, LossGuard, Preempted, StopRequest, describe_event
from .schedule import decay_end, lr_at
from .staging import HostStaging
from .step import autocast_context, clip_at, pipeline_train_step, train_step
from .update_stream import settle_updates
from .watchdog import Watchdog

_log = get_logger(__name__)


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


def check_data_matches_model(cfg: RunConfig, data_dir: Path) -> str:
    """Refuse data the model cannot embed, or whose tokenizer.json is not the one it was
    tokenized with; returns the tokenizer's sha256 (what the checkpoints record)."""
    manifest = check_tokenizer(data_dir, None, "this run")
    if manifest.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({manifest.vocab_size}, {data_dir}/manifest.json): the data cannot be embedded")
    return manifest.tokenizer_sha256


class Trainer:
    def __init__(self, cfg: RunConfig, data_dir: str | Path, run_dir: str | Path,
                 writer: MetricsSink | None = None, progress: bool = True, device: DeviceInfo | None = None,
                 mesh: Mesh | None = None, start_over: bool = False, uid: str | None = None):
        self.cfg, self.data_dir, self.run_dir = cfg, Path(data_dir), Path(run_dir)
        # the run's identity (stages.pretrain draws it when a run starts, the same on every rank):
        # written into every checkpoint, and a checkpoint of another uid is never resumed
        self.uid = uid
        self.start_over = start_over  # checkpoints that are all invalid are set aside, not an error
        self.device_info = device or device_info(cfg.train.device)
        self.device = torch.device(self.device_info.type)
        # With several ranks every rank trains, global rank 0 alone records (store, checkpoints).
        self.mesh = mesh or Mesh.single(self.device)
        self.is_lead = self.mesh.rank == 0
        self.writer, self.progress = (writer, progress) if self.is_lead else (None, False)
        self.tokenizer_sha256 = check_data_matches_model(cfg, self.data_dir)
        torch.manual_seed(cfg.train.seed)
        # The data before anything is allocated: too little of it, a missing or truncated held-out
        # file (opened now, not at the first evaluation; each evaluation maps its source's again)
        # or a decay horizon within the warmup stops the run before it builds or writes anything.
        # (every stage of a pipeline reads its data rank's sequences: the first its tokens, the
        # last its targets)
        self.loader = training_loader(self.data_dir, cfg.data, cfg.train.global_batch,
                                      rank=self.mesh.data_rank, world_size=self.mesh.data_world)
        TokenDataset(self.data_dir, split="val", seq_len=cfg.data.seq_len)
        # the step at which the lr reaches its floor: the run's, an epoch of this data's, or given
        self.decay_end = decay_end(cfg.schedule, cfg.train.steps, self.loader.epoch_steps)
        # every choice of how the run executes, resolved once and checked against the device's
        # memory before anything is allocated (ExecutionError, MemoryBudgetError: what to change)
        self.plan = plan_execution(cfg, self.device, self.mesh.world_size, ranks_per_node=self.mesh.local_world)
        _log.info("%s: execution plan on %d x %s:\n%s", cfg.preset or "train", self.mesh.world_size,
                  self.device.type, self.plan.describe())
        for warning in self.plan.warnings:  # also in meta.json and the store (ExecutionPlan.to_dict)
            _log.warning("%s: %s", cfg.preset or "train", warning)
        # this rank's share of the model, never the whole of it (optimus_core.train.build)
        self.model: Transformer = build_model(cfg, self.mesh, plan=self.plan)
        self.optimizer = build_run_optimizer(self.model, cfg, self.mesh, self.plan)
        # with pipeline stages: this rank's stage and its schedule (optimus_core.parallel.pipeline)
        self.pipeline = self._pipeline() if self.mesh.pp > 1 else None
        self.step = 0
        self.last_loss = float("nan")
        self.events: list[dict] = []  # faults handled while running (skips, rollbacks)
        # judges each loss; its window is part of every checkpoint, so a resumed run decides as the
        # uninterrupted one would
        self.guard = LossGuard(cfg.train.loss_spike_factor, cfg.train.max_bad_steps)
        self._watchdog = Watchdog(0)  # fit's while it runs: saves, loads and evaluations are its phases
        # checkpoints are written from pinned host copies kept from save to save (train/staging.py):
        # the first save pins this rank's part, every later one only copies into it
        self._staging = HostStaging()
        self.resumed_from = self._resume()
        self.flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)

    def _pipeline(self) -> Pipeline:
        cfg, plan = self.cfg, self.plan
        local = cfg.train.global_batch // self.mesh.data_world
        micro = cfg.train.micro_batch or local
        if local % micro:
            raise ConfigError(f"train.micro_batch = {micro}: must divide each data rank's {local} sequences a step "
                              f"(train.global_batch {cfg.train.global_batch} over {self.mesh.data_world} data ranks)")
        return Pipeline(self.model, self.mesh.stage, cfg.parallel, micro_batches=local // micro,
                        act_dtype=getattr(torch, plan.residual_dtype),
                        autocast=lambda: autocast_context(self.device.type, plan.dtype))

    def attach_writer(self, writer: MetricsSink | None) -> None:
        """Record into ``writer`` from now on (global rank 0 only, like the constructor's)."""
        self.writer = writer if self.is_lead else None

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> int | None:
        """Load the newest valid checkpoint, if there is one. The newer ones that failed are set
        aside first (checkpoints/invalid/), so that pruning never keeps them in place of a valid
        one; if checkpoints exist but none is valid the run stops, unless ``start_over``."""
        found = self._latest_valid()
        if found is not None and found.meta.get("uid") not in (None, self.uid):  # before anything moves
            raise FileExistsError(f"{found.path} is a checkpoint of another run (uid {found.meta['uid']}), not of the "
                                  f"run in {self.run_dir}: its checkpoints directory is another run's (a link or a "
                                  f"copy?); nothing was resumed, moved or pruned: use another --out")
        mine = max((int(ckpt.STEP_DIR.match(p.name).group(1)) for p in ckpt.list_step_dirs(self.run_dir)), default=-1)
        newest = int(self.mesh.all_max([float(mine)])[0])  # every rank takes the same branches below
        newest = None if newest < 0 else newest
        if found is None and newest is not None and not self.start_over:
            raise ValueError(f"{ckpt.checkpoints_dir(self.run_dir)} holds checkpoints up to step {newest} and none "
                             f"is valid (the warnings above say why): pass --start-over to set them aside and "
                             f"train from step 0, or use another --out")
        if newest is not None and (found is None or newest > found.step):
            if self.is_lead:
                for path in ckpt.set_aside(self.run_dir, found.step if found else -1):
                    _log.warning("set the invalid checkpoint %s aside (delete it once you have no use for it)",
                                 path)
            self.mesh.barrier()  # no rank lists the step directories while they move
        if found is None:
            return None
        self._load(found)
        return found.step

    def _latest_valid(self) -> ckpt.Checkpoint | None:
        """The newest checkpoint every rank found its share of valid (a collective)."""
        return ckpt.latest_valid(self.run_dir, (self.mesh.rank, self.mesh.world_size), self.mesh.all_max)

    def _load(self, found: ckpt.Checkpoint) -> None:
        settle_updates(self.optimizer)  # no update may still be writing what is loaded over
        saved = found.meta.get("config")
        # the model's shape, read as today's config reads it: how the saved run executed (its
        # kernels, its precision) may differ from this one's
        if saved is not None and RunConfig.from_json(json.dumps(saved)).model != self.cfg.model:
            raise ValueError(f"{found.path} was saved by a different model configuration; "
                             f"use a new run directory or the same preset")
        # the data's tokenizer file was hashed when the Trainer was made: compare, do not hash again
        refuse_other_tokenizer(self.data_dir, self.tokenizer_sha256, trained_tokenizer(found.meta),
                               f"checkpoint {found.path}")
        # any layout: each rank reads the rows it holds
        tensors = ckpt.training_tensors(self.model, self.optimizer, self.mesh)
        ckpt.load_tensors_(found, tensors, self.mesh.distributed)
        ckpt.restore_rng(tensors, self.mesh)
        refresh_copies(expert_copies(self.model))  # written in place, past the load hook
        state = found.load_state()
        self.loader.load_state_dict(state["loader"])
        if "guard" in state:  # a checkpoint without it leaves the guard as it starts
            self.guard.load_state_dict(state["guard"])
        self.step = found.step

    def _roll_back(self, bad_steps: int) -> None:
        """Back to the newest checkpoint, keeping the data position: the window since is skipped."""
        self.publish_checkpoint()
        found = self._latest_valid()
        if found is None:
            raise Diverged(f"{bad_steps} bad losses in a row at step {self.step} and no checkpoint to roll back to: "
                           f"lower optim.lr, or checkpoint sooner (train.checkpoint_every)")
        last = getattr(self, "_last_rollback", None)  # (from step, to step) of the previous rollback
        if last is not None and found.step == last[1] and self.step <= last[0]:
            raise Diverged(f"{bad_steps} bad losses in a row at step {self.step}, again after a rollback to the "
                           f"checkpoint of step {found.step}: it leads back to the same failure, so training stops "
                           f"(lower optim.lr, or check the data after step {found.step})")
        self._last_rollback = (self.step, found.step)
        position = self.loader.state_dict()
        with self._io_phase(f"checkpoint load of step {found.step}"):
            self._load(found)
        self.loader.load_state_dict(position)

    def _stop_on_node_fault(self, stats) -> None:
        """The world's loss is not finite: if only some ranks' are, their hosts are named in the
        run directory and every rank stops with NodeFault (optimus_core.train.node_faults)."""
        hosts = node_faults.suspect_hosts(self.mesh, stats.local_sums)
        if not hosts:
            return
        path = self.run_dir / node_faults.FAULTS_FILE
        if self.is_lead:
            node_faults.record(self.run_dir, self.step + 1, hosts)
        self._event(kind="node_fault", step=self.step + 1, hosts=hosts)
        raise node_faults.NodeFault(self.step + 1, hosts, path)

    def _previous_norm_nonfinite(self) -> bool:
        """Whether the last update's gradient norm (the same on every rank) was not finite."""
        norm, self._last_norm = getattr(self, "_last_norm", None), None
        return norm is not None and not math.isfinite(float(norm))

    def _event(self, **event: Any) -> None:
        """A fault handled while running: kept in the run's store attrs (``events``) and printed."""
        self.events.append(event)
        if self.writer is not None:
            self.writer.update_attrs(events=self.events)
        _log.warning("%s: %s", self.cfg.preset or "train", describe_event(event))

    def _agree(self, stop: StopRequest) -> tuple[str | None, bool]:
        """(the stop signal or None, checkpoint now), the same on every rank: a stop signal may
        reach only some ranks, and the clocks that say train.checkpoint_every_minutes have passed
        differ by a little; either is acted on when any rank says so, and a SIGINT anywhere makes
        every rank's stop an interrupt (one all-reduce of three flags a step)."""
        minutes = self.cfg.train.checkpoint_every_minutes
        due = bool(minutes) and time.monotonic() - self._last_save_time >= 60 * minutes
        if not self.mesh.distributed:
            return stop.signal_name, due
        flags = torch.tensor([float(stop.requested), float(due), float(stop.signal_name == "SIGINT")],
                             device=self.device)
        stop_any, due_any, interrupt_any = (self.mesh.all_reduce_sum_(flags) > 0).tolist()
        if not stop_any:
            return None, due_any
        return ("SIGINT" if interrupt_any else stop.signal_name or "a signal on another rank"), due_any

    def _io_phase(self, what: str):
        """A watchdog phase with train.watchdog_io_timeout_s: a long save, load or evaluation is
        not a hang, a stalled one still is (optimus_core.train.watchdog)."""
        return self._watchdog.phase(what, self.cfg.train.watchdog_io_timeout_s)

    def save(self) -> Path | None:
        """Write a checkpoint (a collective when distributed: every rank calls it).

        Every rank writes the rows it holds at once (torch.distributed.checkpoint), rank 0 the
        small rest; nothing is gathered or cloned, and the checkpoint loads on any other number
        of ranks, EP degree or one process (optimus_core.train.checkpoint).
        """
        with self._io_phase(f"checkpoint save of step {self.step}"):
            return self._save()

    def _save(self) -> Path | None:
        self._last_save_time = time.monotonic()  # the minutes of train.checkpoint_every_minutes restart
        settle_updates(self.optimizer)  # the weights and state saved are those after the last update
        state = {"loader": self.loader.state_dict(), "guard": self.guard.state_dict()}
        meta = {**self._checkpoint_meta(), "execution_plan": self.plan.to_dict(),
                "data_position": self.loader.state_dict()}
        if self.is_lead and self.writer is not None:
            self.writer.flush()  # metrics up to a checkpoint survive a kill, as the weights do
        self.publish_checkpoint()  # one background write at a time
        # The last checkpoint of a run is written in the foreground: the run's outputs follow it.
        background = self.cfg.train.async_checkpoint and self.step < self.cfg.train.steps
        # The ranks write to one file system as a rule: each checks the whole checkpoint's bytes
        # (all ranks' parts, one all-reduce) against the space where it writes, before anything is
        # written, so a shortfall stops every rank with the same error, not a half-written save.
        tensors = ckpt.training_tensors(self.model, self.optimizer, self.mesh)
        if not self._finite(tensors):  # a rollback to it would only fail again
            self._event(kind="nonfinite_state", step=self.step)
            return None
        need = torch.tensor([float(disk_space.bytes_to_write(tensors))], dtype=torch.float64, device=self.device)
        total = int(self.mesh.all_reduce_sum_(need).item())
        short = disk_space.space_shortfall(ckpt.checkpoints_dir(self.run_dir), self.step, total, self.mesh.rank)
        if short is not None:
            raise disk_space.DiskFullError(short)
        # Background writes plan on a gloo group of their own, away from the training's collectives;
        # a foreground write plans on the default group, so a synchronous run (the default, and the
        # paper's) never makes a world-spanning gloo group: at 12288 ranks every rank would open a
        # connection to every other.
        group = None
        if self.mesh.distributed and self.cfg.train.async_checkpoint:
            group = ckpt.checkpoint_group(self.mesh, timedelta(seconds=self.cfg.parallel.collective_timeout_s))
        path = ckpt.save_checkpoint(self.run_dir, self.step, state=state, meta=meta, rank=self.mesh.rank,
                                    tensors=tensors, all_max=self.mesh.all_max, staging=self._staging,
                                    distributed=self.mesh.distributed, process_group=group, asynchronous=background,
                                    keep=self.cfg.train.keep_checkpoints, keep_every=self.cfg.train.keep_every,
                                    wave=self._write_wave())
        if isinstance(path, ckpt.PendingSave):
            self._pending_save = path
            return None
        self.mesh.barrier()  # nobody reads or resumes before rank 0 has published it
        return path

    def _finite(self, tensors: dict) -> bool:
        """Whether every floating tensor of a checkpoint's weights and optimizer state is finite on
        every rank (one all-reduce)."""
        bad = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, t in tensors.items():
            if name.startswith((ckpt.MODEL, ckpt.OPTIM)) and t.is_floating_point():
                local = t.to_local() if hasattr(t, "to_local") else t
                bad += (~torch.isfinite(local)).sum().to(bad.device, torch.float64)
        return self.mesh.all_reduce_sum_(bad.reshape(1)).item() == 0

    def save_model_only(self) -> Path | None:
        """Write a model-only checkpoint of this step (a collective): the weights, for evaluation,
        in run_dir/model_checkpoints/ (optimus_core.train.checkpoint, MODEL_ONLY), in the
        foreground; never one with non-finite weights."""
        with self._io_phase(f"model-only checkpoint save of step {self.step}"):
            settle_updates(self.optimizer)
            tensors = ckpt.model_tensors(self.model, self.mesh)
            if not self._finite(tensors):
                self._event(kind="nonfinite_state", step=self.step)
                return None
            self.publish_checkpoint()  # a background full save finishes first: one write at a time
            meta = {**self._checkpoint_meta(), "model_only": True}
            return ckpt.save_checkpoint(self.run_dir, self.step, tensors=tensors, state={}, meta=meta,
                                        rank=self.mesh.rank, distributed=self.mesh.distributed,
                                        all_max=self.mesh.all_max, kind=ckpt.MODEL_ONLY, wave=self._write_wave())

    def _checkpoint_meta(self) -> dict:
        """What every checkpoint's meta.json records of the run, full or model-only."""
        return {"config": self.cfg.to_dict(), "tokens": self.tokens, "world_size": self.mesh.world_size,
                "ep": self.mesh.ep, "pp": self.mesh.pp, "tokenizer_sha256": self.tokenizer_sha256, "uid": self.uid}

    def _write_wave(self) -> tuple[int, int]:
        """(this rank's wave, waves) of a checkpoint write: by data-parallel replica (rank order
        DP, PP, EP: a replica is the pp x ep ranks of a block), train.checkpoint_write_waves."""
        waves = min(self.cfg.train.checkpoint_write_waves, self.mesh.world_size // (self.mesh.pp * self.mesh.ep))
        return (self.mesh.rank // (self.mesh.pp * self.mesh.ep)) % waves, waves

    def publish_checkpoint(self) -> Path | None:
        """Finish a background checkpoint write, if one is under way (every rank calls it)."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        if pending is None:
            return None
        with self._io_phase("background checkpoint write"):
            path = pending.wait()
        if self.mesh.distributed:
            torch.distributed.barrier()
        return path

    @property
    def tokens(self) -> int:
        """Tokens seen: every batch drawn, the skipped and rolled-back ones included."""
        return self.loader.batches_drawn * self.cfg.tokens_per_step

    # ------------------------------------------------------------------ hooks around the step
    def evaluate(self) -> dict[str, float]:
        settle_updates(self.optimizer)  # (each stage's forward would wait for its own; all at once here)
        t = self.cfg.train
        with self._io_phase("evaluation"):
            row = heldout_metrics(self.model, self.data_dir, seq_len=self.cfg.data.seq_len,
                                  batch_size=self.cfg.train.micro_batch or t.global_batch,
                                  max_batches=t.eval_batches, dtype=self.plan.dtype, device=self.device,
                                  loss_sum=self.pipeline.loss_sum if self.pipeline else None)
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
        self._last_save_time = time.monotonic()  # a job's start counts as its last checkpoint
        guard = self.guard
        bar = tqdm(total=t.steps, initial=self.step, desc=self.cfg.preset or "train", unit="step",
                   disable=not self.progress, dynamic_ncols=True)
        # A stuck rank (a hung collective, a dead file system) ends the process with a clear
        # message instead of hanging the job: optimus_core.train.watchdog. A checkpoint written
        # in the background (train.async_checkpoint) is published however the loop ends.
        with StopRequest() as stop, Watchdog(t.watchdog_timeout_s, self.mesh.rank).start(self.step) as watchdog, \
                ckpt.finished_on_exit(self.publish_checkpoint):
            self._watchdog = watchdog
            while self.step < t.steps:
                self._one_step(guard, step_times, bar)
                watchdog.beat(self.step)
                stop_signal, save_now = self._agree(stop)
                if stop_signal:
                    self.save()
                    bar.close()
                    raise Preempted(self.step, stop_signal)
                if save_now and self.step < t.steps:
                    self.save()
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
        lr = lr_at(self.step, self.decay_end, self.cfg.optim.lr, self.cfg.schedule)
        if self.pipeline is not None:
            stats = pipeline_train_step(self.pipeline, self.optimizer, batch, grad_clip=clip_at(self.step, self.cfg),
                                        lr=lr, mesh=self.mesh, accept=guard.accept)
        else:
            stats = train_step(self.model, self.optimizer, batch, micro_batch=t.micro_batch,
                               grad_clip=clip_at(self.step, self.cfg), lr=lr, dtype=self.plan.dtype, mesh=self.mesh,
                               accept=guard.accept)
        if stats.skipped and guard.judge(stats.loss) == "nonfinite":
            self._stop_on_node_fault(stats)  # some ranks' losses only: their hosts, not the model
        poisoned = self._previous_norm_nonfinite()
        if stats.skipped or poisoned:
            if poisoned:  # the last update applied a non-finite gradient: the weights are lost
                self._event(kind="nonfinite_grad_norm", step=self.step, loss=stats.loss)
            else:
                self._event(kind=guard.judge(stats.loss), step=self.step + 1, loss=stats.loss)
            if poisoned or guard.should_roll_back:
                bad, at = max(guard.consecutive_bad, 1), self.step
                self._roll_back(bad)
                guard.reset()
                bar.reset(total=t.steps)
                bar.update(self.step)
                self._event(kind="rollback", step=at, to_step=self.step, bad_steps=bad)
            return
        self.step += 1
        self._last_norm = stats.grad_norm  # read at the next step's loss, when it is long done
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
        if self._should(t.model_checkpoint_every):
            self.save_model_only()
