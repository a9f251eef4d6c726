#!/usr/bin/env python3
"""One rank of run_nccl_busbw.py: NCCL allreduce / allgather / reduce_scatter
through strata (backend nccl) and through torch.distributed (backend nccl),
in the same process on the same GPU and the same libnccl (torch's),
alternating the two sides per size so that drift affects both alike.

Launched under mpirun, rank r on GPU r modulo the visible GPUs (several
ranks share a GPU in NCCL's multi-rank mode); torch.distributed
rendezvouses at MASTER_ADDR:MASTER_PORT, strata through MPI. Rank 0 prints one JSON line per
(op, size) with the best time of each side.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import strata
import strata.nccl

from bench_util import bus_factor  # this script's directory is on sys.path


def buffers(op, nbytes, n, device):
    count = max(nbytes // 4, n)
    count -= count % n
    if op == "allreduce":
        return torch.ones(count, device=device), torch.empty(count, device=device)
    if op == "allgather":
        return torch.ones(count // n, device=device), torch.empty(count, device=device)
    return torch.ones(count, device=device), torch.empty(count // n, device=device)


def strata_op(group, op, a, b):
    if op == "allreduce":
        return group.all_reduce(b, async_op=True)
    if op == "allgather":
        return group.all_gather(b, a, async_op=True)
    return group.reduce_scatter(b, a, async_op=True)


def torch_op(op, a, b):
    if op == "allreduce":
        return dist.all_reduce(b, async_op=True)
    if op == "allgather":
        return dist.all_gather_into_tensor(b, a, async_op=True)
    return dist.reduce_scatter_tensor(b, a, async_op=True)


def timed(start_one, iters):
    """Seconds per operation: `iters` launched back to back, then synchronised."""
    for _ in range(3):
        start_one().wait()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    works = [start_one() for _ in range(iters)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="allreduce,allgather,reduce_scatter")
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=device)
    world = strata.init(backend="nccl", timeout=120)
    group = world.group("world")
    nccl = strata.nccl.library()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            nbytes = int(size[:-1]) * mult[size[-1]] if size[-1] in mult else int(size)
            a, b = buffers(op, nbytes, n, device)
            moved = b.numel() * 4 if op != "reduce_scatter" else a.numel() * 4
            iters = max(5, min(200, (2 << 30) // max(moved, 1)))
            best = {"strata": float("inf"), "torch": float("inf")}
            for _ in range(args.repeats):
                best["strata"] = min(best["strata"], timed(lambda: strata_op(group, op, a, b), iters))
                best["torch"] = min(best["torch"], timed(lambda: torch_op(op, a, b), iters))
            if rank == 0:
                factor = bus_factor(op, n) if n > 1 else 1.0
                print(json.dumps({"op": op, "bytes": moved, "ranks": n,
                                  "metric": "busbw" if n > 1 else "algbw",
                                  "strata": moved / best["strata"] * factor / 1e9,
                                  "torch": moved / best["torch"] * factor / 1e9,
                                  "nccl": "%d.%d.%d" % nccl["version"]}), flush=True)
    world.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
