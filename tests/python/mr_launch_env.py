"""Under mpirun: every rank's launch_env() matches the MPI world."""

import os

import strata


def test_launch_env_under_mpirun():
    e = strata.launch_env()
    n = int(os.environ["STRATA_TEST_NP"])
    assert e.launcher == "mpirun"
    assert e.world_size == n
    assert 0 <= e.rank < n
    assert e.rank == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert e.local_world_size == n  # one node here
    assert e.node_index == 0
