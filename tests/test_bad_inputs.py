"""Bad input at every stage, in one place: each gives a clear error through the `optimus` command
(the status and a message naming the culprit), and nothing already written is lost.

Deeper per-stage cases live beside their stages and are not repeated here: every kind of damaged
corpus record with --skip-bad-records (tests/stages/test_tokenize.py), truncated token files
(tests/optimus_core/data/test_loader.py), corrupt or incomplete checkpoints skipped with a
warning (tests/optimus_core/train/test_loop.py), damaged results stores
(tests/optimus_core/test_store.py), config fields (tests/optimus_core/test_config.py).
"""
import gzip
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from workflow.cli import main

TINY = ["--quiet", "--threads", "1", "--set", "train.eval_batches=1", "--set", "model.n_layers=1",
        "--set", "train.global_batch=4", "--set", "data.seq_len=32", "--set", "train.device=cpu"]


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``: what "nothing written is lost" compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def fails(argv, capsys, status: int, message: str) -> str:
    assert main([str(a) for a in argv]) == status
    err = capsys.readouterr().err
    assert message in err, err
    return err


# ----------------------------------------------------------------------------- tokenize

GOOD = b"".join(json.dumps({"id": f"d{i}", "text": f"document {i} " * 20}).encode() + b"\n" for i in range(3))
CORPORA = {  # file (under corpus/bad/), bytes, what the message says after "<path>:"
    "corrupt archive": ("x.json.gz", b"this is not gzip at all", "unreadable or truncated"),
    "broken JSON": ("x.jsonl", GOOD + b'{"id": "broken", "text": \n', "4: not JSON"),
    "missing field": ("x.jsonl", GOOD + b'{"id": "no-text"}\n', "4: no 'text' string"),
}


@pytest.mark.parametrize("case", sorted(CORPORA))
def test_tokenize_bad_corpus_names_file_and_line_and_keeps_the_old_output(case, tokens_dir, tmp_path, capsys):
    name, data, said = CORPORA[case]
    corpus = tmp_path / "corpus"
    (corpus / "good").mkdir(parents=True)
    (corpus / "good" / "a.json.gz").write_bytes(gzip.compress(GOOD, mtime=0))
    (corpus / "bad").mkdir()
    (corpus / "bad" / name).write_bytes(data)
    out = tmp_path / "tokens"
    shutil.copytree(tokens_dir, out)  # a previous, complete output at the same place
    before = digest(out)
    err = fails(["tokenize", "--corpus", corpus, "--out", out, "--tokenizer", tokens_dir / "tokenizer.json",
                 "--workers", "1"], capsys, 1, str(corpus / "bad" / name))
    assert said in err
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "tokens"]  # no half-written leftovers


# ----------------------------------------------------------------------------- pretrain: before training

def test_unknown_preset_lists_the_known_ones(tokens_dir, tmp_path, capsys):
    fails(["pretrain", "--preset", "mula-9b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1],
          capsys, 2, "preset = 'mula-9b@laptop': unknown; known presets: mula-1b,")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("setting, message", [
    ("train.steps=abc", "train.steps = 'abc': must be an integer"),
    ("execution.dtype=float16", "execution.dtype = 'float16': must be one of 'auto', 'float32', 'bfloat16'"),
    ("train.dtype=bfloat16", "train.dtype is now execution.dtype"),
    ("train.fused_lm_loss=false", "train.fused_lm_loss is no longer a choice: the LM loss is always fused"),
    ("train.watchdog_timeout_s=-5", "train.watchdog_timeout_s = -5.0: must be >= 0"),
    ("parallel.collective_timeout_s=[1]", "parallel.collective_timeout_s = [1]: must be a number"),
    ("train.nosuch=1", "unknown field train.nosuch (in train); known fields:"),
])
def test_wrong_config_values_name_the_field(setting, message, tokens_dir, tmp_path, capsys):
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r",
           "--set", setting], capsys, 2, message)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, message", [
    (["--preset", "olmoe-1b-7b@laptop--SX2"], "tag 'SX2': unknown key 'SX' in 'SX2'; this base takes L, SA, SH"),
    (["--preset", "olmoe-1b-7b@laptop--SA1.25"], "tag 'SA1.25': model.n_heads = 5: must divide d_model (128)"),
    (["--preset", "mula-220b-a10b@laptop", "--ep", "8"], "parallel.ep = 8: must divide model.moe.n_experts (60)"),
    (["--preset", "mula-1b@laptop", "--set", "schedule.decay_horizon=10"],
     "schedule.decay_horizon = 10: must be 'run', 'epoch' or a number of steps above warmup_steps (20)"),
])
def test_a_bad_model_tag_or_recipe_names_the_tag_or_field(argv, message, tokens_dir, tmp_path, capsys):
    fails(["pretrain", *argv, "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1], capsys, 2, message)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", 3, "--set", "train.steps=5"], "--steps 3 and --set train.steps=5 name the same field with different "
                                              "values: give one"),
    (["--steps", 3, "--set", "optim.lr=.inf"], "optim.lr = inf: must be a finite number"),
])
def test_a_set_that_contradicts_a_flag_or_is_not_finite_is_refused(argv, message, tokens_dir, tmp_path, capsys):
    """Neither silently wins; an infinite learning rate (which poisons the first checkpoint) is not a number."""
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", *argv], capsys, 2,
          message)
    assert not (tmp_path / "r").exists()


def test_a_set_number_is_read_as_written():
    from workflow.cli import build_parser
    from workflow.commands import resolve_run_config

    args = build_parser().parse_args(["pretrain", "--preset", "mula-1b@laptop", "--data", "d", "--out", "o",
                                      "--steps", "3", "--set", "optim.lr=1e-3", "--set", "train.steps=3"])
    cfg, _, _ = resolve_run_config(args)
    assert cfg.optim.lr == 1e-3 and cfg.train.steps == 3  # an agreeing --set is no clash


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`optimus presets | head -1`: no BrokenPipe traceback, the shell's status for SIGPIPE."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "workflow.cli", "presets"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # before the command writes a line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_an_epoch_within_the_warmup_is_refused_before_anything_is_built(tokens_dir, tmp_path, capsys):
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1,
           *TINY, "--set", "schedule.decay_horizon=epoch", "--set", "schedule.warmup_steps=100000"], capsys, 2,
          "schedule.decay_horizon = 'epoch': one epoch of the data is")
    assert not (tmp_path / "r").exists()


def test_a_vocabulary_larger_than_the_model_is_refused(tokens_dir, tmp_path, capsys):
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1,
           "--set", "model.vocab_size=256", *TINY], capsys, 1,
          "model.vocab_size = 256 is smaller than the tokenizer's vocabulary (4096")


def test_missing_token_directory_is_named(tmp_path, capsys):
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tmp_path / "nope", "--out", tmp_path / "r",
           "--steps", 1, *TINY], capsys, 1, "is not a complete `optimus tokenize` output")


def test_broken_manifest_is_named(tokens_dir, tmp_path, capsys):
    data = tmp_path / "tokens"
    shutil.copytree(tokens_dir, data)
    (data / "manifest.json").write_text("{broken")
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", data, "--out", tmp_path / "r", "--steps", 1, *TINY],
          capsys, 1, str(data / "manifest.json"))


# ----------------------------------------------------------------------------- pretrain: an existing run directory

@pytest.fixture(scope="module")
def finished_run(tokens_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "run-a"
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(run),
                 "--steps", "1", *TINY]) == 0
    return run


def test_a_second_run_of_one_run_id_never_replaces_the_first_ones_record(tokens_dir, tmp_path, capsys):
    """Runs A/x and B/x into one store: B is refused before it writes anything (A stays x); A's
    directory moved elsewhere is still run x (its uid travels in its meta.json): it evaluates into x."""
    from optimus_core.store import open_store

    store = tmp_path / "store.zarr"
    a = tmp_path / "A" / "x"
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(a),
                 "--steps", "1", "--store", str(store), *TINY]) == 0
    record = open_store(store, mode="r").attrs("x")
    b = tmp_path / "B" / "x"
    one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", b, "--steps", 1,
                    "--seed", 7, "--store", store, *TINY], capsys, 1,
                   f"error: {store} already holds run 'x' of another run (trained in {a.resolve()}), not of {b}: "
                   f"give this run another --run-id"))
    assert open_store(store, mode="r").attrs("x") == record and not b.exists()
    moved = tmp_path / "C" / "x"
    moved.parent.mkdir()
    shutil.move(a, moved)
    assert main(["evaluate", "--run", str(moved), "--store", str(store), "--max-batches", "1"]) == 0
    assert "heldout" in open_store(store, mode="r").tables("x")


def test_checkpoints_of_another_run_are_never_resumed_moved_or_pruned(finished_run, tokens_dir, tmp_path, capsys):
    """A run directory whose checkpoints/ is a link to another run's: the other run's checkpoints
    are refused in one line (they carry that run's uid), and nothing of the other run changes."""
    theirs = digest(finished_run)
    run = tmp_path / "linked"
    run.mkdir()
    (run / "checkpoints").symlink_to(finished_run / "checkpoints", target_is_directory=True)
    one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", run, "--steps", 3,
                    "--set", "train.checkpoint_every=1", *TINY], capsys, 1, "is a checkpoint of another run (uid "))
    assert digest(finished_run) == theirs and not (run / "meta.json").exists()


def test_a_run_directory_of_another_run_is_refused_untouched(finished_run, tokens_dir, tmp_path, capsys):
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    before = digest(run)
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", run, "--run-id", "run-b",
           "--steps", 2, *TINY], capsys, 1,
          f"{run} holds run 'run-a', not 'run-b': use another --out, or --run-id run-a to resume it")
    assert digest(run) == before


def test_a_checkpoint_of_another_model_is_refused_and_kept(finished_run, tokens_dir, tmp_path, capsys):
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    before = digest(run / "checkpoints")
    err = fails(["pretrain", "--preset", "mula-7b-a1b@laptop", "--data", tokens_dir, "--out", run, "--steps", 2,
                 *TINY], capsys, 2, f"{run} holds checkpoints of a run with other settings, which a resume cannot "
                                    f"change: model.d_ff 512 -> 8192, model.moe None -> {{")
    assert "model.norm 'nonparametric_layernorm' -> 'rmsnorm', model.qk_norm False -> True" in err
    assert "preset 'mula-1b@laptop' -> 'mula-7b-a1b@laptop'; use another --out for these settings" in err
    assert digest(run / "checkpoints") == before
    assert (run / "summary.json").is_file()


def test_a_checkpoint_of_another_model_leaves_the_run_meta_as_it_was(finished_run, tokens_dir, tmp_path, capsys):
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    before = (run / "meta.json").read_text()
    main(["pretrain", "--preset", "mula-7b-a1b@laptop", "--data", str(tokens_dir), "--out", str(run), "--steps", "2",
          *TINY])
    assert (run / "meta.json").read_text() == before


# ----------------------------------------------------------------------------- after training

def test_export_and_evaluate_need_a_run_directory(tmp_path, capsys):
    (tmp_path / "not-a-run").mkdir()
    fails(["export-hf", "--run", tmp_path / "not-a-run", "--out", tmp_path / "hf"], capsys, 1, "not a run directory")
    assert not (tmp_path / "hf").exists()
    fails(["evaluate", "--run", tmp_path / "not-a-run"], capsys, 1, "not a run directory")


def test_figures_need_a_results_store(tmp_path, capsys):
    fails(["figures", "--store", tmp_path / "none.zarr", "--out", tmp_path / "figs"], capsys, 1,
          f"no results store at {tmp_path / 'none.zarr'}")
    assert not (tmp_path / "none.zarr").exists()


# ----------------------------------------------------------------------------- outputs never destroy what they did not make

def _a_corpus(root: Path) -> Path:
    (root / "web").mkdir(parents=True)
    (root / "web" / "a.jsonl").write_bytes(GOOD)
    return root


def test_corpus_and_tokenize_refuse_an_out_of_the_users_files(tokens_dir, tmp_path, capsys):
    corpus = _a_corpus(tmp_path / "corpus")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own")
    fails(["corpus", "--from", corpus, "--out", mine], capsys, 1,
          f"corpus output {mine} holds 1 entries (notes.txt) that `optimus corpus` did not make")
    fails(["tokenize", "--corpus", corpus, "--out", mine], capsys, 1, "did not make")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    fails(["tokenize", "--corpus", corpus, "--out", a_file], capsys, 1, f"tokenize output {a_file} is a file")
    assert a_file.read_text() == "x"
    tokens = tmp_path / "tokens"
    shutil.copytree(tokens_dir, tokens)
    fails(["corpus", "--from", corpus, "--out", tokens], capsys, 1,
          f"corpus output {tokens} is an output of `optimus tokenize`, not of `optimus corpus`")
    assert digest(tokens) == digest(tokens_dir)


def test_an_output_equal_to_or_inside_or_around_its_input_is_refused(finished_run, tmp_path, capsys):
    corpus = _a_corpus(tmp_path / "corpus")
    before = digest(corpus)
    fails(["tokenize", "--corpus", corpus, "--out", corpus], capsys, 1, f"tokenize output {corpus} is the input")
    fails(["tokenize", "--corpus", corpus, "--out", corpus / "web" / "tokens"], capsys, 1, "is inside the input")
    fails(["corpus", "--from", corpus, "--out", corpus], capsys, 1, "is the input")
    assert digest(corpus) == before
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    before = digest(run)
    fails(["export-hf", "--run", run, "--out", run], capsys, 1, f"export-hf output {run} is the input {run}")
    fails(["export-hf", "--run", run, "--out", tmp_path], capsys, 1, "holds the input")
    assert digest(run) == before


def test_a_previous_output_of_the_same_stage_is_replaced(tmp_path, capsys):
    corpus = _a_corpus(tmp_path / "corpus")
    index = tmp_path / "index"
    for _ in range(2):  # the second replaces the first, its own (marked) output, whole
        assert main(["corpus", "--from", str(corpus), "--out", str(index)]) == 0
    assert sorted(p.name for p in index.iterdir()) == [".optimus-output.json", "index.json"]


# ----------------------------------------------------------------------------- a run directory belongs to one run

def test_pretrain_refuses_a_directory_that_is_not_a_run(tokens_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tokens_dir, data)
    before = digest(data)
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", data, "--steps", 1, *TINY],
          capsys, 1, f"--out {data} holds ")
    assert digest(data) == before
    fails(["pretrain", "--preset", "mula-1b@laptop", "--experiment", "pretrain-mula-1b", "--data", tokens_dir,
           "--out", tmp_path / "r"], capsys, 2, "--preset mula-1b@laptop and --experiment pretrain-mula-1b: give one")


def test_a_finished_run_run_again_is_a_no_op_and_is_never_shortened(finished_run, tokens_dir, tmp_path, capsys):
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    before = digest(run)
    capsys.readouterr()
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(run),
                 "--steps", "1", *TINY]) == 0
    assert "run-a: finished at step 1 already; nothing was trained or changed" in capsys.readouterr().out
    assert digest(run) == before
    longer = tmp_path / "longer"
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(longer),
                 "--steps", "2", *TINY]) == 0
    before = digest(longer)
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", longer, "--steps", 1, *TINY],
          capsys, 1, "has a checkpoint at step 2; train.steps = 1 is fewer, and a run is never shortened")
    assert digest(longer) == before


def test_a_run_whose_checkpoints_are_all_invalid_stops_unless_told_to_start_over(finished_run, tokens_dir, tmp_path,
                                                                                  capsys):
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    shard = next((run / "checkpoints" / "step_000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    argv = ["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", run, "--steps", 2, *TINY]
    fails(argv, capsys, 1, "holds checkpoints up to step 1 and none is valid (the warnings above say why): pass "
                           "--start-over")
    assert shard.is_file()
    assert main([str(a) for a in argv + ["--start-over"]]) == 0
    assert (run / "checkpoints" / "invalid" / "step_000001").is_dir()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["invalid", "step_000002"]


def test_export_without_safetensors_says_how_to_install_it_in_one_line(finished_run, tmp_path, capsys, monkeypatch):
    import sys

    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    err = fails(["export-hf", "--run", finished_run, "--out", tmp_path / "hf"], capsys, 1,
                "the safetensors package, which is not installed here")
    assert err.count("\n") == 1 and "pip install -e '.[eval]'" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- data identity

def test_data_of_another_tokenizer_is_refused_where_it_meets_the_run(finished_run, code_tokens_dir, tmp_path, capsys):
    said = "was tokenized with another tokenizer"
    fails(["evaluate", "--run", finished_run, "--data", code_tokens_dir], capsys, 1, said)
    fails(["export-hf", "--run", finished_run, "--data", code_tokens_dir, "--out", tmp_path / "hf"], capsys, 1, said)
    assert not (tmp_path / "hf").exists()
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    before = digest(run)
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", code_tokens_dir, "--out", run, "--steps", 2, *TINY],
          capsys, 1, said)
    assert digest(run) == before


def test_a_damaged_tokenizer_in_the_data_is_found_before_training(tokens_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tokens_dir, data)
    (data / "tokenizer.json").write_text("{}")
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", data, "--out", tmp_path / "r", "--steps", 1, *TINY],
          capsys, 1, f"{data / 'tokenizer.json'}: its sha256 does not match")


def test_launch_settings_are_checked_before_any_rank_starts(tokens_dir, tmp_path, capsys):
    base = ["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1]
    fails(base + ["--threads", -3], capsys, 2, "--threads = -3: must be >= 1")
    fails(base + ["--nproc", 3, "--set", "train.global_batch=4"], capsys, 2,
          "train.global_batch = 4: must be divisible by the data-parallel ranks (3 ranks)")
    assert not (tmp_path / "r").exists()


def test_perfmodel_on_a_store_that_is_not_there_is_refused_not_created(tmp_path, capsys):
    fails(["perfmodel", "--store", tmp_path / "typo.zarr"], capsys, 1, f"no results store at {tmp_path / 'typo.zarr'}")
    assert not (tmp_path / "typo.zarr").exists()


def test_presets_refuse_a_sequence_length_below_one(capsys):
    fails(["presets", "--seq-len", -5], capsys, 2, "--seq-len = -5: must be >= 1")


def test_flags_that_would_be_ignored_are_refused(tokens_dir, tmp_path, capsys):
    base = ["pretrain", "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1]
    fails(base + ["--preset", "mula-1b@laptop", "--site", "aurora"], capsys, 2,
          "--site aurora is used only with --launcher parsl")
    fails(base + ["--preset", "mula-1b@laptop", "--scale", "paper"], capsys, 2,
          "--scale paper chooses an --experiment's configuration")
    fails(["evaluate", "--run", tmp_path, "--site", "local"], capsys, 2, "--site local is used only with")
    assert not (tmp_path / "r").exists()


def test_figures_only_takes_several_names_as_the_readme_shows():
    from workflow.cli import build_parser

    args = build_parser().parse_args(["figures", "--store", "s", "--out", "o", "--only", "a.png", "b.png",
                                      "--only", "c.png"])
    assert args.only == ["a.png", "b.png", "c.png"]


# ----------------------------------------------------------------------------- the environment: outputs and devices

@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A directory nothing may be created in. chmod stops a user but not root (CI), so creating
    an entry in it is also refused as the kernel refuses it, EACCES naming the entry: os.mkdir
    and os.open with O_CREAT (under Path.mkdir, tempfile.mkdtemp / mkstemp), and os.access."""
    import errno
    import os

    ro = tmp_path / "read-only"
    ro.mkdir()
    in_ro = lambda path: os.path.dirname(os.path.abspath(path)) == str(ro)  # noqa: E731
    real_mkdir, real_open, real_access = os.mkdir, os.open, os.access

    def mkdir(path, *args, **kwargs):
        if in_ro(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if in_ro(path) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    def access(path, mode, *args, **kwargs):
        return False if os.path.abspath(path) == str(ro) and mode & os.W_OK else real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "access", access)
    ro.chmod(0o555)
    yield ro
    ro.chmod(0o755)


def test_an_output_that_cannot_be_written_is_named_as_the_user_gave_it(read_only, finished_run, tokens_dir, tmp_path,
                                                                       capsys):
    """Exit 1, one line naming the output asked for: never the temporary sibling it is built in."""
    corpus = _a_corpus(tmp_path / "corpus")
    store = _empty_store(tmp_path)
    for argv, out in [
        (["corpus", "--from", corpus, "--out", read_only / "index"], read_only / "index"),
        (["tokenize", "--corpus", corpus, "--out", read_only / "tokens", "--tokenizer", tokens_dir / "tokenizer.json",
          "--workers", 1], read_only / "tokens"),
        (["export-hf", "--run", finished_run, "--out", read_only / "hf"], read_only / "hf"),
        (["figures", "--store", store, "--out", read_only / "a" / "figs"], read_only / "a" / "figs"),
        (["figures", "--store", store, "--out", read_only], read_only),  # an existing directory
        (["report", "--store", store, "--figures", tmp_path, "--out", read_only / "r.md"], read_only / "r.md"),
        (["evaluate", "--run", finished_run, "--max-batches", 1, "--out", read_only / "eval.json"],
         read_only / "eval.json"),
        (["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", read_only / "runs" / "r",
          "--steps", 1, "--nproc", 2, *TINY], read_only / "runs" / "r"),  # refused before any rank starts
    ]:
        err = fails(argv, capsys, 1, f"error: cannot write {out}: permission denied")
        assert ".tmp-" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert list(read_only.iterdir()) == []


def _empty_store(tmp_path: Path) -> Path:
    from optimus_core.store import open_store

    path = tmp_path / "empty.zarr"
    if not path.exists():
        open_store(path)
    return path


def test_a_device_that_is_not_here_is_one_sentence_before_any_rank_starts(tokens_dir, tmp_path, capsys, monkeypatch):
    """Exit 1: the environment lacks the device; the same command is right on a GPU node."""
    import torch

    import optimus_core.parallel.launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(optimus_core.parallel.launch, "spawn_local", lambda *a, **k: pytest.fail("ranks started"))
    tiny = [a if a != "train.device=cpu" else "train.device=cuda" for a in TINY]
    err = fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--steps", 1,
                 "--nproc", 2, *tiny], capsys, 1,
                "error: train.device = cuda but no CUDA device is visible (torch.cuda.is_available() is False")
    assert "set train.device to auto or cpu" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()
    fails(["evaluate", "--run", tmp_path, "--nproc", 2, "--device", "cuda"], capsys, 1,
          "--device = cuda but no CUDA device is visible")


@pytest.mark.parametrize("nproc", [1, 2])
def test_triton_experts_on_a_cpu_without_the_interpreter_is_refused_before_the_model(nproc, tokens_dir, tmp_path):
    """A configuration choice (exit 2), refused before any rank starts or the run directory is made."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "r"
    done = subprocess.run([sys.executable, "-m", "workflow.cli", "pretrain", "--preset", "mula-7b-a1b@laptop",
                           "--data", str(tokens_dir), "--out", str(out), "--steps", "1", "--nproc", str(nproc),
                           "--experts-backend", "triton", *TINY], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "optimus pretrain: configuration error: execution.experts = 'triton': the Triton experts kernel cannot run "
        "here: no Triton on cpu (it needs a CUDA or XPU device, or the Triton interpreter: TRITON_INTERPRET=1 set "
        "before Python starts); use 'auto' or 'loop'")
    assert not out.exists()


# ----------------------------------------------------------------------------- site files

@pytest.mark.parametrize("text, said", [
    ("site:\n  name: mine\n  kind: [local\n  tiles_per_node: 1\n",
     "line 4, column 17: not valid YAML (expected ',' or ']', but got ':'; while parsing a flow sequence that "
     "starts at line 3)"),
    ("site:\n  name: mine\n  kind: local\n  tiles_per_nod: 1\n", "line 4: site.tiles_per_nod: unknown field; allowed:"),
    ("site:\n  name: mine\n  queues:\n    debug: {min_nodes: 1, max_nodes: 2, walltime_h: 1, colour: red}\n",
     "line 4: site.queues.debug.colour: unknown field"),
    ("site:\n  name: mine\n  device: gpu\n", "line 3: site mine: device = 'gpu': must be one of auto, cpu, cuda, xpu"),
    ("- a\n- list\n", "has no site: block"),
])
def test_a_bad_site_file_names_the_file_and_the_line(text, said, tmp_path, capsys):
    site = tmp_path / "my sites" / "cluster.yaml"
    site.parent.mkdir()
    site.write_text(text)
    err = fails(["plan", "--site", site], capsys, 2, f"configuration error: {'site: ' if 'block' in said else ''}{site}")
    assert said in err and "Traceback" not in err


# ----------------------------------------------------------------------------- evaluation tasks

def test_an_unknown_task_is_named_with_the_known_ones_before_any_model_loads(finished_run, tmp_path, capsys,
                                                                             monkeypatch):
    pytest.importorskip("lm_eval")
    import stages.evaluate

    monkeypatch.setattr(stages.evaluate._Point, "load", lambda self: pytest.fail("a model was loaded"))
    tasks = tmp_path / "my tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: my_task\ndataset_path: json\n")
    err = fails(["evaluate", "--run", finished_run, "--tasks", "heldout", "continuaton", "--task-dir", tasks,
                 "--out", tmp_path / "eval.json"], capsys, 2,
                "configuration error: tasks = ['continuaton']: unknown to lm-eval and not built in; known: heldout, "
                f"continuation, docstring; in {tasks}: my_task; lm-eval's ")
    assert "registered tasks (`lm_eval ls tasks` lists them); did you mean continuation" in err
    assert "optimus-tasks-" not in err and "install" not in err  # not our temporary directory, not "install lm-eval"
    assert not (tmp_path / "eval.json").exists()


def test_an_unknown_task_without_lm_eval_is_unknown_not_missing_software(finished_run, capsys, monkeypatch):
    import sys

    import optimus_core.eval

    for name in ("docstring", "lm", "tasks"):  # as if lm-evaluation-harness were not installed
        monkeypatch.setitem(sys.modules, f"optimus_core.eval.{name}", None)
        monkeypatch.delattr(optimus_core.eval, name, raising=False)
    fails(["evaluate", "--run", finished_run, "--tasks", "nosuchtask"], capsys, 2,
          "tasks = ['nosuchtask']: unknown; known: heldout, continuation, docstring (any other name is an lm-eval task")


# ----------------------------------------------------------------------------- the report's figures

def test_the_report_names_a_figures_directory_that_is_not_there(tmp_path, capsys):
    store = _empty_store(tmp_path)
    fails(["report", "--store", store, "--figures", tmp_path / "figurs", "--out", tmp_path / "report.md"], capsys, 1,
          f"error: figures directory {tmp_path / 'figurs'} does not exist: draw the figures there first (`optimus "
          f"figures --store {store} --out {tmp_path / 'figurs'}`)")
    assert not (tmp_path / "report.md").exists()


def test_the_reports_figure_links_work_where_a_path_has_spaces(tmp_path, capsys):
    import re
    from urllib.parse import unquote

    store, figures = _empty_store(tmp_path), tmp_path / "my figures (v1)"
    assert main(["figures", "--store", str(store), "--out", str(figures)]) == 0
    report = tmp_path / "the report" / "report.md"
    assert main(["report", "--store", str(store), "--figures", str(figures), "--out", str(report)]) == 0
    text = report.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]*)\)", text)  # a Markdown image's destination ends at the first ')'
    assert len(links) == len(re.findall(r"!\[", text)) >= 5
    for link in links:
        assert " " not in link and "(" not in link  # one token: nothing ends the destination early
        assert (report.parent / unquote(link)).resolve().is_file(), link
        assert (report.parent / unquote(link)).resolve().parent == figures.resolve()


# ----------------------------------------------------------------------------- the sweep of issue 28: one line each

def one_line(err: str) -> str:
    """The failure's one line: all that stderr holds (TINY's --quiet keeps a run's plan off it)."""
    assert err.count("\n") == 1 and err.startswith("optimus") and err.endswith("\n"), err
    return err


@pytest.mark.parametrize("argv, said", [
    (["pretrain", "--data", "d", "--out", "o", "--steps", "1.5"],
     "optimus pretrain: usage error: argument --steps: invalid int value: '1.5' (`optimus pretrain --help`"),
    (["trian"], "optimus: usage error: argument command: invalid choice: 'trian'"),
    (["experiments", "--foo"], "optimus: usage error: unrecognized arguments: --foo"),
    (["evaluate"], "optimus evaluate: usage error: the following arguments are required: --run"),
])
def test_a_usage_error_is_one_line_with_status_2(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert said in one_line(capsys.readouterr().err)


def test_tokenize_names_a_corpus_or_tokenizer_that_is_not_there_or_not_a_file(tokens_dir, tmp_path, capsys):
    corpus = _a_corpus(tmp_path / "corpus")
    a_file, a_dir, junk = tmp_path / "a-file", tmp_path / "a-dir", tmp_path / "junk.json"
    a_file.write_text("x")
    a_dir.mkdir()
    junk.write_text("not a tokenizer")
    out = tmp_path / "tokens"
    for given, tokenizer, said in [
        (tmp_path / "nope", None, f"corpus {tmp_path / 'nope'}: no such directory"),
        (a_file, None, f"corpus {a_file}: is a file, not a directory"),
        (corpus, tmp_path / "nope.json", f"tokenizer {tmp_path / 'nope.json'}: no such file"),
        (corpus, a_dir, f"tokenizer {a_dir}: is a directory, not a file"),
        (corpus, junk, f"tokenizer {junk}: not a Hugging Face tokenizer.json"),  # the user's path, not our copy
    ]:
        argv = ["tokenize", "--corpus", given, "--out", out, "--workers", 1] + (["--tokenizer", tokenizer]
                                                                               if tokenizer else [])
        one_line(fails(argv, capsys, 1, said))
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file", "corpus", "junk.json"]


def test_tokenize_refuses_flags_it_would_ignore_or_values_it_would_replace(tokens_dir, tmp_path, capsys):
    corpus = _a_corpus(tmp_path / "corpus")
    base = ["tokenize", "--corpus", corpus, "--out", tmp_path / "t", "--workers", 1]
    fails(base + ["--vocab-size", 0], capsys, 2, "tokenize.vocab_size = 0: must be an integer >= 258")  # not the default
    fails(base + ["--tokenizer", tokens_dir / "tokenizer.json", "--vocab-size", 512], capsys, 2,
          "--vocab-size 512 is the size of the BPE trained when no --tokenizer is given")
    fails(base + ["--shards", tmp_path / "sh"], capsys, 2, "--shards")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@pytest.mark.parametrize("text, said", [
    ("{not json", "index.json: not valid JSON"),
    ('{"format": "optimus-corpus-index"}', "index.json: an incomplete corpus index (KeyError: 'root')"),
])
def test_a_damaged_corpus_index_is_named(text, said, tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "index.json").write_text(text)
    one_line(fails(["tokenize", "--corpus", tmp_path / "corpus", "--out", tmp_path / "t", "--workers", 1], capsys, 1,
                   str(tmp_path / "corpus" / said.split(":")[0]) + ":" + said.split(":", 1)[1]))


@pytest.mark.parametrize("damage, said", [
    ("truncate", "bytes, not a whole number of uint16 tokens (2 bytes each): truncated or damaged"),
    ("remove", "missing (the manifest lists it): the token directory is incomplete"),
])
def test_a_damaged_token_file_is_named_before_training(damage, said, tokens_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tokens_dir, data)
    shard = sorted((data / "train").rglob("*.npy"))[0]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-3])
    else:
        shard.unlink()
    err = one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", data, "--out", tmp_path / "r",
                          "--steps", 1, *TINY], capsys, 1, f"{shard}: "))
    assert said in err
    assert not (tmp_path / "r").exists()  # refused before the run wrote anything: no directory left behind


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_missing_held_out_file_is_found_before_training_on_every_rank(nproc, tokens_dir, tmp_path, capfd):
    """Found when the run is built, not at its first evaluation; from spawned ranks it is the same
    one line (said once for all of them), not a traceback per rank."""
    data = tmp_path / "data"
    shutil.copytree(tokens_dir, data)
    shard = sorted((data / "val").rglob("*.npy"))[0]
    shard.unlink()
    capfd.readouterr()
    assert main([str(a) for a in ["pretrain", "--preset", "mula-1b@laptop", "--data", data, "--out", tmp_path / "r",
                                  "--steps", 1, "--nproc", nproc, *TINY]]) == 1
    err = one_line(capfd.readouterr().err)
    assert f"{shard}: missing (the manifest lists it)" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, said", [("{oops", "not valid JSON"), ("[1, 2]", "not a run's meta.json")])
def test_a_damaged_run_meta_is_named_and_kept(text, said, finished_run, tokens_dir, tmp_path, capsys):
    run = tmp_path / "run-a"
    shutil.copytree(finished_run, run)
    (run / "meta.json").write_text(text)
    before = digest(run)
    one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", run, "--steps", 2,
                    *TINY], capsys, 1, f"{run / 'meta.json'}: {said}"))
    one_line(fails(["evaluate", "--run", run, "--out", tmp_path / "e.json"], capsys, 1, f"{run / 'meta.json'}: "))
    assert digest(run) == before and not (tmp_path / "e.json").exists()


def test_a_run_id_that_is_not_a_name_is_a_configuration_error(tokens_dir, tmp_path, capsys):
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--run-id", "a/b",
           "--steps", 1, *TINY], capsys, 2, "run_id = 'a/b': must be a non-empty name without '/'")
    fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r", "--set", "=3"],
          capsys, 2, "--set '=3': expected key=value")
    assert not (tmp_path / "r").exists()


def test_a_run_directory_inside_its_data_is_refused(tokens_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tokens_dir, data)
    before = digest(data)
    for out, said in [(data / "runs" / "r", "is inside the data directory"), (data, "is the data directory")]:
        one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", data, "--out", out, "--steps", 1, *TINY],
                       capsys, 1, f"--out {out} {said} (--data {data}): a rerun of `optimus tokenize` there would "
                                  f"delete the run"))
    assert digest(data) == before


def test_a_damaged_store_is_named_and_a_run_refused_by_it_does_not_say_running(tokens_dir, tmp_path, capsys):
    store = tmp_path / "junk.zarr"
    store.mkdir()
    (store / "zarr.json").write_text("{bad")
    said = f"{store / 'zarr.json'}: not valid JSON"
    one_line(fails(["figures", "--store", store, "--out", tmp_path / "figs"], capsys, 1, said))
    one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r",
                    "--steps", 1, "--store", store, *TINY], capsys, 1, said))
    assert not (tmp_path / "r").exists()  # refused before meta.json could say "running": nothing left behind


def test_evaluate_settings_are_configuration_errors_and_a_missing_task_dir_is_named(finished_run, tmp_path, capsys):
    base = ["evaluate", "--run", finished_run, "--out", tmp_path / "e.json"]
    fails(base + ["--max-batches", 0], capsys, 2, "configuration error: max_batches = 0: must be >= 1")
    fails(base + ["--limit", 5], capsys, 2, "limit = 5: it limits the documents of downstream tasks, and tasks = "
                                            "['heldout'] has none")
    fails(base + ["--tasks", "continuation", "--all-checkpoints"], capsys, 2, "all_checkpoints = True with tasks")
    one_line(fails(base + ["--task-dir", tmp_path / "nope"], capsys, 1,
                   f"task directory {tmp_path / 'nope'}: no such directory"))
    assert not (tmp_path / "e.json").exists()


def test_a_one_file_output_that_is_a_directory_is_refused_before_the_work(finished_run, tmp_path, capsys):
    from optimus_core.atomic import atomic_write

    store, a_dir = _empty_store(tmp_path), tmp_path / "a-dir"
    a_dir.mkdir()
    for argv, flag in [
        (["evaluate", "--run", finished_run, "--out", a_dir], "--out"),
        (["report", "--store", store, "--figures", tmp_path, "--out", a_dir], "--out"),
        (["perfmodel", "--store", store, "--out", a_dir], "--out"),
        (["scaling", "--preset", "mula-7b-a1b@laptop", "--devices", 1, "--jsonl", a_dir], "--jsonl"),
        (["rehearse", "--experiment", "pretrain-mula-1b", "--device", "meta", "--jsonl", a_dir], "--jsonl"),
    ]:
        one_line(fails(argv, capsys, 1, f"error: {flag} {a_dir} is a directory; this output is one file"))
    assert list(a_dir.iterdir()) == []
    with pytest.raises(FileExistsError, match="is a directory, not a file: nothing was written"):
        atomic_write(a_dir, "x")  # the stages' own writes, under any command


def test_a_one_file_output_replaces_only_its_own_file_and_never_writes_into_an_input(finished_run, tmp_path,
                                                                                    capsys):
    """The user's JSON, notes or lines are not replaced by evaluate, report, perfmodel, scaling or
    rehearse; nor is a file inside the store they read; the command's own earlier output is."""
    store = _empty_store(tmp_path)
    mine = {"mine.json": '{"mine": 1}\n', "notes.md": "my notes\n", "lines.jsonl": '{"a": 1}\n'}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    root = store / "zarr.json"
    before = root.read_bytes()
    for argv, flag, path in [
        (["evaluate", "--run", finished_run, "--out", tmp_path / "mine.json"], "--out", tmp_path / "mine.json"),
        (["report", "--store", store, "--figures", tmp_path, "--out", tmp_path / "notes.md"], "--out",
         tmp_path / "notes.md"),
        (["perfmodel", "--store", store, "--out", tmp_path / "mine.json"], "--out", tmp_path / "mine.json"),
        (["scaling", "--preset", "mula-7b-a1b@laptop", "--devices", 1, "--jsonl", tmp_path / "lines.jsonl"], "--jsonl",
         tmp_path / "lines.jsonl"),
        (["rehearse", "--experiment", "pretrain-mula-1b", "--device", "meta", "--jsonl", tmp_path / "lines.jsonl"],
         "--jsonl", tmp_path / "lines.jsonl"),
    ]:
        one_line(fails(argv, capsys, 1, f"error: {flag} {path} exists and is not an output of this command"))
    one_line(fails(["report", "--store", store, "--figures", tmp_path, "--out", root], capsys, 1,
                   f"error: --out {root} lies inside the input --store {store}: writing it would damage the input"))
    assert {name: (tmp_path / name).read_text() for name in mine} == mine and root.read_bytes() == before
    report = tmp_path / "report.md"
    for _ in range(2):  # its own output, written again
        assert main(["report", "--store", str(store), "--figures", str(tmp_path), "--out", str(report)]) == 0


def test_figures_replace_only_figures(tmp_path, capsys):
    """A directory of the user's files is refused, untouched; the figures' own directory (its
    marker, or only figure files: one drawn before markers existed) is drawn into again."""
    store = _empty_store(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"my own plot")
    (mine / "notes.txt").write_text("x")
    before = digest(mine)
    one_line(fails(["figures", "--store", store, "--out", mine], capsys, 1,
                   f"figures output {mine} holds 2 entries (loss.png, notes.txt) that `optimus figures` did not make"))
    assert digest(mine) == before
    figs = tmp_path / "figs"
    for only in ("loss.png", "scaling.png"):  # one figure a call, into one directory, as the workflow draws them
        assert main(["figures", "--store", str(store), "--out", str(figs), "--only", only]) == 0
    assert sorted(p.name for p in figs.iterdir()) == [".optimus-output.json", "loss.png", "scaling.png"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "loss.png").write_bytes(b"drawn before markers")
    assert main(["figures", "--store", str(store), "--out", str(old), "--only", "loss.png"]) == 0
    assert (old / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_figures_refuse_an_out_that_is_a_file_or_the_store(tmp_path, capsys):
    store = _empty_store(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    before = digest(store)
    one_line(fails(["figures", "--store", store, "--out", a_file], capsys, 1,
                   f"figures output {a_file} is a file, not a directory"))
    one_line(fails(["figures", "--store", store, "--out", store / "figs"], capsys, 1,
                   f"figures output {store / 'figs'} is inside the results store {store}"))
    assert digest(store) == before and a_file.read_text() == "x"


def test_export_to_an_architecture_that_cannot_hold_the_model_is_a_configuration_error(finished_run, tmp_path,
                                                                                      capsys):
    fails(["export-hf", "--run", finished_run, "--out", tmp_path / "hf", "--arch", "llama"], capsys, 2,
          "configuration error: arch = 'llama': the model's norm is OLMo-1B's non-parametric LayerNorm "
          "(model.norm); only arch='olmo' has it")
    assert not (tmp_path / "hf").exists()


def test_scaling_perfmodel_and_rehearse_inputs_and_settings(tmp_path, capsys, monkeypatch):
    import torch

    fails(["scaling", "--preset", "mula-7b-a1b@laptop", "--devices", 1, "--ep", "abc"], capsys, 2,
          "scaling.ep = 'abc': must be 'all' or an integer >= 1")
    fails(["perfmodel", "--measured", tmp_path / "nope.jsonl"], capsys, 1,
          f"--measured {tmp_path / 'nope.jsonl'}: no such file")
    weak = tmp_path / "weak.jsonl"
    weak.write_text(json.dumps({"suite": "weak", "devices": 2}) + "\n")
    fails(["perfmodel", "--measured", weak], capsys, 1, f"--measured {weak}: no strong-scaling records")
    # beside a file that has them (the workflow passes every benchmark's file), it is simply not used
    strong = Path(__file__).resolve().parents[1] / "bench" / "results" / "distributed-strong-weak-nvidia-h200.jsonl"
    assert main(["perfmodel", "--measured", str(weak), str(strong), "--out", str(tmp_path / "pm.json")]) == 0
    (tmp_path / "pm.json").unlink()
    capsys.readouterr()
    fails(["rehearse", "--ingest", tmp_path / "nope.jsonl", "--store", tmp_path / "s.zarr"], capsys, 1,
          f"--ingest {tmp_path / 'nope.jsonl'}: no such file")
    meta = ["rehearse", "--experiment", "pretrain-mula-1b", "--device", "meta"]
    fails(meta + ["--tiles", 0], capsys, 2, "--tiles 0: tile counts must be >= 1")
    fails(meta + ["--steps", 0], capsys, 2, "configuration error: --steps 0: must be >= 1")
    fails(meta + ["--rank", -1], capsys, 2, "configuration error: --rank -1: must be in [0, ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said = one_line(fails(["rehearse", "--experiment", "pretrain-mula-1b", "--device", "cuda"], capsys, 1,
                          "--device = cuda but no CUDA device is visible"))
    assert "set --device to cpu (or meta" in said and "auto" not in said.split("or set")[-1]  # what rehearse takes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weak.jsonl"]


def test_a_store_that_cannot_be_written_refuses_the_run_before_it_says_running(tokens_dir, tmp_path, capsys,
                                                                               monkeypatch):
    """A read-only store (root ignores file modes, so the refusal is the store's own error, as a
    read-only file system raises it): the run is refused in one line and leaves no run directory
    whose meta.json says "running"."""
    from optimus_core.store import ResultsStore

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "s.zarr" / "runs"))

    monkeypatch.setattr(ResultsStore, "run_writer", read_only)
    one_line(fails(["pretrain", "--preset", "mula-1b@laptop", "--data", tokens_dir, "--out", tmp_path / "r",
                    "--steps", 1, "--store", tmp_path / "s.zarr", *TINY], capsys, 1,
                   f"cannot write {tmp_path / 's.zarr' / 'runs'}: permission denied"))
    assert not (tmp_path / "r").exists()


def test_evaluate_says_what_it_is_doing_and_over_how_many_batches(finished_run, tmp_path, capsys):
    """Nothing lost, class 10: a line as each checkpoint loads and as its held-out loss is taken,
    and the summary names the batches the mean is over (a run's own evaluation reads another
    count, train.eval_batches: the two means differ for that reason)."""
    assert main(["evaluate", "--run", str(finished_run), "--max-batches", "2", "--out", str(tmp_path / "e.json")]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint 1 of 1 (step 1) loading" in err
    assert re.search(r"step 1 held-out loss \d+\.\d{4} over \d+ batches \(\d+ sequences\)", err)
    assert re.search(r"\(held out: \d+ batches, \d+ sequences; at most --max-batches 2 per source\)", out)


def test_figures_with_no_data_are_named_as_notes_not_as_drawn(tmp_path, capsys):
    """Nothing lost, class 11: a figure drawn as a "no data" note is not listed among the drawn
    figures (stdout, one path a line for xargs); it is named apart on stderr with the reason."""
    store, figures = _empty_store(tmp_path), tmp_path / "figs"
    assert main(["figures", "--store", str(store), "--out", str(figures), "--only", "loss.png", "ablation.png"]) == 0
    out, err = capsys.readouterr()
    assert str(figures / "loss.png") not in out.split()
    assert f"{figures / 'loss.png'}: a note, not a figure: no completed run in the store" in err
    assert (figures / "loss.png").is_file()  # still written: a workflow's rule declares the file
