"""strata.launch_env() from Python, for each launcher and each inconsistency."""

import os

import pytest

import strata

MPIRUN = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[12-13]",
}


def test_each_launcher():
    e = strata.launch_env(MPIRUN)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.node_index) == ("mpirun", 3, 8, 3, 0)
    e = strata.launch_env(TORCHRUN)
    assert (e.launcher, e.rank, e.node_index, e.master_addr, e.master_port) == (
        "torchrun", 5, 1, "node0", 29500)
    e = strata.launch_env(SLURM)
    assert (e.launcher, e.rank, e.local_world_size, e.master_addr) == ("slurm", 6, 4, "gpu12")
    e = strata.launch_env({})
    assert (e.launcher, e.rank, e.world_size) == ("none", 0, 1)


def test_local_ranks_in_the_order_open_mpi_5_gives_them():
    # Plain `mpirun -np 4` (binding, no --bind-to none): ranks 0..3 are local
    # ranks 0, 2, 1, 3 on one node.
    for rank, local in enumerate([0, 2, 1, 3]):
        e = strata.launch_env({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
                               "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
        assert (e.rank, e.local_rank, e.node_index, e.num_nodes, e.node_index_exact) == (
            rank, local, 0, 1, True)


@pytest.mark.parametrize(
    "env,message",
    [
        ({**MPIRUN, "OMPI_COMM_WORLD_RANK": "8"}, r"rank 8 is not in \[0, world size 8\)"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT is not set"),
        ({**TORCHRUN, "WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
        ({**MPIRUN, "RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
         "launchers disagree"),
        ({**SLURM, "STRATA_LAUNCHER": "pbs"}, "'pbs' is not one of"),
    ],
)
def test_inconsistent_environments(env, message):
    with pytest.raises(strata.LaunchError, match=message):
        strata.launch_env(env)


def test_reads_process_environment(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OMPI_", "SLURM_", "PMIX_")) or k in TORCHRUN:
            monkeypatch.delenv(k)
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert strata.launch_env().rank == 5
