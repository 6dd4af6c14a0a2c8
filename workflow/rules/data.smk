rule corpus:
    output:
        directory(CORPUS),
    params:
        source=(f"--from {config['corpus_from']}" if config.get("corpus_from") else "")
        + (f" --files-list {config['corpus_files_list']}" if config.get("corpus_files_list") else ""),
    log:
        f"{RES}/logs/corpus.log",
    shell:
        "optimus corpus --out {output} {params.source} 2> {log}"


# With the parsl launcher (the aurora profile) tokenization fans out as one Parsl task per corpus
# file on the site's CPU executor (workflow/tokenize_fanout.py); the per-file shards under
# TOKEN_SHARDS outlive a rerun of this rule, so files already tokenized are not redone.
TOKEN_SHARDS = f"{RES}/data/tokens.shards"


rule tokenize:
    input:
        CORPUS,
    output:
        directory(TOKENS),
    params:
        tokenizer=f"--tokenizer {config['tokenizer']}" if config.get("tokenizer") else "",
        fanout=f"--launcher parsl --site {SITE.name} --shards {TOKEN_SHARDS}" if LAUNCH else "",
    threads: config["tokenize_workers"]
    log:
        f"{RES}/logs/tokenize.log",
    shell:
        "optimus tokenize --corpus {input} --out {output} --workers {threads} {params.tokenizer} {params.fanout}"
        " 2>&1 | tee {log}"


# The window order of the paper's data order, drawn once for every run that reads it (common.smk
# WINDOW_ORDERS): for OLMoE-mix ~2e9 windows, ~16 GiB of memory and minutes, once, instead of on
# every rank of every job; with the parsl launcher by one process on one node of the site, not on
# the node that runs Snakemake.
rule window_order:
    input:
        TOKENS,
    output:
        f"{RES}/data/window-order-s{{seq_len}}-seed{{seed}}.done",
    log:
        f"{RES}/logs/window-order-s{{seq_len}}-seed{{seed}}.log",
    shell:
        "optimus window-order --data {input} --seq-len {wildcards.seq_len} --seed {wildcards.seed} " + LAUNCH
        + " > {output}.tmp 2> {log} && mv {output}.tmp {output}"


# The site's compile cache, filled once by one process on one node (`optimus warm-cache`: every
# paper run rehearsed on one tile, its kernels compiled and autotuned on the runs' own shapes),
# before the training jobs (COMPILE_CACHE_MARKERS in common.smk), so that none of their ranks
# compiles or autotunes what this job did.
rule compile_cache:
    output:
        f"{RES}/compile-cache.done",
    log:
        f"{RES}/logs/compile-cache.log",
    shell:
        "optimus warm-cache --site " + (config.get("site") or {}).get("name", "aurora")
        + " > {output}.tmp 2> {log} && mv {output}.tmp {output}"
