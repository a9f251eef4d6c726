#!/usr/bin/env python3
"""Straggler benchmark driver (issue 25): one rank of an 8-rank job turns 3x
slow; how many steps until strata's straggler policy evicts it, and the job's
throughput before, during and after, against the same job without the
policy (which goes on at the straggler's pace).

    python3 benchmarks/run_stragglers.py [--build build] [--runs 3]

The job: examples/elastic/train.py under ``mpirun --with-ft ulfm``, 8 CPU
ranks as dp4 x tp2, the example's default model (4 residual blocks of width
64), a global batch of 48 samples, ``--step-sleep 0.05`` (each step sleeps
50 ms: its pace is set by the sleep, not by 8 ranks sharing 2 cores, so that
the slowdown is exactly what the run asks for) and ``--slow 5:3:ONSET`` (job
rank 5 sleeps 150 ms per step from step ONSET on). Side "strata":
``--straggler-policy evict`` (the default StragglerPolicy: compute time above
2x the P95 of the others' for 5 consecutive steps); side "no policy":
``--straggler-policy off``. Throughput: samples per second from rank 0's
step lines (the time each step committed), over the steps before the onset,
from the onset to the eviction (the same steps for both sides) and after it.
After the eviction dp is 3 (the evicted rank's replica leaves with it) and
the global batch is kept: with sleep-paced steps the remaining replicas'
larger share costs no time, so "after" shows the pace recovered, not the
compute a real job would lose with one replica fewer (3/4 of it at best).
It takes /tmp/strata-mpirun.lock for each job.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_util  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "elastic", "train.py")
NP, STEPS, ONSET, SLOW_RANK, BATCH, SLEEP = 8, 40, 10, 5, 48, 0.05


def run_job(build, policy):
    mpirun = os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = (["flock", "/tmp/strata-mpirun.lock", mpirun, "--with-ft", "ulfm"] + root
           + ["--oversubscribe", "-np", str(NP), sys.executable, EXAMPLE, "--steps", str(STEPS),
              "--batch", str(BATCH), "--step-sleep", str(SLEEP), "--straggler-policy", policy,
              "--slow", f"{SLOW_RANK}:3:{ONSET}"])
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(build), "python"))
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"the job failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = []
    for ln in out.stdout.splitlines():
        try:
            lines.append(json.loads(ln))
        except ValueError:
            pass
    return lines


def rate(times, first, last):
    """Samples per second over committed steps first+1..last (times[s]: when step s committed)."""
    return BATCH * (last - first) / (times[last] - times[first])


def measure(lines, evicted_at):
    times = {ln["step"]: ln["time"] for ln in lines if ln.get("event") == "step"}
    return {"before": rate(times, 2, ONSET), "during": rate(times, ONSET, evicted_at),
            "after": rate(times, evicted_at + 1, STEPS), "total_s": times[STEPS] - times[1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    strata_runs, off_runs, delays, ratios = [], [], [], []
    for i in range(args.runs):
        lines = run_job(args.build, "evict")
        ev = [ln for ln in lines if ln.get("event") == "eviction"]
        rec = [ln for ln in lines if ln.get("event") == "recovery"]
        if len(ev) != 1 or ev[0]["rank"] != SLOW_RANK or len(rec) != 1:
            raise SystemExit(f"run {i}: expected one eviction of rank {SLOW_RANK}, got {ev}")
        evicted_at = rec[0]["step"]  # the first step run without it
        delays.append(evicted_at - ONSET)
        ratios.append(ev[0]["ratio"])
        strata_runs.append(measure(lines, evicted_at))
        off = run_job(args.build, "off")
        off_runs.append(measure(off, evicted_at))
        print(f"run {i}: evicted {evicted_at - ONSET} steps after the onset (ratio "
              f"{ev[0]['ratio']}); strata {strata_runs[-1]}, no policy {off_runs[-1]}", flush=True)

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    case = f"rank {SLOW_RANK} at 3x from step {ONSET}, 8 ranks (dp4 x tp2), {STEPS} steps"
    rows = [
        {"case": case, "metric": "steps from onset to eviction", "unit": "steps",
         "strata": statistics.median(delays), "peer": "-", "peer_value": None,
         "target": "<= 6", "target_on": "strata"},
        {"case": case, "metric": "straggler's compute / P95 of the others (at eviction)",
         "unit": "x", "strata": statistics.median(ratios), "peer": "-", "peer_value": None},
    ]
    for phase, what in (("before", f"steps 3-{ONSET}"),
                        ("during", "from the onset to the eviction"),
                        ("after", "after the eviction")):
        rows.append({"case": f"{case}: {what}", "metric": "throughput", "unit": "samples/s",
                     "strata": med(strata_runs, phase), "peer": "the same job, no policy",
                     "peer_value": med(off_runs, phase)})
    rows.append({"case": case, "metric": "time for steps 2-40", "unit": "s",
                 "strata": med(strata_runs, "total_s"), "peer": "the same job, no policy",
                 "peer_value": med(off_runs, "total_s")})
    notes = (f"Median over {args.runs} runs of each side, alternating. "
             + " ".join(__doc__.split("\n\n")[2].split()))
    command = "python3 benchmarks/run_stragglers.py" + (
        f" --runs {args.runs}" if args.runs != 3 else "")
    path = bench_util.write_results("stragglers", command, rows, notes)
    bench_util.print_rows(rows, path, case_width=60, metric_width=50)


if __name__ == "__main__":
    main()
