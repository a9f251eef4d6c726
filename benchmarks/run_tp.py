#!/usr/bin/env python3
"""Tensor-parallel benchmark driver: strata.nn's column- and row-parallel
layers, and the C++ kernels under them (tp_kernels_bench), on 4 CPU ranks
(tp = 4), forward + backward, against
  1. the sum of their parts measured alone in the same run: the local GEMMs
     (torch) plus the layer's collectives (strata). Target <= 1.10x: the
     layer adds little beyond its parts (overlap may take it below 1);
  2. torch.distributed.tensor.parallel (ColwiseParallel / RowwiseParallel)
     over gloo on the same ranks and shapes. Target <= 1.0x.

    python3 benchmarks/run_tp.py [--build build] [--np 4] [--backend gloo]

strata runs on its Gloo backend, as torch does (the ranks share this host,
so its collectives copy directly between the ranks' buffers); --backend mpi
runs it on Open MPI instead.

GPU rows (overlap < 1.0x, bf16 layer throughput >= 0.9x torch.matmul) are
benchmarks/run_tp_gpu.py's (section tp_gpu), on a machine with a GPU; here
they are listed as not measured.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_util  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    args = ap.parse_args()
    mpirun = os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(os.path.abspath(args.build), "python") + (
        ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["STRATA_BENCH_PORT"] = str(free_port())
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread per rank, as torch
    # torch warns at exit about DTensor's internal collectives; not ours.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tp.json")
        # The C++ benchmark's Gloo backend bootstraps through a file store.
        env["STRATA_STORE"] = "file:" + os.path.join(tmp, "store")
        # As tests/tools/run_multirank.sh: ranks outnumber cores here, so a
        # waiting rank must give its core to one still computing (docs/mpi.md).
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "--mca", "mpi_yield_when_idle", "1",
               "--mca", "threads_pthreads_yield_strategy", "nanosleep",
               # glibc keeps freed memory (no page faults in later rounds),
               # for both libraries alike.
               "-x", "MALLOC_MMAP_THRESHOLD_=1073741824",
               "-x", "MALLOC_TRIM_THRESHOLD_=1073741824", "-x", "STRATA_STORE",
               "-np", str(args.np), sys.executable, os.path.join(HERE, "tp_bench_worker.py"),
               "--out", out, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
               "--ffn", str(args.ffn), "--rounds", str(args.rounds), "--backend", args.backend]
        subprocess.run(cmd, check=True, env=env, timeout=1800)
        with open(out) as f:
            doc = json.load(f)
        kernels = [mpirun] + cmd[1:cmd.index("-np") + 2] + [
            os.path.join(args.build, "benchmarks", "tp_kernels_bench"),
            "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
            "--rounds", str(args.rounds), "--backend", args.backend]
        run = subprocess.run(kernels, check=True, env=env, timeout=1800, capture_output=True,
                             text=True)
        cpp = json.loads(run.stdout.strip().splitlines()[-1])
    rows = []
    for c in doc["results"]:
        parts = c["gemm_ms"] + c["comm_ms"]
        rows.append({"case": c["case"], "metric": "fwd+bwd vs GEMMs + collectives alone",
                     "unit": "ms", "strata": c["layer_ms"], "peer": "sum of parts",
                     "peer_value": parts, "target": "<= 1.10"})
        rows.append({"case": c["case"], "metric": "fwd+bwd", "unit": "ms",
                     "strata": c["layer_ms"], "peer": "torch TP (DTensor) over gloo",
                     "peer_value": c["torch_tp_ms"], "target": "<= 1.0"})
    for c in cpp["results"]:
        rows.append({"case": "C++ kernel, " + c["case"],
                     "metric": "fwd+bwd vs sgemms + collectives alone", "unit": "ms",
                     "strata": c["layer_ms"], "peer": "sum of parts",
                     "peer_value": c["gemm_ms"] + c["comm_ms"], "target": "<= 1.10"})
    for case in ("column/row-parallel backward with overlap (GPU)",
                 "bf16 column/row layer throughput vs torch.matmul (GPU)"):
        rows.append({"case": case,
                     "metric": "not measured here: no GPU (benchmarks/run_tp_gpu.py)",
                     "unit": "-", "strata": None, "peer": None, "peer_value": None,
                     "target": "< 1.0" if "overlap" in case else ">= 0.9"})
    cores = os.cpu_count()
    shape = (f"{doc['ranks']} CPU ranks (tp {doc['ranks']}), {doc['tokens']} tokens "
             f"(seq {doc['tokens'] // 4} x batch 4), hidden {doc['hidden']}, ffn {doc['ffn']}, "
             "fp32, 1 torch thread per rank; median over rounds of the slowest rank. "
             f"strata on its {'Gloo' if args.backend == 'gloo' else 'MPI'} backend"
             + (" (bootstrapped through torch's TCPStore, the C++ benchmark through a file "
                "store; the ranks share this host, so collectives copy directly between "
                "their buffers), torch over gloo. " if args.backend == "gloo" else
                ", torch over gloo. ") +
             "torch TP's time includes the input gradient's reduce-scatter that DTensor "
             "leaves running under sequence parallelism (waited for). glibc keeps freed "
             "memory (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) in every process. "
             "Parts: the three local GEMMs with torch, the layer's collectives with strata, "
             "each alone. One thread, no communication: the Python layer costs 1.03x its "
             "GEMMs. ")
    if doc["ranks"] > cores:
        shape += (f"The {doc['ranks']} ranks outnumber the {cores} cores: at each collective "
                  "the ranks that arrive first wait while those that lost their time slice "
                  "catch up, leaving a core idle, which the parts (measured without those "
                  "synchronisations) do not pay; the parts ratio is therefore measured with "
                  "one rank per core as well (benchmarks/run_tp.py --np 2, section tp_np2).")
    else:
        shape += "One rank per core."
    name = ("tp" if args.np == 4 else f"tp_np{args.np}") + (
        "" if args.backend == "gloo" else f"_{args.backend}")
    cmdline = "python3 benchmarks/run_tp.py" + ("" if args.np == 4 else f" --np {args.np}") + (
        "" if args.backend == "gloo" else f" --backend {args.backend}")
    path = bench_util.write_results(name, cmdline, rows, notes=shape)
    bench_util.print_rows(rows, path)


if __name__ == "__main__":
    main()
