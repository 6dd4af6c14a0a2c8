"""A first-principles performance model of one training step, calibrated on measured points.

    from workflow import perfmodel as pm
    machine = pm.load_machine("aurora")                 # workflow/machines/aurora.yaml
    cfg = presets.get("mula-220b-a10b").model
    pred = pm.predict(cfg, pm.Layout(devices=384, ep=12, global_batch=12288, micro_batch=1,
                                     seq_len=2048, dtype="bfloat16"), machine)
    pred.step_s, pred.compute_s, pred.a2a_s, pred.grad_sync_s, pred.optimizer_s, pred.idle_s
    fitted = pm.calibrate(points, pm.load_machine("cpu"))    # points: the lead's measured dicts
    pm.holdout_error(points, pm.load_machine("cpu"))         # error on points not fitted

What one step does (optimus_core/train/step.py and sharded_adamw.py, optimus_core/parallel/
{expert_parallel,dispatch,sharding}.py), and therefore what this package adds up, per rank:

1. compute: forward + backward of ``global_batch / devices`` sequences in micro-batches:
   ``ModelConfig.flops_per_token(seq_len)`` FLOPs per token (optimus_core/flops.py), plus the
   forward the backward repeats under activation checkpointing (``Layout.checkpointing``,
   ``recompute_flops_per_token``: resolved as the run resolves it on the machine's memory), at the
   device's measured matmul rate times an achieved fraction (``compute_efficiency``), plus a
   fixed host overhead per micro-batch (Python, kernel launches: what dominates tiny models),
   per local expert with the ``loop`` backend, and with EP the dispatch's own memory passes
   over the rows it sends and receives (``overhead.dispatch``).
2. all-to-all: per MoE layer and micro-batch, a counts exchange, then forward the rows (one per
   token and EP rank holding one of its experts: ``ranks_visited``), their routing metadata and
   the weighted partial outputs back, the same three reversed backward; of each buffer (ep-1)/ep
   leaves the rank.
3. gradient sync. Full sharding (what the code does, ``overlap = "layers"``; optimus_core/
   parallel/sharding.py): per micro-batch every unit (a block's dense part; its experts, over the
   expert-dp group, when ep > 1; the embedding; the root: final norm + LM head) is all-gathered
   in the gather dtype before its forward and again before its backward, and its gradient
   reduce-scattered after its backward, all on a side stream one unit ahead of the compute: what
   the compute of the other units cannot cover is exposed (``exposed_sync_s``, part of
   ``compute_s``: the passes wait for it, and that is where a measurement sees it); after the
   backward the step's two small all-reduces of losses and routing counts (grad_sync_s). The
   paper's baseline (``dp_sharded``) shards the dense units over the expert-dp groups and
   all-reduces their reduced shards over the EP groups. The ZeRO-1 optimizer of earlier measured points (``"none"`` /
   ``"chunks"``; gone from the code, its model stays for those points): dense grads
   reduce-scatter over the world then the updated shards all-gather back; expert grads over the
   expert-dp group: reduce-scatter + all-gather.
4. optimizer: the squared-grad-norm all-reduce, then AdamW on this rank's shard, memory-bound:
   bytes touched / memory bandwidth.
5. idle: a fixed per-step overhead (host work outside the phases above).

Overlap (``Layout.overlap``): ``"layers"``, the code's full sharding (above); for the ZeRO-1
points, ``"none"``, the plain sum of the phases, and ``"chunks"``: gradient chunks of
``chunk_mb`` reduced onto their owners while the last micro-batch's backward runs, so only what
that backward (2/3 of its compute) cannot cover shows, and at least the last chunk. The what-if
``"grad_sync"`` (WHATIFS) is full sharding with every unit's collectives hidden; it prices a
step we do not have, to show what that would buy. Measured points use what they ran (their
``sharding`` or ``overlap_grad_sync``), the paper sweep and node-hour estimates full sharding.

Rank skew (``overhead.skew``, calibrated): ranks do not finish their compute together, and the
first collective after it waits for the slowest -- an all-to-all inside each MoE layer with EP,
else the gradient sync. On a shared CPU box it is most of what the all-to-alls measure.

Collectives: time = latency x steps + bytes / bandwidth, with bandwidths in the bus-bandwidth
convention of nccl-tests (what workflow/machines/*.yaml record): a ring reduce-scatter or
all-gather of an S-byte buffer over n ranks moves (n-1)/n S per rank, an all-reduce 2 (n-1)/n S,
a pairwise all-to-all (n-1)/n S. Groups are laid out as optimus_core/parallel/mesh.py's
``group_layout`` does (EP groups consecutive ranks, expert-dp groups strided by ep), ranks are
packed onto nodes in order, and every group of a kind runs its collective at the same time, so
groups that leave a node share its NICs.

Where each part lives (every name is re-exported here: ``pm.<name>`` is the public API):
machine.py (Link, Machine, load_machine: the YAML's validation), step.py (Layout, Prediction,
the collectives, predict, the measured points' model and layout), calibration.py (the knobs,
calibrate, holdout_error), sweep.py (predict_sweep, paper_sweep, estimate_node_hours).

This package imports no torch: it runs on a login node and in the Snakemake dry run.
"""
# Private names re-exported as well: the tests call pm._apply, pm._collective_s and pm._expert_params.
from .calibration import (DEFAULT_FIT, FIELD_KNOBS, HOLDOUT_SCHEMES, KNOBS, TARGETS, _apply, calibrate, error_rows,
                          holdout_error, knob_values, split_points)
from .machine import DTYPES, KINDS, MACHINES_DIR, Link, Machine, load_machine, machine_from_dict
from .step import (ADAMW_BYTES_PER_ELEMENT, FLAT_GRAD_BYTES_PER_ELEMENT, MASTER_BYTES, OPTIMIZERS, OVERLAPS, PHASES,
                   WHATIFS, CHECKPOINTING, Layout, Prediction, _collective_s, _expert_params, point_checkpointing,
                   point_experts, point_layout, point_model, point_overlap, predict, predict_point, rank_groups,
                   ranks_visited, sharding_groups)
from .sweep import (code_overlap, efficiency, estimate_node_hours, paper_sweep, planned_run, predict_points,
                    predict_sweep)

__all__ = [
    # machine
    "MACHINES_DIR", "KINDS", "DTYPES", "Link", "Machine", "machine_from_dict", "load_machine",
    # step
    "OPTIMIZERS", "PHASES", "OVERLAPS", "WHATIFS", "ADAMW_BYTES_PER_ELEMENT", "FLAT_GRAD_BYTES_PER_ELEMENT",
    "MASTER_BYTES", "CHECKPOINTING", "Layout", "Prediction", "rank_groups", "ranks_visited", "predict",
    "sharding_groups", "point_model", "point_layout", "point_experts", "point_overlap", "point_checkpointing",
    "predict_point",
    # calibration
    "HOLDOUT_SCHEMES", "KNOBS", "DEFAULT_FIT", "TARGETS", "FIELD_KNOBS", "calibrate", "knob_values",
    "split_points", "holdout_error", "error_rows",
    # sweep
    "efficiency", "predict_sweep", "code_overlap", "planned_run", "paper_sweep",
    "estimate_node_hours",
    "predict_points",
]
