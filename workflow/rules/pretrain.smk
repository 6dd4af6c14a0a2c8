import shlex

rule pretrain:
    input:
        TOKENS,
    output:
        f"{RES}/runs/{{run}}/summary.json",
    params:
        experiment=lambda wc: PRETRAIN_RUNS[wc.run].name,
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
        overrides=" ".join(f"--set {shlex.quote(kv)}" for kv in config.get("pretrain_set", [])),
    threads: config["train_threads"]
    log:
        f"{RES}/logs/pretrain-{{run}}.log",
    shell:
        "OMP_NUM_THREADS={threads} optimus pretrain --experiment {params.experiment} --scale " + SCALE
        + " --data {input} --out {params.run_dir} --run-id {wildcards.run} --store " + STORE
        + " --threads {threads} {params.overrides} " + LAUNCH + " 2>&1 | tee {log}"


rule evaluate:
    input:
        f"{RES}/runs/{{run}}/summary.json",
    output:
        f"{RES}/runs/{{run}}/eval.json",
    params:
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
    log:
        f"{RES}/logs/evaluate-{{run}}.log",
    shell:
        "optimus evaluate --run {params.run_dir} --store " + STORE
        + f" --max-batches {config['eval_max_batches']} --tasks {' '.join(config.get('eval_tasks', ['heldout']))}"
        + f" --items {config.get('eval_items', 200)}"
        + (" --all-checkpoints" if config.get("eval_all_checkpoints") else "")
        + " --out {output} > {log} 2>&1"
