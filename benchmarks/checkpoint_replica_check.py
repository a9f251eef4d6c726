#!/usr/bin/env python3
"""What the replica check of a multi-rank strata.checkpoint save costs.

Before a save is staged, every rank digests the tensors it holds as
replicas (xxh3-64 per 8 MiB chunk, on the staging threads) and the ranks
holding the same replicas compare the digests (two small all-reduces per
replica group; see strata::CheckReplicasMatch). This script saves a model of
strata.nn layers (about --mb MB of global parameters) with
``AsyncCheckpointer(world=...)`` and reports, per save, the seconds save()
spent in the check beside the seconds it spent staging (copying this rank's
share into staging memory), both from ``status()`` of the same saves, and
the digest throughput of one process.

    mpirun -np 4 python3 benchmarks/checkpoint_replica_check.py --tp 1 [--mb 384] [--repeats 4]
"""

import argparse
import shutil
import statistics
import tempfile
import time

import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn
from strata import _strata


def shared_dir(world):
    name = tempfile.mkdtemp(prefix="strata-replica-bench-") if world.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    world.group("world").broadcast(buf, src=0)
    return bytes(buf[buf != 0].tolist()).decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mb", type=float, default=384.0, help="global parameter MB (fp32)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = strata.launch_env()
    world = strata.init(strata.Mesh(env.world_size, tp=args.tp))
    h = args.hidden
    per_layer = 2 * h * 4 * h * 4 / 1e6  # fc1 and fc2 weights, fp32
    layers = max(1, round(args.mb / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[snn.ParallelMLP(h, 4 * h, group=world) for _ in range(layers)])
    sd = model.state_dict()
    mine = sum(t.numel() * t.element_size() for t in sd.values())
    glob = sum(p.numel() * p.element_size() * (p.tensor_parallel_sharding[2]
                                               if hasattr(p, "tensor_parallel_sharding") else 1)
               for p in model.parameters())
    directory = shared_dir(world)
    checks, stagings, saves = [], [], []
    with ckpt.AsyncCheckpointer(directory, world=world, keep_last=1) as saver:
        for step in range(args.repeats + 1):
            start = time.perf_counter()
            saver.save(model.state_dict(), step=step)
            blocked = time.perf_counter() - start
            saver.wait()
            st = saver.status()
            assert st["last_step"] == step
            if step:  # the first save also allocates the staging memory
                checks.append(st["replica_check_seconds"])
                stagings.append(st["staging_seconds"])
                saves.append(blocked)
    # Digest throughput of this process alone, on the same tensors.
    world.group("world").barrier()
    bufs = [(t.data_ptr(), t.numel() * t.element_size()) for t in sd.values()]
    if world.rank == 0:
        rates = {}
        for threads in (1, 4):
            t0 = time.perf_counter()
            _strata._content_digests(bufs, threads)
            rates[threads] = mine / (time.perf_counter() - t0) / 1e9
    world.group("world").barrier()
    if world.rank == 0:
        c, s, b = (statistics.median(v) for v in (checks, stagings, saves))
        m = world.mesh
        print(f"{world.size} ranks, tp={m.tp} dp={m.dp}; {layers} ParallelMLP({h}, {4 * h}); "
              f"global {glob / 1e6:.0f} MB, this rank holds {mine / 1e6:.0f} MB; "
              f"median of {args.repeats} saves")
        print(f"  save() blocked          {b * 1e3:8.1f} ms")
        print(f"  of which replica check  {c * 1e3:8.1f} ms  ({c / b:.0%} of save(); "
              f"{c / s:.2f}x the staging copy)")
        print(f"  of which staging copy   {s * 1e3:8.1f} ms")
        print(f"  digest throughput, one process alone: {rates[1]:.1f} GB/s on 1 thread, "
              f"{rates[4]:.1f} GB/s on 4")
        shutil.rmtree(directory, ignore_errors=True)
    world.destroy()


if __name__ == "__main__":
    main()
