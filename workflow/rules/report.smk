rule figures:
    input:
        expand(f"{RES}/runs/{{run}}/eval.json", run=EVAL_RUNS),
        expand(f"{RES}/runs/{{run}}/summary.json", run=TIMED_RUNS),
        PERFMODEL_JSON,  # the scaling study (workflow/rules/scaling.smk): run perfmodel in the store
        BENCH_MARKERS,
    output:
        FIGURES,
    log:
        f"{RES}/logs/figures.log",
    shell:
        f"optimus figures --store {STORE} --out {RES}/figures > {{log}} 2>&1"


rule report:
    input:
        FIGURES,
    output:
        REPORT,
    log:
        f"{RES}/logs/report.log",
    shell:
        f"optimus report --store {STORE} --figures {RES}/figures --out {{output}} > {{log}} 2>&1"
