#!/usr/bin/env python3
"""What metrics cost: step time with strata.metrics on (every communicator
recording into the registry, steps marked) against off, in the same run
(metrics_overhead_worker.py; two worlds side by side, steps alternating).

    python3 benchmarks/run_metrics_overhead.py [--build build] [--np 4] [--pairs 150]

Target (issue 26, "Cost"): median step time on / off <= 1.01, on the
demo's model and on a collective-heavy loop; measured twice in one run:
metrics alone (the flight recorder on in both worlds) and metrics + the
flight recorder against neither. Writes
benchmarks/results/metrics_overhead.json and the RESULTS.md section.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402
from run_busbw import MPI_FLAGS, mpirun_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--pairs", type=int, default=150)
    args = p.parse_args()
    env = dict(os.environ)
    py = os.path.join(os.path.abspath(args.build), "python")
    env["PYTHONPATH"] = py + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    lines = []
    for baseline in ("no-metrics", "nothing"):
        cmd = [mpirun_path(args.build), *MPI_FLAGS, "-np", str(args.np), sys.executable,
               os.path.join(HERE, "metrics_overhead_worker.py"), "--pairs", str(args.pairs),
               "--baseline", baseline]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode != 0:
            sys.stderr.write(out.stdout + out.stderr)
            raise SystemExit(f"run_metrics_overhead: the worker failed ({out.returncode})")
        lines += out.stdout.splitlines()
    rows = []
    for line in lines:
        if not line.startswith("{"):
            continue
        doc = json.loads(line)
        if doc.get("check") == "recorded":
            if not doc["steps"] or not doc["has_collectives"]:
                raise SystemExit(f"run_metrics_overhead: the 'on' side recorded nothing: {doc}")
            continue
        on, off = statistics.median(doc["on"]), statistics.median(doc["off"])
        # The pairs' ratios: each pair ran back to back, so their median
        # is the comparison least moved by a slow spell of the machine.
        pairs = sorted(a / b for a, b in zip(doc["on"], doc["off"]))
        q = statistics.quantiles(pairs, n=4)
        both = doc["baseline"] == "nothing"
        rows.append({
            "case": f"{doc['case']} ({doc['ranks']} ranks, {len(pairs)} step pairs)",
            "metric": ("step time, metrics + flight recorder on (median)" if both
                       else "step time, metrics on (median)"),
            "unit": "ms",
            "strata": on * 1e3,
            "peer": ("metrics and recorder off (same run)" if both
                     else "metrics off, recorder on (same run)"),
            "peer_value": off * 1e3,
            "ratio": statistics.median(pairs),
            "ratio_iqr": [q[0], q[2]],
            "target": "<= 1.01",
        })
    command = f"python3 benchmarks/run_metrics_overhead.py --np {args.np} --pairs {args.pairs}"
    notes = ("On: strata.init(metrics=Metrics()) (every operation recorded: histogram, "
             "byte counter, busbw gauge, time blocked in Wait; the flight recorder on, as by "
             "default) and each step inside Metrics.step(); off: strata.init(metrics=False), "
             "no marker, with the flight recorder on (the metrics' share) or off "
             "(trace=False: issue 26's figure, metrics + recorder). Both worlds in the same "
             "processes, steps alternating one by one; ratio = median over pairs of on/off "
             "(ratio_iqr: the pairs' quartiles). "
             "build/benchmarks/metrics_sink_bench gives the registry's own cost per "
             "operation and per step.")
    path = bench_util.write_results("metrics_overhead", command, rows, notes)
    bench_util.print_rows(rows, path)


if __name__ == "__main__":
    main()
