rule corpus:
    output:
        directory(CORPUS),
    params:
        source=f"--from {config['corpus_from']}" if config.get("corpus_from") else "",
    log:
        f"{RES}/logs/corpus.log",
    shell:
        "optimus corpus --out {output} {params.source} 2> {log}"


rule tokenize:
    input:
        CORPUS,
    output:
        directory(TOKENS),
    params:
        tokenizer=f"--tokenizer {config['tokenizer']}" if config.get("tokenizer") else "",
    threads: config["tokenize_workers"]
    log:
        f"{RES}/logs/tokenize.log",
    shell:
        "optimus tokenize --corpus {input} --out {output} --workers {threads} {params.tokenizer} 2>&1 | tee {log}"
