import shlex

# Longest first: the costliest runs (FLOPs of the whole run, workflow/experiments.py) start first,
# so on 2 cores the short scale-up runs fill in beside the 240-step 4T runs instead of after them.
PRETRAIN_RANK = {run: rank for rank, run in enumerate(sorted(PRETRAIN_RUNS, key=lambda r: PRETRAIN_RUNS[r].scale(SCALE).flops()), 1)}


rule pretrain:
    input:
        data=TOKENS,
        orders=WINDOW_ORDER_MARKERS,
        compile_cache=COMPILE_CACHE_MARKERS,
    output:
        f"{RES}/runs/{{run}}/summary.json",
    params:
        experiment=lambda wc: PRETRAIN_RUNS[wc.run].name,
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
        overrides=" ".join(f"--set {shlex.quote(kv)}" for kv in config.get("pretrain_set", [])),
    threads: config["train_threads"]
    priority: lambda wc: PRETRAIN_RANK[wc.run]
    log:
        f"{RES}/logs/pretrain-{{run}}.log",
    shell:
        "OMP_NUM_THREADS={threads} optimus pretrain --experiment {params.experiment} --scale " + SCALE
        + " --data {input.data} --out {params.run_dir} --run-id {wildcards.run} --store " + STORE
        + " --threads {threads} {params.overrides} " + LAUNCH + " 2>&1 | tee {log}"


def eval_flags(run):
    """--max-batches and --tasks of one run: eval_max_batches / eval_tasks, or for a scale-up run
    what `scaleup_eval` sets (held-out loss only at laptop scale: workflow/config/laptop.yaml);
    the downstream tasks on every kept checkpoint where eval_downstream_all_checkpoints says so
    (the paper evaluates every model-only checkpoint), except under scaleup_eval."""
    settings = {"max_batches": config["eval_max_batches"], "tasks": config.get("eval_tasks", ["heldout"])}
    scaleup_eval = run in SCALEUP_RUNS and config.get("scaleup_eval")
    if scaleup_eval:
        settings.update(scaleup_eval)
    every = config.get("eval_downstream_all_checkpoints") and not scaleup_eval
    return (f"--max-batches {settings['max_batches']} --tasks {' '.join(settings['tasks'])}"
            + (" --downstream-all-checkpoints" if every else ""))


rule evaluate:
    input:
        f"{RES}/runs/{{run}}/summary.json",
    output:
        f"{RES}/runs/{{run}}/eval.json",
    params:
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
        flags=lambda wc: eval_flags(wc.run),
    log:
        f"{RES}/logs/evaluate-{{run}}.log",
    shell:
        "optimus evaluate --run {params.run_dir} --store " + STORE + " {params.flags}"
        + f" --items {config.get('eval_items', 200)} --dtype {config.get('eval_dtype', 'float32')}"
        + (" --all-checkpoints" if config.get("eval_all_checkpoints") else "")
        # launcher: parsl -- a compute job of the site on the run's tiles, the model sharded as trained
        + " --out {output} " + LAUNCH + " > {log} 2>&1"


# lm-eval's data, loaded once where there is internet (the node that runs Snakemake), into the
# datasets cache the site's jobs read offline (its env: HF_DATASETS_CACHE, HF_DATASETS_OFFLINE=1)
rule task_data:
    output:
        f"{RES}/task-data.done",
    params:
        cache=lambda wc: ((config.get("site") or {}).get("env") or {}).get("HF_DATASETS_CACHE", ""),
    log:
        f"{RES}/logs/task-data.log",
    shell:
        "HF_DATASETS_CACHE={params.cache} optimus task-data --tasks " + " ".join(DOWNSTREAM_TASKS)
        + " > {output}.tmp 2> {log} && mv {output}.tmp {output}"


# The paper's downstream curves: every checkpoint (model-only ones included) of a pretraining run
# on the downstream_tasks, by one node's tiles of the site sharing the checkpoints, one process
# each with the model whole in bf16 (workflow/launch.py: jobs go on from the checkpoints done)
rule downstream:
    input:
        f"{RES}/runs/{{run}}/summary.json",
        TASK_DATA_MARKERS,
    output:
        f"{RES}/runs/{{run}}/downstream.json",
    params:
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
    log:
        f"{RES}/logs/downstream-{{run}}.log",
    shell:
        "optimus evaluate --run {params.run_dir} --store " + STORE + " --tasks " + " ".join(DOWNSTREAM_TASKS)
        + " --all-checkpoints --downstream-all-checkpoints --dtype bfloat16 --out {output} " + LAUNCH + " > {log} 2>&1"
