#!/usr/bin/env python3
"""NCCL bus bandwidth: strata's nccl backend next to torch.distributed with
NCCL, in the same processes, on the GPUs present (one rank per GPU, under
mpirun). Target: strata >= 0.95x torch for allreduce, allgather and
reduce_scatter.

    python3 benchmarks/run_nccl_busbw.py [--build build] [--sizes 1M,16M,64M,256M]
                                         [--ranks N] [--name nccl_busbw]

Without a GPU it says so and writes nothing. With a single rank the figure
is algbw (bytes / time): busbw's factor is 0 for one rank.

--ranks N runs N ranks on the GPUs present (rank r on GPU r mod GPUs).
More ranks than GPUs need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1
in the environment (tools/dev/gpu_checks.sh sets it, with NCCL_NVLS_ENABLE=0
and NCCL_MAX_CTAS); both sides then share each GPU the same way, so the
ratio still compares like with like, though the bandwidth is not that of
separate GPUs. Every NCCL_* variable of the environment is passed to the
ranks. --name picks the results file (results/<name>.json).
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
    ap.add_argument("--ranks", type=int, default=0, help="ranks (default: one per GPU)")
    ap.add_argument("--name", default="nccl_busbw", help="results/<name>.json")
    args = ap.parse_args()
    gpus = gpu_count()
    if gpus == 0:
        print("run_nccl_busbw: no GPU: NCCL bus bandwidth not measured, nothing written")
        return
    ranks = args.ranks or gpus
    shared = ranks > gpus
    if shared and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise SystemExit(f"run_nccl_busbw: {ranks} ranks on {gpus} GPU(s) need NCCL >= 2.30 and "
                         "NCCL_MULTI_RANK_GPU_ENABLE=1 (tools/dev/gpu_checks.sh sets it)")
    mpirun = mpirun_path(args.build)
    if not mpirun:
        raise SystemExit("run_nccl_busbw: need mpirun; run `make deps`")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.path.join(os.path.abspath(args.build), "python") + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    nccl_vars = [f for v in sorted(env) if v.startswith("NCCL_") or v == "STRATA_NCCL_LIBRARY"
                 for f in ("-x", v)]
    cmd = [mpirun, *MPI_FLAGS, "-np", str(ranks), "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
           "-x", "PYTHONPATH", *nccl_vars, sys.executable,
           os.path.join(HERE, "nccl_busbw_worker.py"),
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
        where = (f"{r['ranks']} ranks on {gpus} GPU" + ("s" if gpus > 1 else "") if shared
                 else f"{r['ranks']} GPUs")
        rows.append({"case": f"{r['op']} {human(r['bytes'])} x {where}",
                     "metric": r["metric"], "unit": "GB/s", "strata": r["strata"],
                     "peer": "torch.distributed nccl", "peer_value": r["torch"],
                     "target": ">= 0.95"})
        print(f"{r['op']:15s} {human(r['bytes']):>9s} {r['strata']:9.2f} {r['torch']:9.2f} "
              f"{r['strata'] / r['torch']:6.3f}")
    command = f"python3 benchmarks/run_nccl_busbw.py --sizes {args.sizes} --repeats {args.repeats}"
    if args.ranks:
        command += f" --ranks {ranks}"
    if args.name != "nccl_busbw":
        command += f" --name {args.name}"
    layout = (f"{ranks} ranks sharing {gpus} GPU(s) (NCCL's multi-rank-per-GPU mode, "
              "NCCL_MULTI_RANK_GPU_ENABLE=1, NVLS off"
              + (f", NCCL_MAX_CTAS={os.environ['NCCL_MAX_CTAS']}"
                 if os.environ.get("NCCL_MAX_CTAS") else "")
              + "; the bandwidth is that of ranks sharing a GPU, not of separate GPUs)"
              if shared else f"{gpus} GPU(s), one rank each")
    notes = (f"{layout}, under mpirun; NCCL {version} (torch's libnccl, "
             "shared by both sides in each process); fp32 sum; strata: backend nccl (out of "
             "place allgather/reduce_scatter, in place allreduce, as torch); best of "
             f"{args.repeats} alternating runs per side; "
             + ("busbw with the nccl-tests factors." if ranks > 1 else
                "one rank: algbw (busbw's factor is 0 for one rank)."))
    path = bench_util.write_results(args.name, command, rows, notes=notes)  # + RESULTS.md
    print("wrote", path)


if __name__ == "__main__":
    main()
