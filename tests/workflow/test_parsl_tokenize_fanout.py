"""The tokenize fan-out through Parsl: one task per corpus file on a site's CPU executor, merged
into the data directory run_tokenize writes; a rerun reuses every unchanged file."""
import json
import os
import sys
from pathlib import Path

import pytest
import zstandard
from parsl.config import Config
from parsl.executors import ThreadPoolExecutor
from parsl.providers import LocalProvider, PBSProProvider

from optimus_core.config import ConfigError
from optimus_core.data.shards import verify
from stages.corpus import CorpusError
from stages.tokenize import TokenizeConfig, TokenizeInputs, TokenizeOutputs, run_tokenize
from workflow import sites
from workflow.cli import main
from workflow.parsl_sites import cpu_job, parsl_cpu_config
from workflow.tokenize_fanout import default_shards, tokenize_fanout


def zst(n: int, prefix: str) -> bytes:
    return zstandard.ZstdCompressor().compress(b"".join(
        json.dumps({"id": f"{prefix}-{i}", "text": f"{prefix} text number {i}, with words.\n"}).encode() + b"\n"
        for i in range(n)))


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for rel, data in {"data/web/a.json.zst": zst(60, "a"), "data/code/b.json.zst": zst(40, "b")}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def tokenizer(corpus, tmp_path):
    run_tokenize(TokenizeConfig(vocab_size=300), TokenizeInputs(corpus), TokenizeOutputs(tmp_path / "bpe"))
    return tmp_path / "bpe" / "tokenizer.json"


def threads(tmp_path):
    return Config(executors=[ThreadPoolExecutor(label="optimus_cpu", max_threads=2)], run_dir=str(tmp_path / "parsl"),
                  usage_tracking=0)


def files_of(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_thread_pool_fanout_matches_run_tokenize_and_reruns_reuse(corpus, tokenizer, tmp_path):
    config, inputs = TokenizeConfig(), TokenizeInputs(corpus, tokenizer)
    run_tokenize(config, inputs, TokenizeOutputs(tmp_path / "reference"))
    out, shards = tmp_path / "tokens", default_shards(tmp_path / "tokens")
    assert shards == tmp_path / "tokens.shards"
    result, done = tokenize_fanout(config, inputs, TokenizeOutputs(out), shards, threads(tmp_path))
    assert done == {"data/code/b.json.zst": "tokenized", "data/web/a.json.zst": "tokenized"}
    assert files_of(out) == files_of(tmp_path / "reference") and result.files == len(verify(out).files)
    (corpus / "data/web/a.json.zst").write_bytes(zst(61, "a"))
    _, again = tokenize_fanout(config, inputs, TokenizeOutputs(out), shards, threads(tmp_path))
    assert again == {"data/code/b.json.zst": "reused", "data/web/a.json.zst": "tokenized"}
    assert sum(f.n_docs for f in verify(out).files if f.source == "web") == 61


def test_a_failed_task_names_the_file_and_merges_nothing(corpus, tokenizer, tmp_path):
    (corpus / "data/web/bad.json.zst").write_bytes(b"not zstd at all")
    with pytest.raises(CorpusError, match=r"1 of 3 corpus files failed to tokenize \(first: data/web/bad.json.zst"):
        tokenize_fanout(TokenizeConfig(), TokenizeInputs(corpus, tokenizer), TokenizeOutputs(tmp_path / "tokens"),
                        tmp_path / "shards", threads(tmp_path))
    assert not (tmp_path / "tokens").exists()
    assert len(list((tmp_path / "shards").iterdir())) == 2  # the good files' shards stay for the rerun
    with pytest.raises(ConfigError, match="tokenizer = None: the fan-out needs a tokenizer.json"):
        tokenize_fanout(TokenizeConfig(), TokenizeInputs(corpus), TokenizeOutputs(tmp_path / "t"), tmp_path / "s",
                        threads(tmp_path))


def test_cli_parsl_launcher_on_the_local_site_htex(corpus, tokenizer, tmp_path, monkeypatch, capsys):
    """`optimus tokenize --launcher parsl --site local`: the real HighThroughputExecutor on this machine."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # Parsl's interchange
    argv = ["tokenize", "--corpus", str(corpus), "--out", "tokens", "--tokenizer", str(tokenizer),
            "--launcher", "parsl", "--site", "local"]
    assert main(argv) == 0
    assert "2 file(s) tokenized, 0 reused from tokens.shards" in capsys.readouterr().out
    run_tokenize(TokenizeConfig(), TokenizeInputs(corpus, tokenizer), TokenizeOutputs(tmp_path / "reference"))
    assert files_of(tmp_path / "tokens") == files_of(tmp_path / "reference")
    assert main(argv[:-4] + ["--launcher", "parsl"]) == 2  # no --site
    assert "site = None: --launcher parsl needs --site NAME" in capsys.readouterr().err


def test_site_cpu_executor_configs(monkeypatch, tmp_path):
    import parsl.addresses

    monkeypatch.delenv(sites.ACCOUNT_ENV, raising=False)
    monkeypatch.setattr(parsl.addresses, "address_by_interface", lambda name: "10.1.2.3")  # Aurora's hsn0
    aurora = sites.load_site("aurora", account="MyProj")
    job = cpu_job(aurora)
    assert (job.nodes, job.queue, job.walltime) == (16, "capacity", "06:00:00")
    (ex,) = parsl_cpu_config(aurora, tmp_path / "p").executors
    p = ex.provider
    assert isinstance(p, PBSProProvider) and (p.nodes_per_block, p.queue, p.account) == (16, "capacity", "MyProj")
    assert ex.max_workers_per_node == 104 and type(p.launcher).__name__ == "MpiExecLauncher"
    assert ex.address == "10.1.2.3"
    assert (p.launcher.bind_cmd, p.launcher.overrides) == ("--cpu-bind", "--ppn 1")
    (local,) = parsl_cpu_config(sites.load_site("local"), tmp_path / "l").executors
    assert isinstance(local.provider, LocalProvider) and local.max_workers_per_node >= 1
    with pytest.raises(ConfigError, match=r"nodes = 300, walltime_h = 30: no queue fits"):
        cpu_job(sites.load_site("aurora", account="A", cpu_executor={"nodes": 300, "walltime_h": 30,
                                                                            "launcher": "mpiexec"}))
    with pytest.raises(ConfigError, match=r"site.cpu_executor.launcher = 'simple': 'simple' starts workers on one node"):
        sites.load_site("aurora", account="A", cpu_executor={"nodes": 2})
    with pytest.raises(ConfigError, match=r"site.cpu_executor.cores: unknown field; allowed: bind_cmd"):
        sites.load_site("aurora", account="A", cpu_executor={"cores": 2})
