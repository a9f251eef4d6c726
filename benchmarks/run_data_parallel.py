#!/usr/bin/env python3
"""Data-parallel benchmark driver: training steps of a ~50 M-parameter
model at dp4 on 4 CPU ranks, strata.nn.DataParallel against
  1. torch's DistributedDataParallel over gloo on the same ranks (its
     defaults, and with gradient_as_bucket_view=True). Target <= 1.0x;
  2. the per-parameter loop a user writes without a data-parallel layer
     (one blocking all-reduce per gradient after backward): reported;
and the optimizer state per rank of ZeRO-1 (strata.optim.DistributedOptimizer
around AdamW) against AdamW replicated. Target <= 0.3x.

    python3 benchmarks/run_data_parallel.py [--build build] [--np 4]

Launched with torchrun (--standalone): the launcher torch DDP users run,
under which strata picks its Gloo backend and bootstraps through torchrun's
store, so strata and torch both run on Gloo in the same processes, on the
same ranks, interleaved round by round.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_util  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(os.path.abspath(args.build), "python") + (
        ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    # glibc keeps freed memory (no page faults in later rounds), for every variant alike.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1073741824")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "1073741824")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dp.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.np),
               os.path.join(HERE, "data_parallel_bench_worker.py"), "--out", out,
               "--hidden", str(args.hidden), "--blocks", str(args.blocks),
               "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
        subprocess.run(cmd, check=True, env=env, timeout=3600)
        with open(out) as f:
            doc = json.load(f)
    ms = doc["step_ms"]
    case = f"dp{doc['ranks']}, {doc['params'] / 1e6:.1f} M parameters"
    rows = [
        {"case": case, "metric": "training step (fwd, bwd, reduction, SGD)", "unit": "ms",
         "strata": ms["strata"], "peer": "torch DDP over gloo", "peer_value": ms["ddp"],
         "target": "<= 1.0"},
        {"case": case, "metric": "training step (fwd, bwd, reduction, SGD)", "unit": "ms",
         "strata": ms["strata"], "peer": "torch DDP over gloo, gradient_as_bucket_view",
         "peer_value": ms["ddp_views"], "target": "<= 1.0"},
        {"case": case, "metric": "training step (fwd, bwd, reduction, SGD)", "unit": "ms",
         "strata": ms["strata"], "peer": "per-parameter allreduce loop (strata)",
         "peer_value": ms["loop"]},
        {"case": case + ", AdamW", "metric": "optimizer state per rank", "unit": "MB",
         "strata": doc["zero_state_bytes"] / 1e6, "peer": "AdamW replicated",
         "peer_value": doc["adamw_state_bytes"] / 1e6, "target": "<= 0.3"},
        {"case": case + ", AdamW", "metric": "training step, ZeRO-1 vs replicated AdamW",
         "unit": "ms", "strata": doc["zero_step_ms"], "peer": "DataParallel + AdamW",
         "peer_value": doc["adamw_step_ms"]},
    ]
    cores = os.cpu_count()
    notes = (f"{doc['ranks']} CPU ranks under torchrun on {cores} cores, one torch thread per "
             f"rank; the model: {doc['blocks']} residual MLP blocks (LayerNorm, {doc['hidden']} -> "
             f"{4 * doc['hidden']} -> {doc['hidden']}), fp32, {doc['tokens']} tokens per rank "
             f"per step. strata on its Gloo backend ({doc['transport']}), bootstrapped through "
             "torchrun's store; torch DDP over gloo in the same processes; both with 25 MiB "
             f"buckets (strata: {doc['buckets']} buckets in the order of the first backward). "
             "Each step time is the median over "
             f"{doc['rounds']} rounds of the slowest rank, the variants interleaved in each "
             "round. ZeRO-1: strata.optim.DistributedOptimizer(AdamW) around DataParallel "
             "(reduce-scatter, shard step, all-gather); state: bytes of the optimizer's state "
             "tensors on the fullest rank after one step.")
    path = bench_util.write_results("data_parallel", "python3 benchmarks/run_data_parallel.py",
                                    rows, notes=notes)
    bench_util.print_rows(rows, path)


if __name__ == "__main__":
    main()
