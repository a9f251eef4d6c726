#!/usr/bin/env python3
"""Tensor-parallel kernels on GPU (tp_gpu_bench): the targets of the
tensor-parallel issue that need a device.

  1. bf16 column/row-parallel kernel throughput (cuBLASLt, bias in the
     epilogue, fp32 main-gradient accumulation) against torch.matmul of the
     same local shapes, on one GPU, forward and forward + backward (the
     peer: the same three GEMMs with torch.matmul). Target >= 0.9x.
  2. With two GPUs or more (one rank each, NCCL): each layer's forward +
     backward against the same kernels on a group of one rank plus its
     collectives alone. Target < 1.0x for the column-parallel layer, whose
     input-gradient all-reduce overlaps with the weight-gradient GEMM (the
     row-parallel layer's all-reduce is in its forward, with nothing to
     overlap: no target).

    python3 benchmarks/run_tp_gpu.py [--build build] [--dtype bf16] [--ranks N]

--ranks N runs part 2 on N ranks (default: one per GPU). More ranks than
GPUs share them (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 in the
environment, which tools/dev/gpu_checks.sh sets); part 2 then runs and is
reported, but without its target: ranks that time-slice one GPU cannot show
an overlap in time (mr_tp_layers.py checks the overlap of the strata.nn
layers on CUDA from the kernels' own times instead).

Without a GPU it says so and writes nothing (benchmarks/RESULTS.md keeps
the GPU rows of the tp section as not measured).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_util  # noqa: E402
from run_busbw import MPI_FLAGS, mpirun_path  # noqa: E402


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def torch_matmul_ms(m, n, k, dtype, iters, rounds):
    """Median ms of torch.matmul for y = x w^T [m, n] (forward) and of the
    three GEMMs of forward + backward, with CUDA events."""
    import torch
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=tdt)
    w = torch.randn(n, k, device=dev, dtype=tdt)
    dy = torch.randn(m, n, device=dev, dtype=tdt)

    def forward():
        torch.matmul(x, w.t())

    def fwd_bwd():
        torch.matmul(x, w.t())
        torch.matmul(dy, w)
        torch.matmul(dy.t(), x)

    out = []
    for fn in (forward, fwd_bwd):
        fn()
        samples = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        out.append(statistics.median(samples))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--shards", type=int, default=8, help="tp size whose local shapes are timed")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ranks", type=int, default=0,
                    help="ranks of the multi-rank part (default: one per GPU)")
    args = ap.parse_args()
    binary = os.path.join(args.build, "benchmarks", "tp_gpu_bench")
    if not os.path.exists(binary):
        raise SystemExit(f"run_tp_gpu: {binary} is missing; run `make build`")
    common = ["--dtype", args.dtype, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
              "--ffn", str(args.ffn), "--iters", str(args.iters), "--rounds", str(args.rounds)]
    one = subprocess.run([binary, "--shards", str(args.shards)] + common, capture_output=True,
                         text=True, timeout=1800)
    if one.returncode != 0:
        sys.stderr.write(one.stdout + one.stderr)
        raise SystemExit(f"run_tp_gpu: tp_gpu_bench failed ({one.returncode})")
    doc = last_json(one.stdout)
    if not doc["gpu"]:
        print(f"run_tp_gpu: {doc['reason']}: not measured, nothing written")
        return
    import torch
    gpus = torch.cuda.device_count()
    rows = []
    for c in doc["results"]:
        m, n, k = c["m"], c["n"], c["k"]
        torch_fwd, torch_fb = torch_matmul_ms(m, n, k, args.dtype, args.iters, args.rounds)
        for metric, ms, peer_ms, flops in (("forward", c["forward_ms"], torch_fwd, 2 * m * n * k),
                                           ("forward + backward", c["fwd_bwd_ms"], torch_fb,
                                            6 * m * n * k)):
            rows.append({"case": f"{c['case']} (local shape of tp {args.shards}), "
                                 f"{args.tokens} tokens, {args.dtype}",
                         "metric": f"{metric} throughput", "unit": "TFLOP/s",
                         "strata": flops / (ms * 1e-3) / 1e12,
                         "peer": "torch.matmul, the same GEMMs",
                         "peer_value": flops / (peer_ms * 1e-3) / 1e12, "target": ">= 0.9"})
    ranks = args.ranks or gpus
    shared = ranks > gpus
    if shared and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise SystemExit(f"run_tp_gpu: {ranks} ranks on {gpus} GPU(s) need NCCL >= 2.30 and "
                         "NCCL_MULTI_RANK_GPU_ENABLE=1 (tools/dev/gpu_checks.sh sets it)")
    if ranks >= 2:
        mpirun = mpirun_path(args.build)
        if not mpirun:
            raise SystemExit("run_tp_gpu: need mpirun for the multi-GPU run; run `make deps`")
        nccl_vars = [f for v in sorted(os.environ)
                     if v.startswith("NCCL_") or v == "STRATA_NCCL_LIBRARY" for f in ("-x", v)]
        multi = subprocess.run([mpirun, *MPI_FLAGS, "-np", str(ranks), *nccl_vars, binary]
                               + common, capture_output=True, text=True, timeout=1800)
        if multi.returncode != 0:
            sys.stderr.write(multi.stdout + multi.stderr)
            raise SystemExit(f"run_tp_gpu: tp_gpu_bench on {ranks} ranks failed")
        where = f"{ranks} ranks sharing {gpus} GPU(s)" if shared else f"tp {ranks}"
        for c in last_json(multi.stdout)["results"]:
            column = c["case"].startswith("column")
            rows.append({"case": f"{c['case']}, {where}, {args.tokens} tokens, {args.dtype}",
                         "metric": "fwd+bwd vs GEMMs alone + collectives alone", "unit": "ms",
                         "strata": c["layer_ms"], "peer": "sum of parts",
                         "peer_value": c["gemm_ms"] + c["comm_ms"],
                         "target": "< 1.0" if column and not shared else None})
    else:
        rows.append({"case": "column-parallel backward with overlap",
                     "metric": f"not measured: needs 2 ranks or more (a GPU each, or sharing "
                               f"GPUs with NCCL >= 2.30); this run had {ranks} on {gpus} GPU(s)",
                     "unit": "-", "strata": None, "peer": None, "peer_value": None,
                     "target": "< 1.0"})
    notes = (f"{doc['device']}, {args.dtype}. Throughput: the kernels at the local shapes of one "
             f"rank of a tp = {args.shards} layer (column {args.hidden} -> {args.ffn} / "
             f"{args.shards}, row {args.ffn} / {args.shards} -> {args.hidden}), "
             f"{args.tokens} tokens, on one GPU (a group of one: no communication); the peer "
             "is torch.matmul for the same GEMMs (forward: x w^T; forward + backward: also "
             "dy w and dy^T x), timed with CUDA events in the same run; median over "
             f"{args.rounds} rounds of {args.iters} calls. strata's forward adds the bias in "
             "the GEMM's epilogue and its backward accumulates the weight gradient into an "
             "fp32 main-gradient buffer (and sums the bias gradient), which the peer does not.")
    if ranks >= 2 and shared:
        notes += (f" The layer rows ran {ranks} ranks sharing {gpus} GPU(s) (NCCL's "
                  "multi-rank-per-GPU mode): the ranks time-slice the GPU, so those rows have "
                  "no target.")
    command = "python3 benchmarks/run_tp_gpu.py" + (f" --ranks {ranks}" if args.ranks else "")
    path = bench_util.write_results("tp_gpu", command, rows, notes=notes)
    bench_util.print_rows(rows, path, case_width=70)


if __name__ == "__main__":
    main()
