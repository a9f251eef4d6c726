"""Under mpirun: strata.topology.check_consistency compares every rank's
effective NCCL settings over a real communicator and names the ranks and
variables that differ; the same report on every rank."""

import os

import numpy as np

import strata


def _env(extra):
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    base.update(extra)
    return base


def test_consistent_and_inconsistent_settings():
    with strata.init(timeout=120) as world:
        g = world.group()
        n = world.size
        same = strata.topology.check_consistency(g, _env({"NCCL_IB_HCA": "mlx5_0"}))
        assert same["consistent"], same["text"]
        assert same["groups"] == [list(range(n))]
        assert same["differences"] == []

        # The last rank sets NCCL_IB_HCA differently and adds NCCL_DEBUG.
        odd = n - 1
        extra = {"NCCL_IB_HCA": "mlx5_1", "NCCL_DEBUG": "INFO"} if world.rank == odd else {
            "NCCL_IB_HCA": "mlx5_0"}
        r = strata.topology.check_consistency(g, _env(extra))
        assert not r["consistent"]
        assert r["groups"] == [list(range(odd)), [odd]], r["groups"]
        diffs = {d["name"]: d["values"] for d in r["differences"]}
        assert diffs["NCCL_IB_HCA"] == ["mlx5_0", "mlx5_1"], diffs
        assert diffs["NCCL_DEBUG"] == ["", "INFO"], diffs
        assert f"{odd}" in r["text"] and "NCCL_IB_HCA" in r["text"]

        # Every rank got the same report.
        mine = np.frombuffer(r["text"].encode().ljust(512, b"\0")[:512], dtype=np.uint8).copy()
        everyone = np.zeros((n, 512), dtype=np.uint8)
        g.all_gather(everyone, mine)
        assert all((everyone[i] == everyone[0]).all() for i in range(n))

        # Ignored variables may differ.
        r = strata.topology.check_consistency(g, _env(extra), ignore=["NCCL_IB_HCA", "NCCL_DEBUG"])
        assert r["consistent"], r["text"]
