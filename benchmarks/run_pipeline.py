#!/usr/bin/env python3
"""Pipeline benchmark driver: strata.pipeline.Schedule1F1B against
torch.distributed.pipelining.Schedule1F1B over gloo, same model, same 4 CPU
ranks (pp = 4), m in {4, 8, 16} microbatches, in one run
(pipeline_bench_worker.py alternates the two round by round).

  1. Step time, strata / torch: target <= 0.9.
  2. Measured bubble fraction (1 - per-rank busy time / makespan, averaged
     over the ranks) against the theoretical (p - 1) / (m + p - 1): within
     10% relative.

strata runs on its Gloo backend, as torch does (strata.init(backend="gloo")
through torch's TCPStore; a fourth run repeats the 4-rank MLP with strata
on its MPI backend, step time only, no target). Three runs: an MLP on 4
ranks (2 x Linear(512, 512) + tanh per stage, fp32, 32 rows per
microbatch), whose compute competes for the cores where ranks outnumber
them; stages of fixed costs on 4 ranks (forward 40 ms, backward 80 ms,
sleeping), the pipeline's own behaviour where ranks outnumber free cores;
and the MLP with one rank per core (16 layers per stage, 128 rows per
microbatch, the first stage computing its input's gradient so that the
stages are equal, as the theory assumes). A fifth run takes that last MLP
through strata.pipeline.ScheduleZeroBubble (ZB-H1) against torch's
ScheduleInterleavedZeroBubble with one stage per rank, beside strata's 1F1B
of the third run (no targets). The step-time target applies to
the 4-rank MLP; the bubble target to all three. Each bubble is also
compared with a replay of the same step's measured compute durations
through the schedule with free transfers (what the runner and the
transfers add), and the one-rank-per-core MLP's compute spread is measured
outside the pipeline too, each rank alone and all at once (what the
machine adds when every core computes).

    python3 benchmarks/run_pipeline.py [--build build] [--np 4] [--rounds 9]
"""

import argparse
import json
import os
import socket
import statistics
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


def run_worker(args, env, extra, np=None):
    mpirun = os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pipeline.json")
        env = dict(env, STRATA_BENCH_PORT=str(free_port()))
        np = np or args.np
        # Where ranks outnumber cores, a waiting rank gives its core away
        # (docs/mpi.md); with one rank per core it polls.
        yield_flags = (["--mca", "mpi_yield_when_idle", "1",
                        "--mca", "threads_pthreads_yield_strategy", "nanosleep"]
                       if np > os.cpu_count() else [])
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               *yield_flags,
               # glibc keeps freed memory (no page faults in later steps)
               "-x", "MALLOC_MMAP_THRESHOLD_=1073741824",
               "-x", "MALLOC_TRIM_THRESHOLD_=1073741824",
               "-np", str(np), sys.executable,
               os.path.join(HERE, "pipeline_bench_worker.py"), "--out", out,
               "--rounds", str(args.rounds), "--ms", args.ms] + extra
        subprocess.run(cmd, check=True, env=env, timeout=1800)
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--fixed-ms", type=float, default=40.0)
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(os.path.abspath(args.build), "python") + (
        ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    load_before = os.getloadavg()[0]
    cores = os.cpu_count()
    gloo = ["--backend", "gloo"]
    models = [("MLP", run_worker(args, env, gloo)),
              (f"fixed costs F {args.fixed_ms:g} ms, B {2 * args.fixed_ms:g} ms",
               run_worker(args, env, gloo + ["--fixed-ms", str(args.fixed_ms)])),
              # One rank per core: the MLP's own bubble, not the cores'.
              ("MLP, 16 layers, 128 rows, one rank per core",
               run_worker(args, env, gloo + ["--layers", "16", "--microbatch", "128",
                                             "--input-grad", "--noise-iters", "30"],
                          np=min(cores, args.np))),
              # strata's other CPU backend, for comparison (no target).
              ("MLP, strata over MPI", run_worker(args, env, ["--backend", "mpi"])),
              # Zero bubble on the one-rank-per-core MLP (no target).
              ("MLP, 16 layers, 128 rows, one rank per core, ZB-H1",
               run_worker(args, env, gloo + ["--layers", "16", "--microbatch", "128",
                                             "--input-grad", "--schedule", "zb"],
                          np=min(cores, args.np)))]
    rows = []
    one_f_one_b = {c["m"]: c for c in models[2][1]["results"]}
    for k, (name, doc) in enumerate(models):
        p = doc["ranks"]
        zb = doc.get("schedule") == "zb"
        for c in doc["results"]:
            case = f"{name}, p={p}, m={c['m']}"
            fixed = doc.get("fixed_ms")
            if fixed:  # the sleeps set the step time: both near the ideal makespan
                case += f" (ideal makespan {(c['m'] + p - 1) * 3 * fixed:g} ms)"
            if zb:
                rows.append({"case": case, "metric": "ZB-H1 step time", "unit": "ms",
                             "strata": c["strata_ms"],
                             "peer": "torch.distributed.pipelining ScheduleInterleavedZeroBubble, "
                                     "one stage per rank (gloo)",
                             "peer_value": c["torch_ms"], "target": None})
                plain = one_f_one_b.get(c["m"])
                if plain is not None:
                    rows.append({"case": case, "metric": "step time, ZB-H1 vs 1F1B (this run)",
                                 "unit": "ms", "strata": c["strata_ms"],
                                 "peer": "strata 1F1B, same model", "peer_value":
                                 plain["strata_ms"], "target": None})
                    rows.append({"case": f"{case}: measured bubble {c['bubble']:.3f}",
                                 "metric": "bubble, ZB-H1 vs 1F1B (this run)", "unit": "-",
                                 "strata": c["bubble"], "peer": "strata 1F1B, same model",
                                 "peer_value": plain["bubble"], "target": None})
                fiw = " / ".join(f"{statistics.mean(st[j] for st in c['stage_ms']):.1f}"
                                 for j in range(3))
                rows.append({"case": f"{case}: measured bubble {c['bubble']:.3f}, "
                                     f"F / I / W {fiw} ms",
                             "metric": "bubble: |measured - simulated| / simulated", "unit": "-",
                             "strata": abs(c["bubble"] - c["theory"]) / c["theory"],
                             "peer": "ZB-H1 simulated with the step's mean F, I, W",
                             "peer_value": c["theory"], "ratio": None, "target": None})
                rows.append({"case": f"{case}: measured bubble {c['bubble']:.3f}",
                             "metric": "bubble: |measured - replay| / replay", "unit": "-",
                             "strata": abs(c["bubble"] - c["replayed_bubble"])
                             / c["replayed_bubble"],
                             "peer": "replay of the step's measured compute, free transfers",
                             "peer_value": c["replayed_bubble"], "ratio": None,
                             "target": None})
                continue
            rows.append({"case": case, "metric": "1F1B step time", "unit": "ms",
                         "strata": c["strata_ms"],
                         "peer": "torch.distributed.pipelining Schedule1F1B (gloo)",
                         "peer_value": c["torch_ms"], "target": "<= 0.9" if k == 0 else None})
            if k == 3:
                continue  # the MPI run: its step time only
            rel = abs(c["bubble"] - c["theory"]) / c["theory"]
            rows.append({"case": f"{case}: measured bubble {c['bubble']:.3f}",
                         "metric": "bubble: |measured - theory| / theory", "unit": "-",
                         "strata": rel, "peer": "theory (p-1)/(m+p-1)",
                         "peer_value": c["theory"], "ratio": None,
                         "target": "<= 0.10", "target_on": "strata"})
            replay = c["replayed_bubble"]
            rows.append({"case": f"{case}: measured bubble {c['bubble']:.3f}",
                         "metric": "bubble: |measured - replay| / replay", "unit": "-",
                         "strata": abs(c["bubble"] - replay) / replay,
                         "peer": "replay of the step's measured compute, free transfers",
                         "peer_value": replay, "ratio": None, "target": None})
            stage = [f + b for f, b in c["stage_ms"]]
            rows.append({"case": case,
                         "metric": "stage imbalance: slowest / fastest stage's mean F + B",
                         "unit": "-", "strata": max(stage) / min(stage), "peer": None,
                         "peer_value": None, "ratio": None, "target": None})
            if c.get("transfer_us") is not None:
                rows.append({"case": case,
                             "metric": "transfer on the critical path (median)", "unit": "us",
                             "strata": c["transfer_us"], "peer": None, "peer_value": None,
                             "ratio": None, "target": None})
            rows.append({"case": case, "metric": "compute spread: CV of a stage's F (B) times",
                         "unit": "-", "strata": c["compute_cv"], "peer": None,
                         "peer_value": None, "ratio": None, "target": None})
        if doc.get("noise"):
            alone, at_once = doc["noise"]
            rows.append({"case": f"{name}, p={p}, outside the pipeline",
                         "metric": "compute spread, each rank alone", "unit": "-",
                         "strata": alone, "peer": None, "peer_value": None, "ratio": None,
                         "target": None})
            rows.append({"case": f"{name}, p={p}, outside the pipeline",
                         "metric": "compute spread, all ranks at once", "unit": "-",
                         "strata": at_once, "peer": None, "peer_value": None, "ratio": None,
                         "target": None})
    mlp = models[0][1]
    load = f"load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after, on "
    load += f"{os.cpu_count()} cores"
    notes = (f"{mlp['ranks']} CPU ranks (pp {mlp['ranks']}), 1 torch thread per rank; strata "
             "over its Gloo backend (bootstrapped through torch's TCPStore; the ranks share "
             "this host, so send/recv copy directly between the ranks' buffers, "
             "docs/launch.md), torch over gloo, alternating round by round in one job under "
             "mpirun; the row 'strata over MPI' runs strata's MPI backend instead (no "
             "target); "
             f"median over {args.rounds} rounds of the slowest rank's step. MLP: "
             f"{mlp['layers']} x Linear({mlp['hidden']}, {mlp['hidden']}) + tanh per stage, "
             f"fp32, {mlp['microbatch']} rows per microbatch. Fixed costs: each stage sleeps "
             f"{args.fixed_ms:g} ms in forward and {2 * args.fixed_ms:g} ms in backward. "
             "Measured bubble = 1 - busy / makespan per rank (busy: the runner's time in the "
             "stage's forward and backward; makespan: the slowest rank's step), averaged over "
             "the ranks. "
             + (f"With {mlp['ranks']} ranks on this machine's {cores} cores the MLP's ranks "
                "cannot all compute at once, so its measured bubble reflects the cores (about "
                f"1 - {cores}/{mlp['ranks']} when all ranks have work), not the schedule; "
                if cores < mlp["ranks"] else
                f"With {mlp['ranks']} ranks on this machine's {cores} cores each rank has a core "
                "of its own, so the MLP's measured bubble is the schedule's too; ")
             + "the fixed-cost stages (their step time "
             "is set by the sleeps, so it has no target) and the MLP with one rank per core "
             f"({models[2][1]['ranks']} ranks, {models[2][1]['layers']} layers, "
             f"{models[2][1]['microbatch']} rows per microbatch; the first stage's input "
             "is made a leaf that needs its gradient, so that every stage runs the same "
             "backward, as the theory assumes: without it the first stage skips its first "
             "layer's input gradient and the faster stage idles every microbatch; both "
             "libraries run the same model) measure the schedule. Replay: "
             "the same step's measured compute durations replayed through the schedule with "
             "free transfers and no runner overhead (so |measured - replay| is what the runner "
             "and the transfers add; |replay - theory| is what uneven and varying compute "
             "times add). Compute spread: the coefficient of variation of one stage's forward "
             "(and backward) durations within a step, mean over F, B and the ranks; in 1F1B's "
             "steady state each step waits for the slower of two ranks' operations, so a "
             "spread of s adds roughly 0.56 s of the per-microbatch time to the makespan (the "
             "expected excess of the larger of two draws), which the theory leaves out. "
             "Transfer on the critical path: the median time from the end of a rank's "
             "forward (backward) to the start of the next stage's forward (the previous "
             "stage's backward) where that rank was waiting for it, on the host's wall clock "
             "(StepStats.start_time): the runner's and the transport's cost per transfer. "
             "The same spread outside the pipeline (one microbatch's forward and backward of "
             "a stage, 30 times, first each rank alone while the others wait, then all ranks "
             "at once) shows how much of it the machine adds when every core computes. "
             "ZB-H1 rows: strata.pipeline.ScheduleZeroBubble (the backward split into I, "
             "the input gradient, and W, the weight gradient, placed in the bubbles) against "
             "torch's ScheduleInterleavedZeroBubble with one stage per rank, on the "
             "one-rank-per-core MLP; its bubble is compared with ZB-H1's schedule simulated "
             "with the step's mean F, I and W, and with strata's 1F1B on the same model in "
             "this run. "
             "glibc is told to keep freed memory (MALLOC_MMAP_THRESHOLD_, "
             f"MALLOC_TRIM_THRESHOLD_) in every process, both libraries alike. This run: {load}.")
    path = bench_util.write_results("pipeline", "python3 benchmarks/run_pipeline.py", rows,
                                    notes=notes)
    bench_util.print_rows(rows, path, metric_width=38)


if __name__ == "__main__":
    main()
