"""The demo's last act: in-process recovery (run by tools/run_demo.sh after
demo.py).

This program is the watcher from outside: it launches strata's elastic
example (examples/elastic/train.py, dp3 x tp2 and 2 hot spares on 8 CPU
ranks) under the launcher's fault-tolerant line, shows rank 0's step lines,
announces and sends a SIGKILL to one rank partway through training, then
shows what the survivors did: how the failure was found, the failed set
they agreed on, the spare that took the killed rank's place (receiving its
state from the members of its dp group, so dp stays 3), where the state came
from, and the loss going on along the same curve; at the end the recovery
figures, measured from the kill. Later in the same job one rank turns slow
(the example's ``--slow``: it sleeps 3x as long as the others each step)
and strata's straggler policy (the default strata.elastic.StragglerPolicy:
compute time above 2x the P95 of the others' for 5 consecutive steps)
evicts it, with the numbers it decided on; the second spare takes its
place. Each process that was killed or evicted is started again
(``--restarts``, strata.elastic.supervise) and joins the running job at a
step boundary as a spare, so the spares are back to 2 by the end (with
``--spares 0``, dp4 x tp2: the failed and the evicted rank's replicas are
dropped, and the restarted processes complete a replica again: dp grows
back).

    python3 examples/demo/recovery.py [--launcher torchrun|mpirun] [--np 8]
        [--mpirun PATH] [--steps 60] [--kill-step 12] [--victim 5]
        [--straggler 3] [--slow-step 18] [--spares 2] [--restarts 2]

Under torchrun (the default: Gloo, which can take a joining process) the
example's strata.elastic.supervise(restarts=) keeps torchrun's agent from
stopping the others and starts the new processes; under mpirun the line has
--with-ft ulfm (without it prterun ends the job when a process dies) and
nothing joins (the MPI backend cannot add a process to a running job). The
exit status is the job's (0 when the survivors finish), or 1 when the demo
saw no recovery (or no join, with restarts).
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "elastic", "train.py")
BARS = " ▁▂▃▄▅▆▇█"


def command(launcher, np, mpirun, example_args):
    if launcher == "mpirun":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ([mpirun, "--with-ft", "ulfm"] + root
                + ["--oversubscribe", "--bind-to", "none", "-np", str(np),
                   sys.executable, EXAMPLE] + example_args)
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(np), EXAMPLE] + example_args)


def read_pid(pid_dir, rank, deadline):
    path = os.path.join(pid_dir, f"{rank}.pid")
    while time.time() < deadline:
        try:
            with open(path) as f:
                return int(f.read())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise SystemExit(f"demo: rank {rank} wrote no pid to {path}")


def sparkline(values):
    """One character per value; a value that is not finite shows as "!"."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "!" * len(values)
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    return "".join(BARS[1 + int((v - lo) / span * (len(BARS) - 2))] if math.isfinite(v) else "!"
                   for v in values)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launcher", choices=["mpirun", "torchrun"], default="torchrun")
    ap.add_argument("--np", type=int, default=8)
    ap.add_argument("--mpirun", default=os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--restarts", type=int, default=2,
                    help="torchrun: start a killed or evicted process again, which joins")
    ap.add_argument("--kill-step", type=int, default=12, help="kill once this step is committed")
    ap.add_argument("--victim", type=int, default=5, help="the world rank to kill")
    ap.add_argument("--straggler", type=int, default=3,
                    help="the job rank made slow after the kill (-1: none)")
    ap.add_argument("--slow-step", type=int, default=18, help="the first step it is slow in")
    ap.add_argument("--spares", type=int, default=2,
                    help="hot spares: the last ranks stand by and take a lost rank's place")
    ap.add_argument("--lr", type=float, default=0.002, help="the example's --lr")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for the whole act")
    args = ap.parse_args(argv)
    if not 0 < args.victim < args.np - args.spares:
        raise SystemExit(f"demo: --victim {args.victim} must be in 1..{args.np - args.spares - 1} "
                         "(a member other than rank 0, which prints what the demo shows)")

    pid_dir = tempfile.mkdtemp(prefix="strata-demo-pids-")
    # --lr: the example's loss sums the squared errors over its 64 outputs
    # (not their mean), so its default 0.05 is 64x too large for this
    # width and diverges within 10 steps, failure or not.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import demo_observe
    timeline_dir = os.path.join(demo_observe.OUT, "recovery-timeline")
    shutil.rmtree(timeline_dir, ignore_errors=True)
    example_args = ["--steps", str(args.steps), "--pid-dir", pid_dir, "--step-sleep", "0.1",
                    "--lr", str(args.lr), "--timeline", timeline_dir, "--spares", str(args.spares)]
    restarts = args.restarts if args.launcher == "torchrun" else 0
    if restarts:
        example_args += ["--restarts", str(restarts)]
    if args.straggler >= 0:
        example_args += ["--straggler-policy", "evict",
                         "--slow", f"{args.straggler}:3:{args.slow_step}"]
    cmd = command(args.launcher, args.np, args.mpirun, example_args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print("\n== 7. In-process recovery: a rank is killed from outside while the model trains, "
          f"then a straggler is evicted{' (2 hot spares take their places)' if args.spares else ''}"
          f"{'; both processes are started again and join back' if restarts else ''}\n"
          f"$ {' '.join(os.path.relpath(c, ROOT) if c == EXAMPLE else c for c in cmd)}", flush=True)
    deadline = time.time() + args.timeout
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    timer = threading.Timer(args.timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.daemon = True
    timer.start()
    losses, t_kill, recovery, first_after, killed_at_step = [], None, None, None, None
    eviction, spares, joins = None, [], []
    try:
        for line in proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                print(line, end="", flush=True)  # the example's other output
                continue
            ev = rec.get("event")
            if ev == "step":
                losses.append((rec["step"], rec["loss"], t_kill is not None))
                if recovery is not None and first_after is None:
                    first_after = rec
                    print(f"  step {rec['step']:3d}  loss {rec['loss']:.5f}  world {rec['world']}  "
                          f"dp {rec['dp']}   <- the failed step, redone on the new mesh", flush=True)
                else:
                    print(f"  step {rec['step']:3d}  loss {rec['loss']:.5f}  world {rec['world']}  "
                          f"dp {rec['dp']}", flush=True)
                if rec["step"] == args.kill_step and t_kill is None:
                    pid = read_pid(pid_dir, args.victim, deadline)
                    print(f"\n>>> killing rank {args.victim} (pid {pid}) with SIGKILL, from outside "
                          "the job, while step "
                          f"{args.kill_step + 1} runs\n", flush=True)
                    t_kill = time.time()
                    os.kill(pid, signal.SIGKILL)
                    killed_at_step = args.kill_step
            elif ev == "eviction":
                eviction = rec
                show_eviction(rec)
            elif ev == "spare":
                spares.append(rec)
                for p in rec["placed"]:
                    print(f"  spare     : rank {p['spare']} holds rank {p['failed']}'s place since "
                          f"this step, dp {rec['dp']}; {rec['first_step_s']:.3f} s from the "
                          f"failure to here; spares left {rec['spares_left']}", flush=True)
            elif ev == "join":
                joins.append(rec)
                how = (f"completes a replica: dp {rec['dp']}" if rec["grown"]
                       else f"stands by as a spare (spares {rec['spares']})")
                print(f"  join      : restarted process(es) {rec['joined']} joined the running job "
                      f"and {how}; {rec['first_step_s']:.3f} s from the admission to the end of "
                      "this step", flush=True)
            elif ev == "recovery" and (rec.get("cause") or {}).get("source") == "join":
                pass  # shown by its join line
            elif ev == "recovery" and rec.get("reason") == "straggler":
                show_recovery(rec, None)
                eviction = dict(eviction or {}, evicted_at_step=rec.get("step"),
                                regroup_s=rec["agree_s"] + rec["rebuild_s"] + rec["restore_s"])
            elif ev == "recovery":
                recovery = rec
                show_recovery(rec, t_kill)
    finally:
        timer.cancel()
    rc = proc.wait()
    if recovery is None:
        print("demo: the job ended without a recovery line", file=sys.stderr, flush=True)
        return rc or 1
    if args.straggler >= 0 and eviction is None:
        print("demo: the straggler was not evicted", file=sys.stderr, flush=True)
        rc = rc or 1
    if args.spares and len(spares) < 1:
        print("demo: no spare took a lost rank's place", file=sys.stderr, flush=True)
        rc = rc or 1
    if restarts and not joins:
        print("demo: no restarted process joined back", file=sys.stderr, flush=True)
        rc = rc or 1
    show_figures(recovery, t_kill, losses, killed_at_step, eviction, spares, joins)
    return rc


def show_eviction(rec):
    ms = ", ".join(f"{t * 1e3:.0f}" for t in rec["compute_s"])
    ref = ", ".join(f"{t * 1e3:.0f}" for t in rec["others_percentile_s"])
    print(f"\n--- straggler: rank {rec['rank']} is slow (its compute time, step time minus its "
          "time blocked in collectives) ---\n"
          f"  steps {rec['first_step']}-{rec['last_step']}: rank {rec['rank']} computed [{ms}] ms, "
          f"the P{rec['percentile']:g} of the others [{ref}] ms: at least {rec['ratio']:.2f}x, "
          f"above {rec['factor']:g}x for {rec['steps']} steps in a row -> evicted (every rank "
          "took the same decision from one all-gather of these times)", flush=True)


def show_recovery(rec, t_kill):
    cause = rec.get("cause") or {}
    if rec.get("reason") == "straggler":
        print(f"  regroup   : rank(s) {rec['failed']} evicted, {placed_text(rec)}; "
              f"{rec['mesh_before']['describe']} -> "
              f"{rec['mesh_after']['describe']} in {rec['agree_s'] + rec['rebuild_s']:.3f} s, "
              f"restored from {rec.get('restored_from')}; step {rec.get('step')} runs on the "
              "new mesh\n", flush=True)
        return
    how = {"backend": "the backend's error in a collective", "probe": "its process gone (/proc probe)",
           "heartbeat": "its heartbeat stopped", "commit": "the step commit",
           "request": "a request"}.get(cause.get("source"), cause.get("source"))
    print("\n--- recovery (in the same processes) ---", flush=True)
    if t_kill is not None and rec.get("known_by_all_at"):
        print(f"  detection : rank {cause.get('suspect')} found failed by rank {cause.get('reporter')} "
              f"through {how}; every survivor knew {rec['known_by_all_at'] - t_kill:.3f} s after "
              "the kill", flush=True)
    print(f"  agreement : failed set {rec['failed']}, epoch {rec['epoch_before']} -> {rec['epoch']} "
          f"({rec['agree_s']:.3f} s); {placed_text(rec)}", flush=True)
    before = (rec.get("mesh_before") or {}).get("describe", "?")
    after = (rec.get("mesh_after") or {}).get("describe", "?")
    print(f"  new mesh  : {before}  ->  {after}  (shrink + rebuild {rec['rebuild_s']:.3f} s)",
          flush=True)
    print(f"  restore   : from {rec.get('restored_from')} ({rec['restore_s']:.3f} s), the state "
          f"of step {rec.get('step')}; the failed step is run again\n", flush=True)


def placed_text(rec):
    """What the regroup did with the lost ranks' replicas."""
    if rec.get("replaced"):
        return ", ".join(f"spare {s} takes rank {f}'s place (its tp/pp position; the state comes "
                         "from the members of its dp group)" for f, s in rec["replaced"])
    return f"ranks {rec.get('leaving', [])} leave with their replica"


def show_figures(rec, t_kill, losses, killed_at_step, eviction=None, spares=(), joins=()):
    print("\nloss per step (the kill after step "
          f"{killed_at_step}; the curve goes on where it was):", flush=True)
    vals = [loss for _, loss, _ in losses if loss is not None]
    if vals:
        line = sparkline(vals)
        mark = " " * (killed_at_step or 0) + "^ kill"
        print(f"  {line}\n  {mark}", flush=True)
    if t_kill is None:
        return
    cause = rec.get("cause") or {}
    t_step = (cause.get("failed_at") or 0) + (rec.get("first_step_s") or 0)
    print("\nrecovery figures (from the SIGKILL):", flush=True)
    rows = [("every survivor knew", rec.get("known_by_all_at")),
            ("new world's first collective done", rec.get("rebuilt_at")),
            ("first step completed (the redone one)", t_step if cause.get("failed_at") else None)]
    for name, at in rows:
        if at:
            print(f"  {name:40s} {at - t_kill:7.3f} s", flush=True)
    print(f"  phases: detect {rec['detect_s']:.3f} s, agree {rec['agree_s']:.3f} s, rebuild "
          f"{rec['rebuild_s']:.3f} s, restore {rec['restore_s']:.3f} s (docs/elastic.md; "
          "benchmarks/RESULTS.md has the medians over 10 kills and the peers)", flush=True)
    # The demo's summary table (examples/demo/demo_observe.py), with this act's figure.
    import demo_observe
    import strata.timeline
    try:
        merged, ranks = strata.timeline.merge(os.path.join(demo_observe.OUT, "recovery-timeline"))
        print(f"\ntimeline of the survivors ({len(ranks)} ranks; every step, the failed one, the "
              f"recovery's phases): {merged}", flush=True)
    except (strata.InvalidArgument, OSError) as e:
        print(f"\nno timeline: {e}", flush=True)
    if cause.get("failed_at"):
        demo_observe.record_recovery(t_step - t_kill, {
            k: rec.get(k) for k in ("detect_s", "agree_s", "rebuild_s", "restore_s", "failed",
                                    "epoch", "replaced")}, eviction, list(spares), list(joins))
    demo_observe.print_summary()


if __name__ == "__main__":
    sys.exit(main())
