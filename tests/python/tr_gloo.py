"""Under torchrun (2, 4 and 8 processes): strata.init(backend="auto") picks
Gloo and bootstraps through torchrun's TCPStore with O(1) store operations
per rank; collectives match references computed here; strata's Gloo and
torch.distributed's gloo work side by side in one process.

Every rank runs every test in the same order; a test's verdict is agreed
over the ranks at its end so a failure on one rank cannot strand the others.
"""

import os

import pytest
import torch
import torch.distributed as dist

import strata
from strata import store as sstore

N = int(os.environ["STRATA_TEST_NP"])
RANK = int(os.environ["RANK"])


def agree(world, problems):
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    assert not problems, problems[:5]
    assert flag.item() == 0, "failed on another rank (see its report)"


class CountingAdapter(sstore._TorchStoreAdapter):
    """Counts the store operations the bootstrap makes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def set(self, *a):
        self._count("set")
        return super().set(*a)

    def get(self, *a):
        self._count("get")
        return super().get(*a)

    def wait(self, *a):
        self._count("wait")
        return super().wait(*a)

    def add(self, *a):
        self._count("add")
        return super().add(*a)

    def compare_set(self, *a):
        self._count("compare_set")
        return super().compare_set(*a)


def test_launch_is_torchrun_and_auto_picks_gloo():
    launch = strata.launch_env()
    assert launch.launcher == "torchrun", launch
    assert (launch.rank, launch.world_size) == (RANK, N)
    assert launch.master_addr and launch.master_port > 0, launch
    assert strata._strata.resolve_backend(launch, "auto") == "gloo"


def test_init_bootstraps_through_torchruns_store_and_collectives_match():
    with strata.init(timeout=120) as w:
        g = w.group()
        problems = []
        if (w.rank, w.size, g.backend) != (RANK, N, "gloo"):
            problems.append(f"world {w.rank}/{w.size} on {g.backend}")
        # torchrun --standalone: every process on this host.
        want = "gloo, tcp" if os.environ.get("STRATA_GLOO_CMA") == "0" else "gloo, host copies"
        if g.transport != want:
            problems.append(f"transport {g.transport!r}, expected {want!r}")
        for n in (1, 1000, 1 << 18):
            x = torch.arange(n, dtype=torch.float32) + w.rank
            g.all_reduce(x)
            want = torch.arange(n, dtype=torch.float32) * N + N * (N - 1) / 2
            if not torch.equal(x, want):
                problems.append(f"allreduce of {n}: {x[:4]} != {want[:4]}")
        parts = torch.empty(N * 3, dtype=torch.int64)
        g.all_gather(parts, torch.full((3,), w.rank, dtype=torch.int64))
        if not torch.equal(parts, torch.arange(N).repeat_interleave(3)):
            problems.append(f"allgather: {parts}")
        agree(w, problems)


def test_bootstrap_makes_o1_store_operations_per_rank():
    launch = strata.launch_env()
    keep, _ = sstore.connect_torchrun(launch, 60)
    adapter = CountingAdapter(keep, "counting torchrun store", "strata-count/")
    store = strata._strata._python_store(adapter)
    with strata.init(timeout=120, store=store) as w:
        ops = sum(adapter.calls.values())
        comms = len(w.group_names())  # the root and at most one per group
        # Every rank publishes its address and reads its column of peers:
        # 2 operations per communicator whatever the world size. Rank 0
        # publishes the columns, reading N records and writing N columns:
        # linear in N. Nobody does N^2.
        bound = 1 + comms * (2 + 2 * N if w.rank == 0 else 2)
        problems = []
        if ops > bound:
            problems.append(f"rank {w.rank}: bootstrap took {ops} store operations "
                            f"({adapter.calls}) for {comms} communicators of <= {N} ranks; "
                            f"bound {bound}")
        agree(w, problems)


def test_torch_gloo_and_strata_gloo_in_one_process():
    """torch's libtorch_cpu exports its own gloo:: symbols; strata's Gloo is
    in a plugin loaded RTLD_LOCAL, so both run in one process without one
    binding to the other's code."""
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    try:
        with strata.init(timeout=120, backend="gloo") as w:
            g = w.group()
            problems = []
            for step in range(3):
                n = 1000 * (step + 1) + 7
                a = torch.arange(n, dtype=torch.float32) * (w.rank + 1)
                b = a.clone()
                g.all_reduce(a)
                dist.all_reduce(b)
                want = torch.arange(n, dtype=torch.float32) * (N * (N + 1) / 2)
                if not torch.equal(a, want):
                    problems.append(f"strata step {step}: {a[:4]} != {want[:4]}")
                if not torch.equal(b, want):
                    problems.append(f"torch step {step}: {b[:4]} != {want[:4]}")
            maps = open("/proc/self/maps").read()
            for lib in ("libstrata_gloo", "libtorch_cpu"):
                if lib not in maps:
                    problems.append(f"{lib} is not loaded in this process")
            agree(w, problems)
    finally:
        dist.destroy_process_group()


def test_a_second_world_bootstraps_again_in_the_same_process():
    for _ in range(2):
        with strata.init(strata.Mesh(N, tp=2) if N % 2 == 0 else None, timeout=120) as w:
            x = torch.ones(16)
            w.group().all_reduce(x)
            agree(w, [] if torch.all(x == N) else [f"{x[:2]}"])
