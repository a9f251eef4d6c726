#!/usr/bin/env python3
"""Goodput benchmark (issue 25): the same training job for a fixed time with
a fault every minute, kills and slowdowns in turn, each killed or evicted
process started again; strata (hot spares, straggler eviction, rejoin)
against the conventional way (torchrun --max-restarts and a checkpoint
reload).

    python3 benchmarks/run_goodput.py [--build build] [--minutes 10] [--every 60]

The job (benchmarks/recovery/job.py's model, as the recovery benchmark):
6 residual blocks of width 512 (12.9 M fp32 parameters), a global batch of
48 samples, SGD with momentum, 6 data-parallel ranks on this machine's CPU,
one torch thread each.

- strata: ``torchrun --standalone --nproc-per-node 8
  examples/elastic/train.py --tp 1 --dp 6 --spares 2 --restarts 20
  --straggler-policy evict`` (Gloo): 6 ranks train, 2 stand by; a killed
  rank's place goes to a spare, a slowed rank is evicted after the policy's
  window and its place goes to a spare; every killed or evicted process is
  started again by strata.elastic.supervise and joins as a spare.
- torchrun: ``torchrun --standalone --nproc-per-node 6 --max-restarts 20
  benchmarks/recovery/torchrun_worker.py`` (Gloo, DDP), a torch.save
  checkpoint every 10 steps by rank 0; a kill restarts every worker, which
  reload the checkpoint and redo the steps after it; a slowed rank slows
  every step (nothing evicts it).

The faults, the same schedule on both sides: at every ``--every`` seconds
after the first step (60, 120, ...; none in the last interval), in turn:
SIGKILL of the process at mesh position p, or that process slowed from
outside for 45 s (tools/slow_rank.py, stopped 90% of each 20 ms, as the
straggler test's: nominally 10x, but with 8 processes on 2 cores the others
are descheduled part of the time too, and the job's step gets about 2-2.5x
slower; a gentler duty cycle, 67% stopped, slowed the step only 1.3x and
stayed below the policy's 2x, so nothing was evicted), p cycling through
1..5 (rank 0 prints the steps). The run stops ``--minutes`` after its
first step.

Goodput: the steps completed and never redone by the end (the last step
number), times the side's own steady step time (the median step of the
minute before the first fault), over the run's time: the fraction of the
time the job trained at its fault-free pace. Also the samples trained per
second. It takes /tmp/strata-mpirun.lock for each side.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "recovery"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import bench_util  # noqa: E402
import job as J  # noqa: E402

DP, SPARES, POSITIONS, SLOW_S = 6, 2, [1, 2, 3, 4, 5], 45.0


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_pid(path):
    try:
        with open(path) as f:
            pid = int(f.read())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


class Faults:
    """Injects the schedule into a running job: ``pid_of(p)`` names the
    process at position p now."""

    def __init__(self, pid_of, every, duration):
        self.pid_of, self.every, self.duration = pid_of, every, duration
        self.done, self.slowers = [], []

    def run(self, t0, alive):
        k = 1
        while k * self.every < self.duration - 1e-9 and alive():
            when = t0 + k * self.every
            time.sleep(max(0.0, when - time.time()))
            kind = "kill" if k % 2 == 1 else "slow"
            p = POSITIONS[(k - 1) % len(POSITIONS)]
            pid = None
            for _ in range(50):  # a position being taken over: its file comes
                pid = self.pid_of(p)
                if pid:
                    break
                time.sleep(0.1)
            if pid is None:
                self.done.append({"t": time.time() - t0, "kind": kind, "position": p,
                                  "error": "no live process"})
                k += 1
                continue
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                self.slowers.append(subprocess.Popen(
                    [sys.executable, os.path.join(ROOT, "tools", "slow_rank.py"), "--pid",
                     str(pid), "--stopped", "0.9", "--period", "0.02", "--duration", str(SLOW_S)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.done.append({"t": round(time.time() - t0, 3), "kind": kind, "position": p,
                              "pid": pid})
            log(f"  {kind} position {p} (pid {pid}) at +{time.time() - t0:.1f} s")
            k += 1

    def stop(self):
        for s in self.slowers:
            if s.poll() is None:
                s.send_signal(signal.SIGINT)  # it continues the process on the way out
                try:
                    s.wait(5)
                except subprocess.TimeoutExpired:
                    s.kill()


def stop_job(proc, pid_dir):
    """Ends a torchrun job and every process it started: torchrun's agent
    gets SIGTERM (it stops its workers), then the group and every process
    named in the pid folder (workers run in sessions of their own, and a
    killpg of torchrun's alone leaves them training)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for name in os.listdir(pid_dir) if os.path.isdir(pid_dir) else []:
        pid = read_pid(os.path.join(pid_dir, name))
        if pid:
            os.kill(pid, signal.SIGKILL)


def figures(steps, t0, duration, faults):
    """steps: [(step number completed, time)] of rank 0."""
    inside = [(n, t) for n, t in steps if t0 <= t <= t0 + duration]
    steady = [b[1] - a[1] for a, b in zip(inside, inside[1:])
              if b[0] == a[0] + 1 and t0 + 5 <= a[1] and b[1] <= t0 + faults.every]
    step_s = statistics.median(steady)
    last = max(n for n, _ in inside)
    first = min(n for n, _ in inside)
    useful = last - first
    return {"steady_step_s": step_s, "steps_done": useful,
            "goodput": useful * step_s / duration,
            "samples_per_s": useful * J.GLOBAL_BATCH / duration,
            "steps_computed": len(inside) - 1, "faults": faults.done}


def strata_side(args, tmp):
    import elastic_driver as D
    pid_dir = os.path.join(tmp, "pids")
    ex = ["--tp", "1", "--dp", str(DP), "--spares", str(SPARES), "--restarts", "20",
          "--straggler-policy", "evict", "--hidden", str(J.HIDDEN), "--layers", str(J.LAYERS),
          "--batch", str(J.GLOBAL_BATCH), "--samples", str(J.SAMPLES), "--lr",
          str(J.strata_lr()), "--steps", "1000000"]
    job = D.Job("torchrun", DP + SPARES, ex, tmp, env={"OMP_NUM_THREADS": "1"},
                timeout=args.minutes * 60 + 300)
    log(f"  $ {' '.join(job.cmd)}")
    faults = Faults(lambda p: read_pid(os.path.join(pid_dir, f"pos-{p}.pid")), args.every,
                    args.minutes * 60)
    try:
        job.wait_for(lambda: len(job.steps()) >= 1, "the first step", 300)
        t0 = job.steps()[0]["_t"]
        faults.run(t0, lambda: job.proc.poll() is None)
        time.sleep(max(0.0, t0 + args.minutes * 60 - time.time()))
    finally:
        faults.stop()
        stop_job(job.proc, pid_dir)
    steps = [(ln["step"], ln["_t"]) for ln in job.steps()]
    out = figures(steps, t0, args.minutes * 60, faults)
    out["recoveries"] = [{k: r.get(k) for k in ("epoch", "failed", "replaced", "joined", "grown",
                                                "dp", "reason")} | {"source": r["cause"]["source"]}
                         for r in job.recoveries()]
    out["dp_at_end"] = job.steps()[-1]["dp"]
    out["command"] = " ".join(job.cmd)
    return out


def torchrun_side(args, tmp):
    ev_dir, pid_dir, ckpt = (os.path.join(tmp, d) for d in ("events", "pids", "ckpt"))
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(DP), "--max-restarts", "20",
           os.path.join(HERE, "recovery", "torchrun_worker.py"), "--events", ev_dir, "--pid-dir",
           pid_dir, "--steps", "1000000", "--ckpt-dir", ckpt, "--ckpt-every", "10"]
    log(f"  $ {' '.join(cmd)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", STRATA_BENCH_WORLD=str(DP))
    with open(os.path.join(tmp, "torchrun.out"), "w") as out, \
            open(os.path.join(tmp, "torchrun.err"), "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
    rank0 = os.path.join(ev_dir, "events.0.jsonl")

    def records():
        try:
            with open(rank0) as f:
                return [json.loads(x) for x in f if x.strip()]
        except (OSError, ValueError):
            return []

    faults = Faults(lambda p: read_pid(os.path.join(pid_dir, f"{p}.pid")), args.every,
                    args.minutes * 60)
    try:
        deadline = time.time() + 300
        while not any(r["event"] == "step" for r in records()):
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("torchrun side: no first step")
            time.sleep(0.2)
        t0 = min(r["time"] for r in records() if r["event"] == "step")
        faults.run(t0, lambda: proc.poll() is None)
        time.sleep(max(0.0, t0 + args.minutes * 60 - time.time()))
    finally:
        faults.stop()
        stop_job(proc, pid_dir)
    steps = [(r["step"], r["time"]) for r in records() if r["event"] == "step"]
    out = figures(steps, t0, args.minutes * 60, faults)
    out["restarts"] = max(r.get("attempt", 0) for r in records())
    out["steps_redone"] = out["steps_computed"] - out["steps_done"]
    out["command"] = " ".join(cmd)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=60.0)
    ap.add_argument("--sides", default="strata,torchrun")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.path.join(os.path.abspath(args.build), "python")
    import fcntl
    res = {}
    for side in args.sides.split(","):
        with open("/tmp/strata-mpirun.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
            fcntl.flock(lock, fcntl.LOCK_EX)
            log(f"== {side}")
            res[side] = (strata_side if side == "strata" else torchrun_side)(args, tmp)
            log(f"  {side}: " + json.dumps({k: v for k, v in res[side].items()
                                            if k not in ("faults", "recoveries", "command")}))
    if set(res) != {"strata", "torchrun"}:
        print(json.dumps(res, indent=1))
        return
    s, t = res["strata"], res["torchrun"]
    case = (f"{args.minutes:g} min, a fault every {args.every:g} s (SIGKILL and a slowdown in "
            f"turn, processes restarted), dp{DP}, 12.9 M params, CPU")
    peer = "torchrun --max-restarts + checkpoint reload (ckpt/10 steps)"
    rows = [
        {"case": case, "metric": "goodput (steps kept x fault-free step / time)", "unit": "",
         "strata": s["goodput"], "peer": peer, "peer_value": t["goodput"], "target": ">= 0.9",
         "target_on": "strata"},
        {"case": case, "metric": "samples trained per second", "unit": "samples/s",
         "strata": s["samples_per_s"], "peer": peer, "peer_value": t["samples_per_s"]},
        {"case": case, "metric": "fault-free step (the first minute)", "unit": "s",
         "strata": s["steady_step_s"], "peer": peer, "peer_value": t["steady_step_s"]},
        {"case": case, "metric": "steps computed again (lost to a restart)", "unit": "steps",
         "strata": s["steps_computed"] - s["steps_done"], "peer": peer,
         "peer_value": t["steps_redone"]},
    ]
    notes = (" ".join(__doc__.split("\n\n")[2].split()) + " " + " ".join(__doc__.split("\n\n")[3]
                                                                        .split()) + " "
             + " ".join(__doc__.split("\n\n")[4].split()) + " strata's recoveries: "
             + json.dumps(s["recoveries"]) + "; faults: " + json.dumps(s["faults"])
             + "; torchrun restarts: " + str(t["restarts"]) + ".")
    command = "python3 benchmarks/run_goodput.py" + (
        f" --minutes {args.minutes:g}" if args.minutes != 10 else "") + (
        f" --every {args.every:g}" if args.every != 60 else "")
    path = bench_util.write_results("goodput", command, rows, notes)
    bench_util.print_rows(rows, path, case_width=60, metric_width=50)


if __name__ == "__main__":
    main()
