"""Failures of the environment are one line naming the path and what to do, with the status the
README promises, never a traceback: a full disk (a plain write's, numpy's short write in a
tokenize worker, a checkpoint's), Ctrl-C in a command that is not a training run, export-hf
without transformers."""
import errno
import signal
from argparse import Namespace

import pytest

from optimus_core.atomic import atomic_dir
from workflow import cli
from workflow.failures import user_failure


def test_a_write_out_of_room_inside_an_output_names_the_output(tmp_path):
    out = tmp_path / "corpus"
    with pytest.raises(OSError) as caught:
        with atomic_dir(out) as tmp:
            (tmp / "part.json.gz").write_bytes(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")  # a plain write() names no file
    assert caught.value.filename == str(out) and not out.exists()
    with pytest.raises(OSError) as caught:
        with atomic_dir(out) as tmp:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "train" / "a.npy"))
    assert caught.value.filename == str(out / "train" / "a.npy")  # the user's path, not the temporary one
    status, line = user_failure(Namespace(command="corpus"), caught.value)
    assert status == 1 and line.startswith(f"optimus corpus: error: no space left writing {out}/train/a.npy")


def test_a_short_write_of_tokens_is_a_full_disk_naming_the_file(tmp_path, monkeypatch):
    from stages import tokenize

    class Short:
        def tofile(self, f):
            raise OSError("78455 requested and 2048 written")  # numpy's: no errno, no path

    monkeypatch.setattr(tokenize.np, "fromiter", lambda *a, **k: Short())
    job = Namespace(out=tmp_path, dtype="uint16", eos_id=0)
    corpus_file = Namespace(rel="a/b.jsonl", source="a")
    monkeypatch.setattr(tokenize, "_output_stem", lambda f: "a/b")
    writer = tokenize._SplitWriter(job, "train", corpus_file)
    with pytest.raises(OSError) as caught:
        writer.add([("d1", 3, [1, 2, 3])])
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "train/a/b.npy")
    assert "78455 requested" in caught.value.strerror


def test_tokenize_workers_leave_ctrl_c_to_the_parent(tmp_path, monkeypatch):
    from stages import tokenize

    monkeypatch.setattr(tokenize, "load_tokenizer", lambda path: object())
    before = signal.getsignal(signal.SIGINT)
    try:
        tokenize._init_worker("tok.json")
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_in_a_command_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with(parser(), "presets", interrupted))
    assert cli.main(["presets"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["optimus presets: interrupted (Ctrl-C); nothing unfinished was published: rerun it to start again"]


def _with(parser, command, func):
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices[command].set_defaults(func=func)
    return parser


def test_a_checkpoint_without_room_is_one_line(tmp_path):
    from optimus_core.train.disk_space import DiskFullError

    status, line = user_failure(Namespace(command="pretrain"), DiskFullError(f"{tmp_path}: 10 GiB needed, 1 free"))
    assert status == 1 and line == f"optimus pretrain: error: {tmp_path}: 10 GiB needed, 1 free"


def test_export_hf_without_transformers_says_what_to_install(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert cli.main(["export-hf", "--run", str(tmp_path), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "export-hf needs transformers" in err[0] and "pip install -e '.[eval]'" in err[0]
    assert not (tmp_path / "hf").exists()
