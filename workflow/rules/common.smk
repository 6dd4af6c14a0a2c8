# Shared names. The runs come from the registry (workflow/experiments.py), never from here.
import re
import sys
from pathlib import Path

from stages.figures import FIGURE_READS, FIGURES as FIGURE_FILES
from workflow.experiments import dag, scaleup, scaleup_figure

SCALE = config["scale"]
RES = config["results"]
STORE = f"{RES}/store.zarr"
CORPUS = f"{RES}/data/corpus"
TOKENS = f"{RES}/data/tokens"
# Every run the DAG trains at this scale (laptop: the cheap ones; paper: all of them).
PRETRAIN_RUNS = {e.run_id(SCALE): e for e in dag(SCALE)}
EVAL_RUNS = [run for run, e in PRETRAIN_RUNS.items() if e.kind == "pretrain"]  # scaling/ablation: timed only
TIMED_RUNS = [run for run, e in PRETRAIN_RUNS.items() if e.kind != "pretrain"]
ABLATION_RUNS = [run for run, e in PRETRAIN_RUNS.items() if e.kind == "ablation"]
# The paper's window orders the runs read (data.order file_windows), each drawn once into a file
# beside the tokens (`optimus window-order`) where the config says so (window_order_files: the
# paper's ~2e9 windows would cost every rank ~15 GiB and minutes drawn in memory): (seq_len, seed)
WINDOW_ORDERS = sorted({(c.data.seq_len, c.data.seed) for c in (e.scale(SCALE).run_config() for e in dag(SCALE))
                        if c.data.order == "file_windows"}) if config.get("window_order_files") else []
WINDOW_ORDER_MARKERS = [f"{RES}/data/window-order-s{s}-seed{seed}.done" for s, seed in WINDOW_ORDERS]
# The site's shared compile cache (site.compile_cache), filled once by a one-node warm-up job
# before the training jobs, each of which starts from a copy of it on its nodes (data.smk)
COMPILE_CACHE_MARKERS = ([f"{RES}/compile-cache.done"]
                         if config.get("launcher") == "parsl" and (config.get("site") or {}).get("compile_cache") else [])
# The paper's downstream evaluation (downstream_tasks: its nine lm-eval tasks) of every model-only
# checkpoint, one process a tile (lm-eval needs the whole model): the pretraining runs whose
# bf16 weights fit a tile's budget (downstream_max_gib); the task data cached once on the node
# that runs Snakemake (`optimus task-data`), which the jobs read offline
DOWNSTREAM_TASKS = config.get("downstream_tasks") or []
DOWNSTREAM_RUNS, DOWNSTREAM_TOO_LARGE = [], []
for _run in EVAL_RUNS if DOWNSTREAM_TASKS else []:
    _gib = 2 * PRETRAIN_RUNS[_run].scale(SCALE).run_config().model.num_params() / 2**30
    (DOWNSTREAM_RUNS if _gib <= config.get("downstream_max_gib", float("inf")) else DOWNSTREAM_TOO_LARGE).append(
        (_run, _gib))
if DOWNSTREAM_TOO_LARGE:
    print("downstream tasks not run on " + ", ".join(f"{r} ({g:,.0f} GiB of bf16 weights)" for r, g in DOWNSTREAM_TOO_LARGE)
          + f": over one tile's {config.get('downstream_max_gib')} GiB (lm-eval runs the model whole, in one process)",
          file=sys.stderr)
DOWNSTREAM_RUNS = [r for r, _ in DOWNSTREAM_RUNS]
TASK_DATA_MARKERS = [f"{RES}/task-data.done"] if DOWNSTREAM_TASKS else []
# The paper's scale-up runs (evaluated with `scaleup_eval` where the config sets it), and the runs
# scaleup.png draws: the MoE pretraining runs, the scale-up runs and their reference.
SCALEUP_RUNS = [e.run_id(SCALE) for e in scaleup() if e.run_id(SCALE) in PRETRAIN_RUNS]
SCALEUP_FIGURE_RUNS = [e.run_id(SCALE) for e in scaleup_figure(SCALE)]
FIGURES = [f"{RES}/figures/{name}" for name in FIGURE_FILES]  # one `figure` job each (report.smk)
# Reference models' published scores (stages/reference.py), by file stem
REFERENCES = {Path(f).stem: f for f in config.get("references", [])}
REFERENCE_MARKERS = [f"{RES}/reference/{stem}.ingested" for stem in REFERENCES]
REPORT = f"{RES}/report.md"
# A value the site's config leaves as a placeholder is planned with, and said before anything runs
for key, value in config.items():
    if isinstance(value, str) and "CHANGE_ME" in value:
        print(f"config {key} = {value}: a placeholder; set it to your project's path before running for real",
              file=sys.stderr)

# Where training runs: here, or (launcher: parsl) through the Parsl site of the config's site:
# block. The site plans every job now, at parse time, so a missing account, a queue too small
# or a walltime over its limit stops `snakemake -n` before anything is submitted.
LAUNCH = ""
if config.get("launcher", "local") == "parsl":
    from workflow.plan import plan_table
    from workflow.sites import site_from_dict

    if not config.get("site"):
        raise ValueError("launcher = 'parsl': the config needs a site: block (see workflow/config/aurora.yaml)")
    SITE = site_from_dict(config["site"])
    LAUNCH = f"--launcher parsl --site {SITE.name}"
    print(f"Job plan ({SCALE} scale, site {SITE.name}):\n" + plan_table(dag(SCALE), SITE)[0], file=sys.stderr)

# The store is shared by every run (one group each, one writer per group), so it is not a
# declared file: each stage declares a marker it writes last (summary.json, eval.json).
wildcard_constraints:
    run="[A-Za-z0-9_.@-]+",
    figure="|".join(re.escape(name) for name in FIGURE_FILES),
    reference="[A-Za-z0-9_.-]+",
