"""check_output: a stage replaces only what it made, and never its own input."""
import pytest

from optimus_core.atomic import atomic_dir
from optimus_core.outputs import MARKER, OutputRefused, check_output, mark_output, read_marker


def test_absent_empty_and_marked_outputs_are_accepted(tmp_path):
    check_output(tmp_path / "absent", "tokenize")
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", "tokenize")
    with atomic_dir(tmp_path / "made") as tmp:
        (tmp / "data.bin").write_bytes(b"x")
        mark_output(tmp, "tokenize", {"corpus_dir": tmp_path / "c", "tokenizer": None})
    check_output(tmp_path / "made", "tokenize")
    marker = read_marker(tmp_path / "made")
    assert marker["stage"] == "tokenize" and marker["inputs"] == {"corpus_dir": str(tmp_path / "c")}
    with pytest.raises(OutputRefused, match="is an output of `optimus tokenize`, not of `optimus export-hf`"):
        check_output(tmp_path / "made", "export-hf")


def test_anything_else_is_refused_unless_recognised(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a", "b", "c", "d", "e"):
        (out / name).write_text(name)
    with pytest.raises(OutputRefused, match=r"holds 5 entries \(a, b, c and 2 more\) that `optimus corpus` did not"):
        check_output(out, "corpus")
    check_output(out, "corpus", recognise=lambda p: (p / "a").is_file())  # an output made before markers
    (out / MARKER).write_text("{not json")  # an unreadable marker is no marker
    with pytest.raises(OutputRefused, match="holds 6 entries"):
        check_output(out, "corpus")
    with pytest.raises(OutputRefused, match="is a file"):
        check_output(out / "a", "corpus", recognise=lambda p: True)


@pytest.mark.parametrize("out, given, said", [("x", "x", "is the input"), ("x/y", "x", "is inside the input"),
                                              ("x", "x/y", "holds the input")])
def test_an_output_overlapping_an_input_is_refused_before_anything_else(tmp_path, out, given, said):
    (tmp_path / given).mkdir(parents=True)
    with pytest.raises(OutputRefused, match=said):
        check_output(tmp_path / out, "tokenize", [None, tmp_path / given])
    check_output(tmp_path / "elsewhere", "tokenize", [tmp_path / given])
