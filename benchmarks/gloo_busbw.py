#!/usr/bin/env python3
"""The peer of comm_busbw: torch.distributed with the gloo backend, same
operations, sizes, iteration counts and output format (nccl-tests columns).

Launched by run_busbw.py under mpirun (ranks from OMPI_COMM_WORLD_*; the
rendezvous port from MASTER_PORT):

    MASTER_PORT=29500 mpirun -np 4 python3 benchmarks/gloo_busbw.py --op allreduce

or under torchrun, where ``--lib`` names one or more of ``torch``, ``strata``
(strata's Python API on its Gloo backend, bootstrapped through torchrun's
store: strata.init(backend="gloo")) and ``strata-tcp`` (the same with
STRATA_GLOO_CMA=0: Gloo's transport even between ranks of one host), all
initialised in the same processes; for each operation and size the job
runs them in turn, ``--rounds`` times, each round starting with the next
side, so every side sees the machine in the same state and follows each of
the others as often, and prints each side's best and median round. All sides
pay the same Python call per operation:

    torchrun --standalone --nproc-per-node 4 benchmarks/gloo_busbw.py \
        --lib strata,torch,strata-tcp --rounds 5
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from bench_util import bus_factor  # benchmarks/, the script's directory


def parse_bytes(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult != 1 else s) * mult


def iters_for(bytes_, fixed):
    if fixed:
        return fixed
    return max(5, min(100, (256 << 20) // max(bytes_, 1)))


def run_strata(g, op, a, b, rank, n):
    """The same operations through strata (a strata.Group)."""
    if op == "allreduce":
        g.all_reduce(b)  # in place, as gloo's
    elif op == "allgather":
        per = b.numel() // n
        g.all_gather(b[:per * n], a[:per])
    elif op == "reduce_scatter":
        per = a.numel() // n
        g.reduce_scatter(b[:per], a[:per * n])
    elif op == "broadcast":
        g.broadcast(b, src=0)
    elif op == "alltoall":
        g.all_to_all_single(b, a)
    elif op == "sendrecv":
        works = [g.recv(b, (rank - 1) % n, async_op=True), g.send(a, (rank + 1) % n, async_op=True)]
        for w in works:
            w.wait()
    else:
        raise SystemExit(f"unknown op {op}")


def run_once(op, a, b, rank, n):
    if op == "allreduce":
        # gloo reduces in place; no copy is charged to it (strata's figure is
        # out of place, so the comparison does not favour strata).
        dist.all_reduce(b)
    elif op == "allgather":
        per = b.numel() // n
        dist.all_gather_into_tensor(b[:per * n], a[:per])
    elif op == "reduce_scatter":
        per = a.numel() // n
        dist.reduce_scatter_tensor(b[:per], a[:per * n])
    elif op == "broadcast":
        dist.broadcast(b, src=0)
    elif op == "alltoall":
        dist.all_to_all_single(b, a)
    elif op == "sendrecv":
        reqs = [dist.irecv(b, (rank - 1) % n), dist.isend(a, (rank + 1) % n)]
        for r in reqs:
            r.wait()
    else:
        raise SystemExit(f"unknown op {op}")


class Side:
    """One library under test: how to run an operation, a barrier, and a
    max-reduction of the measured time."""

    def __init__(self, name, one, barrier, slowest):
        self.name, self.one, self.barrier, self.slowest = name, one, barrier, slowest


def strata_side(name, rank, n, tcp):
    import strata
    before = os.environ.get("STRATA_GLOO_CMA")
    if tcp:
        os.environ["STRATA_GLOO_CMA"] = "0"  # read when the world connects
    try:
        world = strata.init(backend="gloo", timeout=600)
    finally:
        if before is None:
            os.environ.pop("STRATA_GLOO_CMA", None)
        else:
            os.environ["STRATA_GLOO_CMA"] = before
    g = world.group()
    return world, Side(name, lambda op, a, b: run_strata(g, op, a, b, rank, n), g.barrier,
                       lambda us: g.all_reduce(us, op="max"))


def torch_side(rank, n, torchrun):
    if torchrun:
        dist.init_process_group("gloo")  # env://: torchrun's store
    else:
        port = os.environ.get("MASTER_PORT", "29500")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
    return Side("torch", lambda op, a, b: run_once(op, a, b, rank, n), dist.barrier,
                lambda us: dist.all_reduce(us, op=dist.ReduceOp.MAX))


def time_side(side, op, a, b, warmup, iters):
    """Microseconds per operation on the slowest rank."""
    for _ in range(warmup):
        side.one(op, a, b)
    side.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        side.one(op, a, b)
    us = torch.tensor([(time.perf_counter() - start) / iters * 1e6], dtype=torch.float64)
    side.slowest(us)
    return us.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="allreduce,allgather,reduce_scatter,broadcast,alltoall,sendrecv")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lib", default="torch",
                    help="comma-separated: torch, strata, strata-tcp (several: torchrun only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="each side's runs per operation and size, taken in turn")
    args = ap.parse_args()
    libs = args.lib.split(",")
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun:
        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        if libs != ["torch"]:
            raise SystemExit("gloo_busbw: under mpirun only --lib torch (strata: comm_busbw)")
    worlds, sides = [], []
    for lib in libs:
        if lib == "torch":
            sides.append(torch_side(rank, n, torchrun))
        elif lib in ("strata", "strata-tcp"):
            world, side = strata_side(lib, rank, n, tcp=lib == "strata-tcp")
            worlds.append(world)
            sides.append(side)
        else:
            raise SystemExit(f"gloo_busbw: unknown --lib {lib}")
    if rank == 0:
        print(f"# gloo_busbw: {n} ranks, sides {','.join(libs)} (torch {torch.__version__}), "
              f"dtype float, op sum, {args.rounds} round(s) in turn; time = best round, "
              "median = median round", flush=True)
        print("#%11s %12s %6s %15s %10s %10s %10s %6s %10s %s" % (
            "size", "count", "type", "op", "time", "algbw", "busbw", "#wrong", "median", "side"))
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    for op in args.op.split(","):
        size = lo
        while size <= hi:
            count = size // 4
            count -= count % n
            a = (torch.arange(count, dtype=torch.float32) + rank) % 5
            b = torch.zeros(count, dtype=torch.float32)
            iters = iters_for(size, args.iters)
            times = {side.name: [] for side in sides}
            for r in range(args.rounds):
                # Each round starts with the next side: a side runs faster
                # after another library's rounds than after its own (the
                # scheduler's state, measured for send/recv), so a fixed
                # order would favour whichever side always follows another.
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    times[side.name].append(time_side(side, op, a, b, args.warmup, iters))
            nbytes = count * 4
            for side in sides:
                t = min(times[side.name])
                median = sorted(times[side.name])[len(times[side.name]) // 2]
                algbw = nbytes / (t * 1e-6) / 1e9
                if rank == 0:
                    print("%12d %12d %6s %15s %10.1f %10.3f %10.3f %6d %10.1f %s" % (
                        nbytes, count, "float", op, t, algbw, algbw * bus_factor(op, n), -1,
                        median, side.name), flush=True)
            size *= 2
    for world in worlds:
        world.destroy()
    if "torch" in libs:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
