"""Paper-scale tokenization through Parsl: one task per corpus file, then one merge.

    from workflow.parsl_sites import parsl_cpu_config
    from workflow.sites import load_site
    result, done = tokenize_fanout(TokenizeConfig(), TokenizeInputs(corpus, tokenizer),
                                   TokenizeOutputs(out), shards=Path("results/data/shards"),
                                   parsl_config=parsl_cpu_config(load_site("aurora"), run_dir))
    done  # {"data/web/part-0.json.zst": "tokenized" | "reused", ...}

The logic is stages/tokenize_shards.py's fan-out core (tokenize_shard, merge_shards); this
module only submits ``tokenize_shard`` once per file as a Parsl ``python_app`` on the config's
executor (the site's CPU executor: workflow/parsl_sites.py parsl_cpu_config), waits for all of
them, and merges here. A file whose shard was made from the same bytes with the same tokenizer and settings is
reused by its task, so a rerun after a failure redoes only what is missing or changed. `optimus
tokenize --launcher parsl --site NAME [--shards DIR]` calls it.
"""
from __future__ import annotations

from pathlib import Path

from optimus_core.config import ConfigError
from stages.corpus import CorpusError, list_corpus
from stages.tokenize import TokenizeConfig, TokenizeInputs, TokenizeOutputs, TokenizeResult
from stages.tokenize_shards import merge_shards, shard_dir, shard_settings, tokenize_shard


def default_shards(out_dir: Path) -> Path:
    """Where the shards live unless told: beside the data directory (a rerun of the tokenize
    rule replaces the data directory, never the shards it reuses)."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".shards")


def tokenize_fanout(config: TokenizeConfig, inputs: TokenizeInputs, outputs: TokenizeOutputs, shards: Path,
                    parsl_config) -> tuple[TokenizeResult, dict[str, str]]:
    """Tokenize every corpus file as one Parsl task into ``shards``, then merge into
    ``outputs.out_dir``. Returns the merge's result and each file's task outcome. Every task is
    waited for; if any failed, nothing is merged and the error names the files."""
    import parsl
    from parsl import python_app

    if inputs.tokenizer is None:
        raise ConfigError("tokenizer = None: the fan-out needs a tokenizer.json (training one is a pass "
                          "over the whole corpus; give --tokenizer)")
    tokenizer = Path(inputs.tokenizer).resolve()  # the tasks may run in another directory, on other nodes
    corpus, shards = Path(inputs.corpus_dir).resolve(), Path(shards).resolve()
    files = list_corpus(corpus)
    settings = shard_settings(config, tokenizer)
    labels = [e.label for e in parsl_config.executors]
    app = python_app(tokenize_shard, executors=labels)
    dfk = parsl.load(parsl_config)
    try:
        futures = {f.rel: app(config, f, tokenizer, settings, shard_dir(shards, f)) for f in files}
        done, failed = {}, {}
        for rel, future in futures.items():
            try:
                done[rel] = future.result()
            except Exception as e:  # the task's own error (CorpusError names file and line)
                failed[rel] = e
    finally:
        dfk.cleanup()
        parsl.clear()
    if failed:
        rel, error = next(iter(failed.items()))
        raise CorpusError(f"{len(failed)} of {len(files)} corpus files failed to tokenize (first: {rel}: "
                          f"{type(error).__name__}: {error}); rerun to retry them, finished files are kept",
                          rel) from error
    result = merge_shards(config, TokenizeInputs(corpus, tokenizer), shards, outputs)
    return result, done
