# The strong-scaling study (issue 8): a sweep measured here on the CPU (`optimus scaling`), the
# GPU benchmark results committed under bench/results/ put into the store (each benchmark's own
# --ingest), and the performance model calibrated on both (`optimus perfmodel`), whose run
# `perfmodel` in the store the figures and the report read. Settings: config scaling_cpu and
# bench_results (workflow/config/*.yaml); either may be absent.
import shlex
import sys
from pathlib import Path

SCALING_CPU = config.get("scaling_cpu") or {}
SCALING_JSONL = [f"{RES}/scaling/cpu.jsonl"] if SCALING_CPU else []
PERFMODEL_JSON = f"{RES}/perfmodel.json"
BENCH_RESULTS = {Path(p).stem: p for p in config.get("bench_results", [])}
# The rehearsals' records feed the report's "Memory per tile" table, not a figure; the checkpoint
# I/O records are only kept in the store (the report's job puts them there).
REPORT_ONLY = ("rehearsal-", "checkpoint-io-")
BENCH_MARKERS = [f"{RES}/bench/{stem}.ingested" for stem in BENCH_RESULTS if not stem.startswith(REPORT_ONLY)]
MEMORY_MARKERS = [f"{RES}/bench/{stem}.ingested" for stem in BENCH_RESULTS if stem.startswith("rehearsal-")]
STORE_ONLY_MARKERS = [f"{RES}/bench/{stem}.ingested" for stem in BENCH_RESULTS if stem.startswith("checkpoint-io-")]
# A results file is ingested by the benchmark that wrote it (its name starts with the script's).
BENCH_SCRIPTS = {"distributed-": "bench/distributed.py", "train-step-": "bench/train_step.py",
                 "rehearsal-": "-m workflow.cli rehearse", "checkpoint-io-": "bench/checkpoint_io.py"}


def bench_script(stem):
    for prefix, script in BENCH_SCRIPTS.items():
        if stem.startswith(prefix):
            return script
    raise ValueError(f"bench_results: {BENCH_RESULTS[stem]}: no benchmark ingests it; "
                     f"known file names start with {', '.join(BENCH_SCRIPTS)}")


def setting_flag(flag, settings):
    """`--holdout 8 16:2`: settings (scaling_cpu.fitted, .holdout) as BATCH or BATCH:MICRO
    (stages/scaling.parse_setting)."""
    if not settings:
        return ""
    return f"--{flag} " + " ".join(str(h["global_batch"]) + (f":{h['micro_batch']}" if h.get("micro_batch") else "")
                                   for h in settings)


for _stem in BENCH_RESULTS:  # an unknown file stops the workflow at parse time (a dry run too), before any job
    bench_script(_stem)


if SCALING_CPU:  # the paper scale measures its sweep on Aurora instead (workflow/experiments.py)

    rule scaling:
        output:
            SCALING_JSONL,
        params:
            preset=SCALING_CPU.get("preset", ""),
            devices=" ".join(str(n) for n in SCALING_CPU.get("devices", [1, 2])),
            ep=" ".join(str(e) for e in SCALING_CPU.get("ep", ["all"])),
            fitted=setting_flag("fitted", SCALING_CPU.get("fitted") or []),
            holdout=setting_flag("holdout", SCALING_CPU.get("holdout") or []),
            flags=" ".join(f"--{k.replace('_', '-')} {SCALING_CPU[k]}"
                           for k in ("global_batch", "micro_batch", "steps", "warmup", "rounds", "retries", "max_cpu_wait")
                           if k in SCALING_CPU),
        # Every core: the sweep is timed, so nothing else runs beside it (its ranks use one thread each).
        threads: max(SCALING_CPU.get("devices", [1, 2]))
        log:
            f"{RES}/logs/scaling.log",
        shell:
            "OMP_NUM_THREADS=1 optimus scaling --preset {params.preset} --devices {params.devices} --ep {params.ep}"
            " {params.fitted} {params.holdout} {params.flags} --device cpu --threads 1 --store " + STORE
            + " --jsonl {output} > {log} 2>&1"


rule ingest_bench:
    input:
        lambda wc: BENCH_RESULTS[wc.bench],
    output:
        f"{RES}/bench/{{bench}}.ingested",
    params:
        script=lambda wc: bench_script(wc.bench),
        python=shlex.quote(sys.executable),
    log:
        f"{RES}/logs/ingest-{{bench}}.log",
    shell:
        "{params.python} {params.script} --ingest {input} --store " + STORE
        + " > {output}.tmp 2> {log} && mv {output}.tmp {output}"


rule perfmodel:
    input:
        cpu=SCALING_JSONL,
        measured=list(BENCH_RESULTS.values()),
    output:
        PERFMODEL_JSON,
    log:
        f"{RES}/logs/perfmodel.log",
    shell:
        "optimus perfmodel --store " + STORE + " --measured {input.measured} --out {output} > {log} 2>&1"
