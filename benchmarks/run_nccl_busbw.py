#!/usr/bin/env python3
"""NCCL bus bandwidth: strata's nccl backend next to torch.distributed with
NCCL, in the same processes, on the GPUs present (one rank per GPU, under
mpirun). Target: strata >= 0.95x torch for allreduce, allgather and
reduce_scatter.

    python3 benchmarks/run_nccl_busbw.py [--build build] [--sizes 1M,16M,64M,256M]

Without a GPU it says so and writes nothing. With a single GPU the figure
is algbw (bytes / time): busbw's factor is 0 for one rank.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402
from run_busbw import MPI_FLAGS, free_port, human, mpirun_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def gpu_count():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--ops", default="allreduce,allgather,reduce_scatter")
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gpus = gpu_count()
    if gpus == 0:
        print("run_nccl_busbw: no GPU: NCCL bus bandwidth not measured, nothing written")
        return
    mpirun = mpirun_path(args.build)
    if not mpirun:
        raise SystemExit("run_nccl_busbw: need mpirun; run `make deps`")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.path.join(os.path.abspath(args.build), "python") + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    cmd = [mpirun, *MPI_FLAGS, "-np", str(gpus), "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
           "-x", "PYTHONPATH", sys.executable, os.path.join(HERE, "nccl_busbw_worker.py"),
           "--ops", args.ops, "--sizes", args.sizes, "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"run_nccl_busbw: the workers failed ({out.returncode})")
    rows = []
    version = "?"
    for line in out.stdout.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        version = r["nccl"]
        rows.append({"case": f"{r['op']} {human(r['bytes'])} x {r['ranks']} GPUs",
                     "metric": r["metric"], "unit": "GB/s", "strata": r["strata"],
                     "peer": "torch.distributed nccl", "peer_value": r["torch"],
                     "target": ">= 0.95"})
        print(f"{r['op']:15s} {human(r['bytes']):>9s} {r['strata']:9.2f} {r['torch']:9.2f} "
              f"{r['strata'] / r['torch']:6.3f}")
    command = f"python3 benchmarks/run_nccl_busbw.py --sizes {args.sizes} --repeats {args.repeats}"
    notes = (f"{gpus} GPU(s), one rank each, under mpirun; NCCL {version} (torch's libnccl, "
             "shared by both sides in each process); fp32 sum; strata: backend nccl (out of "
             "place allgather/reduce_scatter, in place allreduce, as torch); best of "
             f"{args.repeats} alternating runs per side; "
             + ("busbw with the nccl-tests factors." if gpus > 1 else
                "one GPU: algbw (busbw's factor is 0 for one rank)."))
    path = bench_util.write_results("nccl_busbw", command, rows, notes=notes)  # + RESULTS.md
    print("wrote", path)


if __name__ == "__main__":
    main()
