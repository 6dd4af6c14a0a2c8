"""optimus_core.paths.missing: what is at a path that is not the kind a command was given it as."""
import pytest

from optimus_core.paths import missing


def test_says_what_is_there_instead(tmp_path):
    (tmp_path / "f").write_text("x")
    assert missing(tmp_path / "nope", "file") == "no such file"
    assert missing(tmp_path, "file") == "is a directory, not a file"
    assert missing(tmp_path / "nope", "directory") == "no such directory"
    assert missing(tmp_path / "f", "directory") == "is a file, not a directory"
    with pytest.raises(ValueError, match="kind = 'dir'"):
        missing(tmp_path, "dir")
