"""optimus_core.atomic: a directory build killed before its cleanup is swept by the next build of
the same output on the host, and nothing else is."""
import os
import signal
import socket
import subprocess
import sys
import textwrap

from optimus_core.atomic import atomic_dir, sweep_dead_builds


def test_a_build_killed_with_sigkill_is_swept_by_the_next_build(tmp_path):
    out = tmp_path / "tokens"
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from optimus_core.atomic import atomic_dir
        with atomic_dir({str(out)!r}) as tmp:
            (tmp / "half.npy").write_bytes(b"x" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
        """)], cwd=os.getcwd())
    assert killed.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".tokens.tmp-")]
    assert len(left) == 1 and (left[0] / "half.npy").exists() and not out.exists()
    with atomic_dir(out) as tmp:
        (tmp / "whole.npy").write_bytes(b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]  # the dead build's tree is gone
    assert (out / "whole.npy").read_bytes() == b"y"


def test_only_dead_builds_of_this_host_are_swept(tmp_path):
    host = socket.gethostname()
    live = tmp_path / f".out.tmp-{os.getpid()}@{host}.abcdefgh"      # this process: building still
    elsewhere = tmp_path / ".out.tmp-1@another-host.abcdefgh"         # another node's: not ours to judge
    other_name = tmp_path / ".out.tmp-abcdefgh"                        # an older name without an owner
    unrelated = tmp_path / f".other.tmp-999999@{host}.abcdefgh"        # another output's
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".out.tmp-{int(dead.stdout)}@{host}.abcdefgh"  # a process that has exited
    for d in (live, elsewhere, other_name, unrelated, gone):
        d.mkdir()
    assert sweep_dead_builds(tmp_path / "out") == [gone]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in (live, elsewhere, other_name,
                                                                                   unrelated))
