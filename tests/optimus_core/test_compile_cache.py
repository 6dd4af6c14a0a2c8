"""A job's compile cache: the shared one filled in place by the warm-up job, a copy on each node
for every other job (made once, by the node's local rank 0), nothing changed without one."""
import threading
import time

import pytest

from optimus_core.compile_cache import use_compile_cache
from optimus_core.config import ConfigError


def test_without_a_shared_cache_nothing_changes():
    env = {"TRITON_CACHE_DIR": "/mine"}
    assert use_compile_cache(0, env) is None and env == {"TRITON_CACHE_DIR": "/mine"}


def test_the_warm_up_job_compiles_into_the_shared_cache(tmp_path):
    env = {"OPTIMUS_COMPILE_CACHE": str(tmp_path / "shared"), "OPTIMUS_COMPILE_CACHE_FILL": "1"}
    assert use_compile_cache(0, env) == tmp_path / "shared"
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "shared" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared" / "inductor")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="OPTIMUS_COMPILE_CACHE = .*file/shared: cannot write there"):
        use_compile_cache(0, {"OPTIMUS_COMPILE_CACHE": str(tmp_path / "file" / "shared"),
                              "OPTIMUS_COMPILE_CACHE_FILL": "1"})


def test_each_node_copies_the_warm_cache_once_and_its_ranks_use_the_copy(tmp_path):
    shared = tmp_path / "shared"
    (shared / "triton" / "abc").mkdir(parents=True)
    (shared / "triton" / "abc" / "kernel.bin").write_bytes(b"compiled")
    base = {"OPTIMUS_COMPILE_CACHE": str(shared), "OPTIMUS_NODE_LOCAL": str(tmp_path / "node"), "PBS_JOBID": "42.pbs"}
    # local rank 1 starts first and waits for rank 0's copy
    env1, seen = dict(base), {}
    waiter = threading.Thread(target=lambda: seen.update(where=use_compile_cache(1, env1, wait_s=30, poll_s=0.01)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    env0 = dict(base)
    where = use_compile_cache(0, env0)
    waiter.join(10)
    assert seen["where"] == where and where.parent == tmp_path / "node" and where.name.endswith("-42")
    assert (where / "triton" / "abc" / "kernel.bin").read_bytes() == b"compiled"
    assert env0["TRITON_CACHE_DIR"] == env1["TRITON_CACHE_DIR"] == str(where / "triton")
    # the copy is the job's own: the shared cache is never written by it
    (where / "triton" / "new").mkdir()
    assert not (shared / "triton" / "new").exists()
    # a node whose storage cannot be written: one line naming it
    (tmp_path / "flat").write_text("x")
    with pytest.raises(ConfigError, match="OPTIMUS_NODE_LOCAL = .*flat: cannot write there"):
        use_compile_cache(0, {**base, "OPTIMUS_NODE_LOCAL": str(tmp_path / "flat"), "PBS_JOBID": "43"})
    # a rank whose node's copy never comes says so, instead of hanging
    with pytest.raises(TimeoutError, match="did not appear"):
        use_compile_cache(1, {**base, "PBS_JOBID": "44"}, wait_s=0.05, poll_s=0.01)


def test_no_warm_cache_yet_still_gives_each_job_its_own_node_local_one(tmp_path):
    env = {"OPTIMUS_COMPILE_CACHE": str(tmp_path / "absent"), "OPTIMUS_NODE_LOCAL": str(tmp_path / "node")}
    where = use_compile_cache(0, env)
    assert where.is_dir() and env["TRITON_CACHE_DIR"] == str(where / "triton")
