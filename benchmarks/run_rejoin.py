#!/usr/bin/env python3
"""Rejoin benchmark (issue 25): a 4-rank data-parallel job under torchrun
loses a rank to SIGKILL; strata.elastic.supervise starts a new process for
it, which loads (starts Python, imports torch, warms up) while the three
survivors train on, then asks to join and completes a fourth replica. How
long are the survivors' steps meanwhile, against their normal step?

    python3 benchmarks/run_rejoin.py [--build build] [--runs 3]

The job: examples/elastic/train.py under ``torchrun --standalone
--nproc-per-node 4`` (Gloo) with ``--restarts 1 --tp 1``: 6 residual blocks
of width 512 (12.9 M parameters, as the recovery benchmark), 60 steps of 48
samples, one torch thread per rank, no sleep in the step. Rank 2 is
SIGKILLed from outside at a random moment (0-1 s) after step 8
(tests/python/elastic_driver.py starts the job and kills the rank).

The figures, from rank 0's step lines (each stamped on arrival by this
driver): the normal step (median step interval before the kill); the
survivors' longest step while the joiner loads, the figure with the
target: the longest of the two that follow; the longest step while the
joiner starts (from the first step after the failure's recovery to the
step before its admission: the survivors at dp3 while a fifth process
imports torch on the same 2 cores); the admission step (from the step
before the admission to the first step after it: the agreement, the fresh
job communicator, the new groups, the state sent to the joiner while it
builds its model, and one step at dp4); and the time the joiner took from
its restart to its admission. Ratios are to the normal step. It takes
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

NP, STEPS, KILLED, AFTER = 4, 60, 2, 8
MODEL = ["--hidden", "512", "--layers", "6", "--batch", "48", "--tp", "1"]


def run_job(seed):
    import elastic_driver as D
    import fcntl
    args = ["--steps", str(STEPS), "--restarts", "1"] + MODEL
    with open("/tmp/strata-mpirun.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        job, killed_at, rc = D.run_and_kill("torchrun", NP, args, tmp, KILLED, AFTER,
                                            random.Random(seed), timeout=400,
                                            env={"OMP_NUM_THREADS": "1"})
        if rc != 0:
            raise SystemExit(f"the job failed ({rc}):\n{job.tail()}")
        rec = job.recoveries()
        joins = [x for x in job.lines if x.get("event") == "join"]
        if len(rec) != 2 or len(joins) != 1 or rec[1]["cause"]["source"] != "join":
            raise SystemExit(f"expected a failure and a join:\n{job.tail()}")
        steps = sorted(job.steps(), key=lambda ln: ln["step"])
        t = {ln["step"]: ln["_t"] for ln in steps}
        before = [t[s] - t[s - 1] for s in range(2, AFTER + 1) if s in t and s - 1 in t]
        normal = statistics.median(before)
        # Step numbers are those completed: the failure's recovery line comes
        # with step r (its first step after), the join line with step j.
        r = min(ln["step"] for ln in steps if ln["_t"] >= rec[0]["_t"])
        j = min(ln["step"] for ln in steps if ln["_t"] >= joins[0]["_t"])
        loading = [t[s] - t[s - 1] for s in range(r + 1, j)]
        if not loading:
            raise SystemExit(f"the joiner was admitted at once after the failure:\n{job.tail()}")
        admission = t[j] - t[j - 1]
        joiner_ready = rec[1]["cause"]["failed_at"] - killed_at
        return {"normal_s": normal, "longest_s": max(max(loading), admission),
                "loading_max_s": max(loading),
                "loading_steps": len(loading), "admission_s": admission,
                "kill_to_admission_s": joiner_ready, "dp_after": joins[0]["dp"],
                "agree_s": rec[1]["agree_s"], "rebuild_s": rec[1]["rebuild_s"],
                "restore_s": rec[1]["restore_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.path.join(os.path.abspath(args.build), "python")
    runs = []
    for i in range(args.runs):
        r = run_job(seed=2000 + i)
        runs.append(r)
        print(f"run {i}: {r}", flush=True)
    if any(r["dp_after"] != NP for r in runs):
        raise SystemExit(f"dp did not grow back to {NP}: {runs}")

    def med(key):
        return statistics.median(r[key] for r in runs)

    case = f"SIGKILL of rank {KILLED} after step {AFTER}, dp4 -> dp3 -> dp4, 4 CPU ranks (torchrun)"
    peer = "the survivors' normal step (before the kill)"
    rows = [
        {"case": case, "metric": "survivors' longest step while the joiner loads (starts, "
         "is admitted, receives its state)", "unit": "s", "strata": med("longest_s"),
         "peer": peer, "peer_value": med("normal_s"), "target": "<= 2"},
        {"case": case, "metric": "survivors' longest step while the joiner starts", "unit": "s",
         "strata": med("loading_max_s"), "peer": peer, "peer_value": med("normal_s")},
        {"case": case, "metric": "the admission step (regroup, state to the joiner, one step)",
         "unit": "s", "strata": med("admission_s"), "peer": peer,
         "peer_value": med("normal_s")},
        {"case": case, "metric": "SIGKILL -> the restarted process admitted", "unit": "s",
         "strata": med("kill_to_admission_s")},
    ]
    for phase in ("agree_s", "rebuild_s", "restore_s"):
        rows.append({"case": case, "metric": f"admission phase {phase[:-2]}", "unit": "s",
                     "strata": med(phase)})
    notes = (f"Median over {args.runs} runs. " + " ".join(__doc__.split("\n\n")[2].split()) + " "
             + " ".join(__doc__.split("\n\n")[3].split()))
    command = "python3 benchmarks/run_rejoin.py" + (
        f" --runs {args.runs}" if args.runs != 3 else "")
    path = bench_util.write_results("rejoin", command, rows, notes)
    bench_util.print_rows(rows, path, case_width=60, metric_width=50)


if __name__ == "__main__":
    main()
