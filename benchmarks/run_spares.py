#!/usr/bin/env python3
"""Spare swap-in benchmark (issue 25): an 8-process job, dp3 x tp2 plus two
hot spares, loses a rank to SIGKILL; how long from the kill to the first
step committed at the full dp again, against the same job without spares
(which goes on as dp2 x tp2).

    python3 benchmarks/run_spares.py [--build build] [--runs 3]

The job: examples/elastic/train.py under ``mpirun --with-ft ulfm`` on CPU
ranks, the example's default model (4 residual blocks of width 64), 30
steps of 48 samples, ``--step-sleep 0.05``. Side "strata": 8 processes,
``--spares 2``; side "no spares": the same 6-rank mesh with no spare (the
failed rank's replica is dropped). Job rank 3 is SIGKILLed from outside at
a random moment (0-1 s) after step 10 (tests/python/elastic_driver.py
starts the job and kills the rank). The time is from the kill (this
driver's clock) to the arrival of rank 0's first step line after the
recovery; with spares that step runs at dp3, without at dp2. It takes
/tmp/strata-mpirun.lock for each job.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import bench_util  # noqa: E402

STEPS, KILLED, AFTER = 30, 3, 10


def run_job(spares, seed):
    import elastic_driver as D
    import fcntl
    args = ["--steps", str(STEPS), "--batch", "48", "--step-sleep", "0.05", "--tp", "2"]
    if spares:
        args += ["--spares", str(spares)]
    with open("/tmp/strata-mpirun.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        job, killed_at, rc = D.run_and_kill("mpirun", 6 + spares, args, tmp, KILLED, AFTER,
                                            random.Random(seed), timeout=200)
        if rc != 0:
            raise SystemExit(f"the job failed ({rc}):\n{job.tail()}")
        rec = job.recoveries()
        if len(rec) != 1:
            raise SystemExit(f"expected one recovery, got {len(rec)}:\n{job.tail()}")
        # Rank 0 prints the recovery line at the first step after it.
        first = min((ln for ln in job.steps() if ln["_t"] >= rec[0]["_t"]),
                    key=lambda ln: ln["_t"])
        after = [ln for ln in job.steps() if ln["step"] > first["step"]]
        return {"first_step_s": first["_t"] - killed_at, "dp": first["dp"],
                "phases": {k: rec[0][k] for k in ("detect_s", "agree_s", "rebuild_s",
                                                  "restore_s")},
                "steps_per_s": (len(after) / (after[-1]["_t"] - first["_t"])) if after else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.path.join(os.path.abspath(args.build), "python")
    sides = {"strata": [], "none": []}
    for i in range(args.runs):
        for side, spares in (("strata", 2), ("none", 0)):
            r = run_job(spares, seed=1000 + i)
            sides[side].append(r)
            print(f"run {i} {side}: {r}", flush=True)
    if any(r["dp"] != 3 for r in sides["strata"]) or any(r["dp"] != 2 for r in sides["none"]):
        raise SystemExit(f"unexpected dp after the recovery: {sides}")

    def med(side, key):
        return statistics.median(r[key] for r in sides[side])

    case = (f"SIGKILL of rank {KILLED} after step {AFTER}, dp3 x tp2 (+2 spares), "
            f"8 CPU ranks")
    rows = [
        {"case": case, "metric": "SIGKILL -> first step at the full dp (dp3)", "unit": "s",
         "strata": med("strata", "first_step_s"), "peer": "the same job without spares (dp2)",
         "peer_value": med("none", "first_step_s"), "target": "<= 1.5", "target_on": "strata"},
    ]
    for phase in ("detect_s", "agree_s", "rebuild_s", "restore_s"):
        rows.append({"case": case, "metric": f"recovery phase {phase[:-2]}", "unit": "s",
                     "strata": statistics.median(r["phases"][phase] for r in sides["strata"]),
                     "peer": "the same job without spares",
                     "peer_value": statistics.median(r["phases"][phase] for r in sides["none"])})
    notes = (f"Median over {args.runs} runs of each side, alternating. The restore phase with a "
             "spare includes the spare's model build and the state broadcast over its dp group. "
             + " ".join(__doc__.split("\n\n")[2].split()))
    command = "python3 benchmarks/run_spares.py" + (
        f" --runs {args.runs}" if args.runs != 3 else "")
    path = bench_util.write_results("spares", command, rows, notes)
    bench_util.print_rows(rows, path, case_width=60, metric_width=45)


if __name__ == "__main__":
    main()
