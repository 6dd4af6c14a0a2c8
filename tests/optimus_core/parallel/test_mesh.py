"""Launcher environments, the group layout and bad launches: pure logic, no processes."""
import pytest

from optimus_core.config import ConfigError, ParallelConfig
from optimus_core.parallel.launch import spawn_local
from optimus_core.parallel.mesh import (Mesh, check_rendezvous, group_layout, init_distributed, node_local_problem,
                                     read_launch_env, shutdown)


def test_torchrun_variables():
    env = read_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "torchrun")


def test_pals_pmi_variables_as_aurora_mpiexec_sets_them():
    env = read_launch_env({"PMI_RANK": "13", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "1", "PMI_LOCAL_RANK": "9"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (13, 24, 1, "pmi")
    assert read_launch_env({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "3"}).local_rank == 3


def test_open_mpi_variables():
    env = read_launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (2, 4, 0, "ompi")


def test_torchrun_wins_over_mpi_and_nothing_is_a_world_of_one():
    env = read_launch_env({"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert (env.rank, env.launcher) == (1, "torchrun")
    assert read_launch_env({}).world_size == 1


def test_bad_rank_values_name_the_variable():
    with pytest.raises(ConfigError, match="PMI_RANK"):
        read_launch_env({"PMI_RANK": "x", "PMI_SIZE": "2"})
    with pytest.raises(ConfigError, match="rank 4, world size 4"):
        read_launch_env({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize("world, ep, ep_groups, edp_groups", [
    (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (4, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (4, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (6, 3, [[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
])
def test_group_layout(world, ep, ep_groups, edp_groups):
    got_ep, got_edp = group_layout(world, ep, 12)
    assert (got_ep, got_edp) == (ep_groups, edp_groups)
    # every rank in exactly one group of each kind, and the two kinds meet in one rank
    assert sorted(r for g in got_ep for r in g) == list(range(world))
    assert all(len(set(a) & set(b)) == 1 for a in got_ep for b in got_edp)


def test_mesh_ranks_match_layout():
    ep_groups, edp_groups = group_layout(8, 2, 8)
    for rank in range(8):
        mesh = Mesh(rank, 8, rank, 2, None, "gloo")
        assert ep_groups[mesh.expert_dp_rank][mesh.ep_rank] == rank
        assert edp_groups[mesh.ep_rank][mesh.expert_dp_rank] == rank
        assert mesh.expert_dp_size == 4


def test_bad_layouts_fail_before_any_collective():
    with pytest.raises(ConfigError, match=r"parallel.ep = 3: must divide the world size \(4 ranks\)"):
        init_distributed(ParallelConfig(ep=3), n_experts=12, device="cpu",
                         env={"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="more expert-parallel ranks than experts"):
        init_distributed(ParallelConfig(ep=4), n_experts=2, device="cpu",
                         env={"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_missing_master_addr_under_mpiexec_is_a_clear_error():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "PALS_LOCAL_RANKID": "1"}
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT not set under pmi"):
        init_distributed(ParallelConfig(ep=1), n_experts=4, device="cpu", env=env)
    check_rendezvous(read_launch_env({"PMI_RANK": "0", "PMI_SIZE": "1"}))  # a world of one needs none


def test_mpiexec_in_a_pbs_job_finds_rank_0_in_the_node_file(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x4102c5s0b0n0\nx4102c5s1b0n0\n")
    pbs = {"PMI_SIZE": "24", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "123456.aurora-pbs-0001"}
    ranks = [read_launch_env({**pbs, "PMI_RANK": str(r), "PALS_LOCAL_RANKID": str(r % 12)}) for r in (0, 13, 23)]
    assert {(e.master_addr, e.master_port) for e in ranks} == {(ranks[0].master_addr, ranks[0].master_port)}
    assert ranks[0].master_addr == "x4102c5s0b0n0" and 29500 <= int(ranks[0].master_port) < 30500
    check_rendezvous(ranks[1])  # nothing missing
    # what the user exports wins; a node file that is empty or gone leaves the clear error
    given = read_launch_env({**pbs, "PMI_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert (given.master_addr, given.master_port) == ("h", "7")
    assert read_launch_env({**pbs, "PMI_RANK": "0", "MASTER_PORT": "7"}).master_port == "7"
    nodefile.write_text("")
    with pytest.raises(ConfigError, match="no \\$PBS_NODEFILE to read rank 0's host from"):
        check_rendezvous(read_launch_env({**pbs, "PMI_RANK": "1"}))


def test_world_of_one_creates_no_process_group():
    import torch.distributed as dist

    mesh = init_distributed(ParallelConfig(ep=1), n_experts=4, device="cpu", env={})
    assert not mesh.distributed and mesh.ep_group is None and not dist.is_initialized()


def test_at_12288_ranks_a_rank_joins_six_groups_and_creates_few():
    """Mula-220B-A10B on 12288 tiles (ep 32, shard blocks of 384): every rank is a member of the
    world and one group of each kind -- EP, expert-dp, shard, replicate, expert-shard -- whatever
    the world size, and the new_group calls (cheap for non-members: no barrier, no connection)
    grow as W / ep + W / S x ep, not with W squared."""
    from optimus_core.parallel.mesh import group_layout, sharding_layout

    W, ep, S = 12288, 32, 384
    ep_groups, edp_groups = group_layout(W, ep, 1024, S)
    layouts = {"ep": ep_groups, "expert_dp": edp_groups, **sharding_layout(W, ep, S)}
    for rank in (0, 1, 383, 384, 6000, W - 1):
        member_of = {kind: sum(rank in ranks for ranks in groups) for kind, groups in layouts.items()}
        assert member_of == dict.fromkeys(layouts, 1), (rank, member_of)
    calls = sum(len(groups) for groups in layouts.values())
    assert calls == W // ep + ep + W // S + S + W // S * ep == 1856 < W // 4


@pytest.mark.parametrize("ep, rank, local_rank, local_world, spans", [
    (2, 5, 1, 4, None), (4, 4, 0, 4, None), (12, 13, 1, 12, None),  # blocks of a node
    (1, 3, 0, 2, None), (2, 3, 3, None, None),  # no EP group; no launcher word on nodes
    (8, 9, 9, 12, "spans 2 nodes of 12"), (24, 0, 0, 12, "spans 2 nodes of 12"),
    (4, 1, 0, 2, "spans 2 nodes of 2"),
    (2, 1, 0, 2, "consecutive ranks are not on one node"),  # round-robin placement
])
def test_an_ep_group_must_sit_on_one_node(ep, rank, local_rank, local_world, spans):
    problem = node_local_problem(ep, rank, local_rank, local_world)
    assert problem is None if spans is None else spans in problem


def _two_ranks_per_node(ep, across, out):
    import os

    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")  # a launcher: 2 ranks per node
    try:
        mesh = init_distributed(ParallelConfig(ep=ep, ep_across_nodes=across), n_experts=4, device="cpu")
    except ConfigError as e:
        open(f"{out}/{rank}", "w").write(str(e))
        return
    open(f"{out}/{rank}", "w").write(f"ok {list(mesh.ep_ranks)}")
    shutdown(mesh)


@pytest.mark.parametrize("ep, across, want", [(2, False, "ok"), (4, False, "parallel.ep = 4: "), (4, True, "ok")])
def test_ep_groups_are_node_local_under_a_launcher_of_two_ranks_per_node(tmp_path, ep, across, want):
    spawn_local(_two_ranks_per_node, 4, (ep, across, str(tmp_path)), start_method="fork")
    said = [(tmp_path / str(r)).read_text() for r in range(4)]
    assert all(line.startswith(want) for line in said), said  # every rank, not only the one that saw it
    if want == "ok" and ep == 2:
        assert said == ["ok [0, 1]", "ok [0, 1]", "ok [2, 3]", "ok [2, 3]"]  # each group one node's ranks
    if want != "ok":
        assert "parallel.ep_across_nodes=true" in said[0]
