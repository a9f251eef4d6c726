#!/usr/bin/env python3
"""Checkpoint staging from GPU memory (staging_gpu_bench): the
checkpointer's device-to-host copy into its page-locked staging buffer
against cudaMemcpy into memory from cudaMallocHost (the ceiling of a
device-to-host copy), on one GPU, same tensors, same run.

  1. Copy bandwidth, strata / pinned cudaMemcpy: target >= 0.95.
  2. For context (no target): the same copies into pageable memory, and
     the one-off cost of page-locking the staging buffer (cudaHostRegister)
     against allocating the same size with cudaMallocHost.

    python3 benchmarks/run_staging_gpu.py [--build build] [--mib 2048] [--tensors 16]

Without a GPU it says so and writes nothing.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_util  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    binary = os.path.join(args.build, "benchmarks", "staging_gpu_bench")
    if not os.path.exists(binary):
        raise SystemExit(f"run_staging_gpu: {binary} is missing; run `make build`")
    out = subprocess.run([binary, "--mib", str(args.mib), "--tensors", str(args.tensors),
                          "--iters", str(args.iters)], capture_output=True, text=True,
                         timeout=600)
    lines = out.stdout.strip().splitlines()
    doc = json.loads(lines[-1]) if lines else {}
    if out.returncode != 0 or "error" in doc:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"run_staging_gpu: staging_gpu_bench failed ({out.returncode})")
    if not doc.get("gpu"):
        print(f"run_staging_gpu: {doc.get('reason', 'no GPU')}: not measured, nothing written")
        return
    gib = doc["bytes"] / 2**30
    case = f"{gib:g} GiB in {doc['tensors']} tensors, device to host"
    rows = [
        {"case": case, "metric": "copy bandwidth", "unit": "GB/s",
         "strata": doc["bytes"] / doc["strata_s"] / 1e9,
         "peer": "cudaMemcpyAsync into cudaMallocHost memory",
         "peer_value": doc["bytes"] / doc["pinned_memcpy_s"] / 1e9, "target": ">= 0.95"},
        {"case": case, "metric": "copy bandwidth, peer into pageable memory", "unit": "GB/s",
         "strata": doc["bytes"] / doc["strata_s"] / 1e9,
         "peer": "cudaMemcpyAsync into pageable (malloc'd, touched) memory",
         "peer_value": doc["bytes"] / doc["pageable_memcpy_s"] / 1e9, "target": None},
        {"case": f"{gib:g} GiB staging buffer, once per allocation",
         "metric": "page-locking cost", "unit": "s", "strata": doc["pin_s"],
         "peer": "cudaMallocHost of the same size", "peer_value": doc["malloc_host_s"],
         "target": None},
    ]
    notes = (f"{doc['device']}. strata: the checkpointer's staging (StagingBuffer: mmap'd, "
             "huge pages advised, page-locked with cudaHostRegister; RunStagingCopies: one "
             "cudaMemcpyAsync per tensor on one stream, then a synchronize), as "
             "Checkpointer::Save runs it for tensors in CUDA memory; the staged bytes are "
             "checked against the source first. Peers: the same copies on the same stream into "
             "a cudaMallocHost buffer (pinned by the CUDA allocator: the ceiling) and into "
             f"pageable memory. Median of {doc['iters']} rounds, the three alternating; source: "
             "random bytes. The page-locking cost is paid once per staging allocation (the "
             "buffer is reused across saves); reserving it (mmap) took "
             f"{doc['reserve_s'] * 1e3:.1f} ms.")
    command = f"python3 benchmarks/run_staging_gpu.py --mib {args.mib} --tensors {args.tensors}"
    path = bench_util.write_results("staging_gpu", command, rows, notes=notes)
    bench_util.print_rows(rows, path)


if __name__ == "__main__":
    main()
