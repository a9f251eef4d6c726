#!/usr/bin/env python3
"""What the flight recorder costs (docs/observability.md), on vs off in the
same run:

- the recorder's own cost per operation in one process
  (build/benchmarks/flight_recorder_bench), next to a trivial sink;
- a collective-heavy loop: small all-reduces (start, wait) on 2 MPI ranks,
  on three communicators of the same ranks: no sink, a trivial sink, and
  the flight recorder (build/benchmarks/comm_record_overhead), in rotating
  rounds; 1 and 1024 floats;
- the demo's model: the demo's GPT (dp2 x tp2 x pp2, 1F1B, DataParallel) on
  8 MPI ranks, built over two Worlds, one with the recorder (the default)
  and one with strata.init(trace=False), trained in alternating rounds
  (flight_recorder_demo_worker.py).

- the share of the demo's step time recording implies: the operations per
  step the recorder saw in that run x the CPU time recording one takes
  (build/benchmarks/metrics_sink_bench's BM_OperationLife: the record, the
  trace, start, completion, the wait's clock reads, the release), for the
  recorder alone and for metrics + recorder (with the C++ step record).

    python3 benchmarks/run_flight_recorder.py [--build build] [--rounds 21]
        [--before OLD_BUILD]

--before: the build folder of the code to compare with; its
flight_recorder_bench and comm_record_overhead run in alternating rounds
with this build's. Writes
benchmarks/results/flight_recorder.json. Target (issue 26): <= 1% step
time, metrics and flight recorder together; this is the recorder's share,
and the demo's share for both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_util  # noqa: E402


def mpirun(np):
    exe = os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [exe] + root + ["--oversubscribe", "--bind-to", "none", "-np", str(np)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--demo-rounds", type=int, default=9)
    ap.add_argument("--demo-steps", type=int, default=3)
    ap.add_argument("--before", help="the build folder of the code to compare with")
    args = ap.parse_args()
    rows = []
    # The recorder's own cost per operation, in one process (CPU time: the
    # machine is shared), this build's and --before's in alternating rounds.
    bins = {"after": os.path.join(args.build, "benchmarks", "flight_recorder_bench")}
    if args.before:
        bins["before"] = os.path.join(args.before, "benchmarks", "flight_recorder_bench")
    samples = {k: {} for k in bins}
    for r in range(3):
        for k in (list(bins) if r % 2 == 0 else list(reversed(list(bins)))):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([bins[k], "--benchmark_repetitions=3",
                                f"--benchmark_out={out.name}", "--benchmark_out_format=json"],
                               check=True, timeout=600, stdout=subprocess.DEVNULL)
                for b in json.load(open(out.name))["benchmarks"]:
                    if b.get("run_type") == "iteration":
                        samples[k].setdefault(b["run_name"], []).append(b["cpu_time"])
    bm = {k: {n: statistics.median(v) for n, v in t.items()} for k, t in samples.items()}
    for threads in (1, 4):
        name = f"BM_RecordOneOperation/{{}}/real_time/threads:{threads}"
        for which, label in ((1, "flight recorder"), (0, "trivial sink (3 atomic increments)")):
            before = bm.get("before", {}).get(name.format(which))
            rows.append({"case": f"one operation's record (issued, started, completed), "
                                 f"{threads} thread{'s' if threads > 1 else ''}",
                         "metric": f"CPU time per operation, {label}", "unit": "ns",
                         "strata": bm["after"][name.format(which)],
                         "peer": "before (same run)" if before is not None else None,
                         "peer_value": before, "target": None})
    # Everything recording adds to one operation, for the share below.
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([os.path.join(args.build, "benchmarks", "metrics_sink_bench"),
                        "--benchmark_filter=OperationLife/.*/threads:1$|RecordStep",
                        "--benchmark_repetitions=5", f"--benchmark_out={out.name}",
                        "--benchmark_out_format=json"],
                       check=True, timeout=600, stdout=subprocess.DEVNULL)
        life = {}
        for b in json.load(open(out.name))["benchmarks"]:
            if b.get("run_type") == "iteration":
                life.setdefault(b["run_name"], []).append(b["cpu_time"])
        life = {n: statistics.median(v) for n, v in life.items()}
    loops = {"after": args.build}
    if args.before:
        loops["before"] = args.before
    for count in (1, 1024):
        runs = {k: [] for k in loops}
        for r in range(3 if args.before else 1):
            for k in (list(loops) if r % 2 == 0 else list(reversed(list(loops)))):
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    subprocess.run(mpirun(2) + [os.path.join(loops[k], "benchmarks",
                                                             "comm_record_overhead"),
                                                "--iters", str(args.iters),
                                                "--rounds", str(args.rounds),
                                                "--count", str(count), "--json", out.name],
                                   check=True, timeout=900, stdout=subprocess.DEVNULL)
                    runs[k].append(json.load(open(out.name)))
        med = {k: {f: statistics.median(x[f] for x in v) for f in ("us_per_op_on",
                                                                      "us_per_op_off")}
               for k, v in runs.items()}
        rows.append({"case": f"allreduce {count} x fp32 on 2 ranks (mpi), start+wait loop",
                     "metric": "time per operation, flight recorder on", "unit": "us",
                     "strata": med["after"]["us_per_op_on"],
                     "peer": "recorder off (no sink), same run",
                     "peer_value": med["after"]["us_per_op_off"], "target": "<= 1.01"})
        if "before" in med:
            rows.append({"case": f"allreduce {count} x fp32 on 2 ranks (mpi), start+wait loop",
                         "metric": "recorder on minus off, this build", "unit": "us",
                         "strata": med["after"]["us_per_op_on"] - med["after"]["us_per_op_off"],
                         "peer": "the same, before (alternating runs)",
                         "peer_value": (med["before"]["us_per_op_on"]
                                        - med["before"]["us_per_op_off"])})
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build, "python"), OMP_NUM_THREADS="1")
    proc = subprocess.run(mpirun(8) + ["--mca", "mpi_yield_when_idle", "1", sys.executable,
                                       os.path.join(HERE, "flight_recorder_demo_worker.py"),
                                       str(args.demo_rounds), str(args.demo_steps)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"demo worker failed:\n{proc.stdout}\n{proc.stderr}")
    demo = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    rows.append({"case": f"demo GPT, {demo['mesh']}, 1F1B, 8 ranks (mpi)",
                 "metric": "time per training step, flight recorder on", "unit": "s",
                 "strata": demo["s_per_step_on"], "peer": "recorder off, same run",
                 "peer_value": demo["s_per_step_off"], "target": "<= 1.01"})
    ops, step_s = demo["ops_per_step"], demo["s_per_step_on"]
    for which, label, per_step in ((1, "flight recorder", 0.0),
                                   (3, "metrics + flight recorder", life["BM_RecordStep"])):
        per_op = life[f"BM_OperationLife/{which}/real_time/threads:1"]
        rows.append({"case": (f"demo GPT, {demo['mesh']}, 8 ranks: {ops:.0f} ops/step x "
                              f"{per_op:.0f} ns" + (f" + {per_step:.0f} ns/step" if per_step
                                                    else "") + f", over {step_s * 1e3:.0f} ms"),
                     "metric": f"{label}, share of step time", "unit": "%",
                     "strata": (ops * per_op + per_step) * 1e-9 / step_s * 100,
                     "peer": None, "peer_value": None, "target": "<= 1",
                     "target_on": "strata"})
    notes = ("The flight recorder's share of issue 26's cost target (metrics + recorder "
             "<= 1% of step time), judged by the share rows: the operations per step the "
             "recorder counted in the demo run x the CPU time recording one operation takes "
             "in isolation (caches warm; metrics_sink_bench BM_OperationLife, which includes "
             "one clock read the communicator makes anyway). 'before': the same benchmark "
             "built from the code before the lock-free ring, alternating rounds. The "
             "allreduce loops are the worst case, not a training step: back-to-back "
             "operations of a few microseconds, where the recording's few hundred "
             "nanoseconds are a visible fraction. The demo's on/off ratio is a median over "
             "rounds that alternate the sides; on 8 oversubscribed ranks of this shared "
             "2-core machine single rounds move by more than 1% "
             f"(demo rounds on: {[round(x, 4) for x in demo['rounds_on']]}, off: "
             f"{[round(x, 4) for x in demo['rounds_off']]}), so that ratio cannot resolve 1%.")
    path = bench_util.write_results("flight_recorder", " ".join(["python3"] + sys.argv), rows,
                                    notes)
    bench_util.print_rows(rows, path)


if __name__ == "__main__":
    main()
