# One job per figure, after only the stages whose data it reads (stages/figures.py FIGURE_READS):
# `snakemake results/figures/scaling.png` runs the scaling study, not the training runs.
# "training" waits for every training run of the DAG: a figure draws every completed training
# run in the store, so it must not be drawn while some are still missing.
FIGURE_NEEDS = {
    "training": expand(f"{RES}/runs/{{run}}/summary.json", run=list(PRETRAIN_RUNS)),
    # scaleup.png draws the MoE training runs only: it waits for those, not the dense one
    "scaleup": expand(f"{RES}/runs/{{run}}/summary.json", run=SCALEUP_FIGURE_RUNS),
    "evaluation": expand(f"{RES}/runs/{{run}}/eval.json", run=EVAL_RUNS),
    "scaling": [PERFMODEL_JSON, *BENCH_MARKERS],  # the scaling study (workflow/rules/scaling.smk)
    "bench": BENCH_MARKERS,  # the committed GPU benchmark results, ingested into the store
    # the registry's ablation runs of this DAG (timed, never evaluated): none at laptop scale
    "ablation": expand(f"{RES}/runs/{{run}}/summary.json", run=ABLATION_RUNS),
    "reference": REFERENCE_MARKERS,  # the reference models' published scores, in the store
    # the paper's lm-eval tasks on every checkpoint (downstream_tasks; none at laptop scale, where
    # the evaluations' offline tasks stand in)
    "downstream": expand(f"{RES}/runs/{{run}}/downstream.json", run=DOWNSTREAM_RUNS),
}


# The reference models' published downstream scores (workflow/reference/*.yaml), one run each in
# the store, drawn beside the runs in downstream.png (stages/reference.py).
rule reference:
    input:
        lambda wc: REFERENCES[wc.reference],
    output:
        f"{RES}/reference/{{reference}}.ingested",
    log:
        f"{RES}/logs/reference-{{reference}}.log",
    shell:
        "optimus reference --file {input} --store " + STORE + " > {output}.tmp 2> {log} && mv {output}.tmp {output}"


def figure_inputs(wildcards):
    return sorted({path for need in FIGURE_READS[wildcards.figure] for path in FIGURE_NEEDS[need]})


rule figure:
    input:
        figure_inputs,
    output:
        f"{RES}/figures/{{figure}}",
    log:
        f"{RES}/logs/figure-{{figure}}.log",
    shell:
        f"optimus figures --store {STORE} --out {RES}/figures --only {{wildcards.figure}} > {{log}} 2>&1"


# The paper's pretraining runs as planned on Aurora (shapes, recipe, steps, node-hours, GiB per
# tile: the report's "The paper's runs"), recorded in the store. Planning needs no account; the
# placeholder stands in for one where none is set (no job is submitted).
PAPER_PLAN = f"{RES}/plan/aurora.recorded"


rule paper_plan:
    output:
        PAPER_PLAN,
    log:
        f"{RES}/logs/paper-plan.log",
    shell:
        "OPTIMUS_ACCOUNT=${{OPTIMUS_ACCOUNT:-planning-only}} optimus plan --site aurora --store " + STORE
        + " > {output}.tmp 2> {log} && mv {output}.tmp {output}"


rule report:
    input:
        FIGURES,
        PAPER_PLAN,
        MEMORY_MARKERS,  # the rehearsals in the store: the "Memory per tile" table
        STORE_ONLY_MARKERS,  # the checkpoint I/O benchmark, in the store beside the rest
    output:
        REPORT,
    log:
        f"{RES}/logs/report.log",
    shell:
        f"optimus report --store {STORE} --figures {RES}/figures --out {{output}} > {{log}} 2>&1"
