#!/usr/bin/env python3
"""Recovery benchmark driver: one rank of an 8-rank data-parallel training job
is SIGKILLed from outside; how long until the survivors train again, for
strata's in-process recovery and for two peers on the same job and fault.

    python3 benchmarks/run_recovery.py [--build build] [--kills 10] [--sides torchrun,torchft,strata]

It takes /tmp/strata-mpirun.lock for the whole run (it launches 8-rank jobs),
unless an ancestor `flock` on that file already holds it. About 15 minutes
with the defaults on this 2-core machine; `--kills N` shortens it.

The job (benchmarks/recovery/job.py, the same for every side)
  8 CPU ranks, one data-parallel replica each (torchft does only data-parallel
  replica groups; strata's example runs with --tp 1 --dp 8 here). The model of
  strata's example (examples/elastic/train.py) at tp = 1: 6 residual blocks
  x + W2 gelu(W1 x) of width 512 (W1 512 -> 2048, W2 2048 -> 512) and a
  512 x 512 head, 12,860,928 fp32 parameters; a fixed synthetic regression set
  (4096 samples, targets tanh(x W)); a global batch of 48 samples per step (6
  per replica), MSE, SGD with momentum 0.9 and lr 0.05 after a 10-step warm-up;
  one torch thread per rank. A step here is dominated by the all-reduce of the
  51 MB of gradients over 8 ranks sharing 2 cores (each run measures its own
  step time; the results give the median).

The fault
  Kill i hits rank 1 + (i mod 7) (never rank 0, which holds what the driver
  reads) with SIGKILL from the driver, at a phase p_i of a step after a
  committed step (p_i drawn from random.Random(--seed), the same sequence for
  every side): inside the next step's compute or gradient all-reduce.

The figures (median over the kills that recovered)
  - kill -> first collective among the survivors: the time every member of
    the new group has completed its first collective (torchrun: DDP's
    constructor broadcast in the restarted workers; torchft: the first
    successful Manager.allreduce; strata: the recovery line's arrival minus
    its restore_s, i.e. the end of the rebuild whose Shrink is the survivors'
    first collective);
  - kill -> first committed step: the time every member committed its first
    step after the kill (also in steps of the side's own steady step time);
  - committed steps redone: steps committed before the kill that have to be
    computed again (torchrun: back to the checkpoint; in-process recovery: 0);
  - time lost: when the step in flight at the kill is finally committed,
    minus when it would have been without the kill (last commit + one step):
    the goodput loss in seconds;
  - the phases of each side (each a difference of successive "every rank is
    past this point" times, so they add up to kill -> first step).

Peer 1, the conventional way (recovery/torchrun_peer.py, torchrun_worker.py)
  torchrun --standalone --nproc-per-node 8 --max-restarts <kills>, gloo, DDP,
  torch.save checkpoints every --ckpt-every (10) steps by rank 0, loaded by
  every rank when it starts. Kill i comes --kill-offset (5) steps after the
  checkpoint of step 10*(i+1): the expected loss of a failure at a random
  time between checkpoints.

Peer 2, torchft 0.2.0 from PyPI (recovery/torchft_peer.py, torchft_worker.py)
  Installed into a venv with --system-site-packages (reusing this machine's
  torch) under ~/.cache/strata-bench/torchft-venv, which this driver creates
  when it is missing (python3 -m venv --system-site-packages + pip install
  torchft==0.2.0; nothing goes into the machine's Python or the repository).
  8 replica groups of 1 rank, one Lighthouse (the wheel's torchft_lighthouse),
  torchft.ProcessGroupGloo, CPU; gradients averaged with Manager.allreduce and
  committed through torchft.Optimizer (should_commit). torchft's DDP wrapper
  is probed once on a kill (--ddp-probe) and its outcome reported; it is not
  the measured path. Settings: its defaults, its train_ddp.py example's, and
  the fastest honest ones (torchft_peer.CONFIGS says which and why). The
  killed replica is started again after the survivors recover.

strata (recovery/strata_side.py)
  examples/elastic/train.py, one launch per kill, under
  mpirun --with-ft ulfm (default) or torchrun (--strata-launcher), with
  --tp 1 --dp 8, the job's sizes, 25 MiB gradient buckets (DDP's) and
  --lr LR/HIDDEN (its loss sums the squared errors over the outputs where
  the peers average them: the same SGD steps, job.strata_lr). The times come
  from rank 0's recovery line (wall-clock, the driver's clock): first
  collective = rebuilt_at (the end of the new world's first barrier), first
  step = cause.failed_at + first_step_s; phases from the kill: detection
  (kill -> every survivor knew), agreement, rebuild, restore, the redone step.

Overhead with no failure (--sides overhead, recovery/overhead.py)
  One job of the same model per launcher (--overhead-launchers: mpirun
  --with-ft ulfm, torchrun) and rank count (--overhead-np: 8, the job's, and
  2, one rank per core) trains
  alternating blocks of steps with the elastic loop off (a plain loop over
  the same step body) and on (strata.elastic.run); the ratio of the median
  step times, and the loop's own time per step (recovery/overhead.py).
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "recovery"))
import analysis  # noqa: E402
import bench_util  # noqa: E402
import harness  # noqa: E402
import job  # noqa: E402
import overhead as overhead_job  # noqa: E402
import strata_side  # noqa: E402
import torchft_peer  # noqa: E402
import torchrun_peer  # noqa: E402

TORCHFT_VERSION = "0.2.0"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "strata-bench", "torchft-venv")
STRATA_EXAMPLE = os.path.join(ROOT, "examples", "elastic", "train.py")
# Gradient buckets of 25 MiB, as the peers' (DDP's bucket_cap_mb=25; torchft's
# Manager.allreduce buckets).
STRATA_FLAGS = ("--tp 1 --dp 8 --hidden {hidden} --layers {layers} --batch {batch} "
                "--samples {samples} --lr {strata_lr} --bucket-kib 25600 --steps {steps} --pid-dir {pid_dir}")
STRATA_CMDS = {
    "mpirun": "{mpirun} --allow-run-as-root --oversubscribe --bind-to none --with-ft ulfm -np 8 "
              "-x PYTHONPATH -x OMP_NUM_THREADS=1 {python} {example} " + STRATA_FLAGS,
    "torchrun": "torchrun --standalone --nproc-per-node 8 {example} " + STRATA_FLAGS,
}
KEYS = ["kill_to_collective", "kill_to_step", "kill_to_step_steps", "steps_redone", "lost_s",
        "step_time"]


def log(msg):
    print(msg, flush=True)


def ensure_torchft(venv):
    """The torchft venv's path, made when missing; or (None, why not)."""
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import torchft, torch, importlib.metadata as m; "
             "print(m.version('torchft'), torch.__version__)"]
    if not os.path.exists(python):
        log(f"creating the torchft venv: python3 -m venv --system-site-packages {venv}; "
            f"pip install torchft=={TORCHFT_VERSION}")
        os.makedirs(os.path.dirname(venv), exist_ok=True)
        for cmd in ([sys.executable, "-m", "venv", "--system-site-packages", venv],
                    [python, "-m", "pip", "install", "-q", f"torchft=={TORCHFT_VERSION}"]):
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                return None, f"`{' '.join(cmd)}` failed: {(out.stderr or out.stdout).strip()[-500:]}"
    out = subprocess.run(check, capture_output=True, text=True)
    if out.returncode != 0:
        return None, f"`import torchft` in {venv} failed: {out.stderr.strip()[-500:]}"
    version, torch_version = out.stdout.split()
    if version != TORCHFT_VERSION:
        return None, f"{venv} has torchft {version}, not {TORCHFT_VERSION}"
    return (venv, torch_version), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="strata's build dir (for PYTHONPATH)")
    ap.add_argument("--kills", type=int, default=10, help="kills per configuration")
    ap.add_argument("--sides", default="torchrun,torchft,strata,overhead",
                    help="overhead: strata's step with the elastic loop on vs off, no failure")
    ap.add_argument("--overhead-blocks", type=int, default=4, help="blocks of each mode (overhead)")
    ap.add_argument("--overhead-block-steps", type=int, default=8)
    ap.add_argument("--overhead-np", default="8,2",
                    help="rank counts of the overhead jobs (8: the job's; 2: one rank per core)")
    ap.add_argument("--overhead-launchers", default="mpirun,torchrun",
                    help="launchers of the overhead jobs (recovery/overhead.py CMDS)")
    ap.add_argument("--torchft-configs", default="fast,example,defaults")
    ap.add_argument("--torchft-defaults-kills", type=int, default=1,
                    help="kills with torchft's defaults (each takes over a minute: its 60 s timeouts)")
    ap.add_argument("--ddp-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="one kill with torchft.DistributedDataParallel, outcome reported")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-offset", type=int, default=5, help="torchrun: steps after a checkpoint")
    ap.add_argument("--kill-step", type=int, default=15, help="strata: kill after this step")
    ap.add_argument("--steady", type=int, default=3, help="torchft: steps at 8 replicas before a kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=300, help="seconds any one wait may take")
    ap.add_argument("--torchft-deadline", type=float, default=200)
    ap.add_argument("--torchft-venv", default=DEFAULT_VENV)
    ap.add_argument("--strata-launcher", choices=sorted(STRATA_CMDS), default="mpirun",
                    help="which launch line of examples/elastic/train.py (STRATA_CMDS)")
    ap.add_argument("--strata-cmd", default=None,
                    help="a command template instead (placeholders: recovery/strata_side.py)")
    ap.add_argument("--workdir", default=None, help="keep the runs' logs here (default: a temp dir, removed)")
    ap.add_argument("--lock", default="/tmp/strata-mpirun.lock")
    args = ap.parse_args()
    # `timeout` (or a user's Ctrl-C) stops the run through the finally
    # blocks, which stop the jobs this driver started in sessions of their own.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    sides = [s for s in args.sides.split(",") if s]
    rng = random.Random(args.seed)
    phases = [rng.random() for _ in range(max(args.kills, args.torchft_defaults_kills, 1))]
    victims = [1 + i % (job.WORLD - 1) for i in range(len(phases))]
    work = args.workdir or tempfile.mkdtemp(prefix="strata-recovery-")
    os.makedirs(work, exist_ok=True)
    command = "python3 benchmarks/run_recovery.py " + " ".join(sys.argv[1:])
    load_before = os.getloadavg()
    runs = {}
    notes = []
    overhead = None
    try:
        with harness.MultirankLock(args.lock):
            if "torchrun" in sides:
                log("== torchrun --max-restarts + checkpoint reload")
                d = os.path.join(work, "torchrun")
                os.makedirs(d, exist_ok=True)
                kills, extra = torchrun_peer.run(args, d, args.kills, phases, victims, log)
                runs["torchrun"] = (kills, extra)
            if "torchft" in sides:
                got, why = ensure_torchft(args.torchft_venv)
                if not got:
                    notes.append(f"torchft not run: {why}")
                    log(f"torchft not run: {why}")
                else:
                    venv, torch_version = got
                    for name in [c for c in args.torchft_configs.split(",") if c]:
                        cfg = torchft_peer.CONFIGS[name]
                        n = args.torchft_defaults_kills if name == "defaults" else args.kills
                        log(f"== {cfg['label']}: {cfg['detail']}")
                        d = os.path.join(work, f"torchft-{name}")
                        os.makedirs(d, exist_ok=True)
                        runs[f"torchft-{name}"] = torchft_peer.run(args, venv, cfg, d, n, phases,
                                                                   victims, log)
                    if args.ddp_probe:
                        log("== torchft.DistributedDataParallel probe (one kill, fastest settings)")
                        d = os.path.join(work, "torchft-ddp")
                        os.makedirs(d, exist_ok=True)
                        runs["torchft-ddp"] = torchft_peer.run(args, venv, torchft_peer.CONFIGS["fast"],
                                                               d, 1, phases, victims, log, ddp=True)
            strata_values = dict({k: v for k, v in job.job_spec().items()}, python=sys.executable,
                                 example=STRATA_EXAMPLE,
                                 mpirun=os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun"))
            if {"strata", "overhead"} & set(sides):
                os.environ["OMP_NUM_THREADS"] = "1"
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    [os.path.join(os.path.abspath(args.build), "python")]
                    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
            if "overhead" in sides:
                log("== strata, no failure: elastic loop on vs off")
                overhead = [overhead_job.run(args, strata_values, work, int(n), log, launcher)
                            for launcher in args.overhead_launchers.split(",") if launcher
                            for n in args.overhead_np.split(",") if n]
            if "strata" in sides:
                template = args.strata_cmd or (STRATA_CMDS[args.strata_launcher]
                                               if os.path.exists(STRATA_EXAMPLE) else None)
                if template is None:
                    notes.append("strata not run: examples/elastic/train.py not found (and no --strata-cmd)")
                    log("strata not run: examples/elastic/train.py not found")
                else:
                    log("== strata")
                    d = os.path.join(work, "strata")
                    os.makedirs(d, exist_ok=True)
                    runs["strata"] = strata_side.run(args, template, strata_values, d, args.kills, phases,
                                                     victims, log)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    rows, more_notes, details = build_rows(runs)
    if runs or not overhead:
        notes = describe(args, runs, load_before, load_after) + more_notes + notes
        path = bench_util.write_results("recovery", command, rows, "\n".join(notes))
        bench_util.print_rows(rows, path, case_width=48, metric_width=52)
        attach_details(path, details)
    if overhead is not None:
        # Its own results (recovery_overhead.json), so that it can be run
        # again alone (--sides overhead) without dropping the kills' rows.
        rows = overhead_job.rows(overhead, job.parameter_count_formula() / 1e6)
        path = bench_util.write_results("recovery_overhead", command, rows,
                                        overhead_job.note(overhead))
        bench_util.print_rows(rows, path, case_width=48, metric_width=52)
        attach_details(path, {"overhead": overhead})


# Peer labels (the `peer` column) and targets (strata / peer).
PEERS = [
    ("torchrun", "torchrun --max-restarts + torch.save ckpt/10 steps", "<= 0.1"),
    ("torchft-fast", "torchft 0.2.0, fastest honest settings", "<= 0.5"),
    ("torchft-example", "torchft 0.2.0, train_ddp.py settings", "<= 0.5"),
    ("torchft-defaults", "torchft 0.2.0, defaults", "<= 0.5"),
]

CASE = f"{job.WORLD} CPU ranks, dp{job.WORLD}, MLP {job.parameter_count_formula() / 1e6:.1f}M, SIGKILL 1 rank"


def build_rows(runs):
    summary = {name: analysis.summarize(kills, KEYS) for name, (kills, _) in runs.items()}
    s = summary.get("strata", {})
    rows, notes = [], []

    def row(case, metric, unit, strata, peer, peer_value, target=None, **kw):
        rows.append(dict(case=case, metric=metric, unit=unit, strata=strata, peer=peer,
                         peer_value=peer_value, target=target, **kw))

    row(CASE, "kill -> first collective among survivors", "s", s.get("kill_to_collective"),
        None, None, "<= 1.0", target_on="strata")
    row(CASE, "kill -> first committed step", "s", s.get("kill_to_step"), None, None,
        "<= 1.0", target_on="strata")
    row(CASE, "kill -> first committed step, in steps", "steps", s.get("kill_to_step_steps"),
        None, None, "<= 2", target_on="strata")
    for metric, key, unit, with_target in (
            ("kill -> first committed step", "kill_to_step", "s", True),
            ("kill -> first collective among survivors", "kill_to_collective", "s", False),
            ("kill -> first committed step, in steps", "kill_to_step_steps", "steps", False),
            ("committed steps redone", "steps_redone", "steps", False),
            ("time lost (goodput)", "lost_s", "s", False),
            ("step time without failure", "step_time", "s", False)):
        for name, label, target in PEERS:
            if name in summary:
                row(CASE, metric, unit, s.get(key), label, summary[name].get(key),
                    target if with_target else None)
    if "strata" in summary:
        for key, label in strata_side.PHASES:
            row("strata recovery, phase (median)", label, "s", summary["strata"]["phases"].get(key),
                None, None)
    if "torchrun" in summary:
        for key, label in torchrun_peer.PHASES:
            row("torchrun restart, phase (median)", label, "s", None, PEERS[0][1],
                summary["torchrun"]["phases"].get(key))
    for name, label, _ in PEERS[1:]:
        if name in summary:
            for key, plabel in torchft_peer.PHASES:
                row(f"{label.replace('torchft 0.2.0, ', 'torchft ')}, phase (median)", plabel, "s",
                    None, label, summary[name]["phases"].get(key))
            rejoin = runs[name][1].get("rejoin_s")
            if rejoin is not None:
                row(f"{label.replace('torchft 0.2.0, ', 'torchft ')}", "killed replica restarted -> "
                    "its first committed step", "s", None, label, rejoin)
    details = {name: {"summary": summary[name], "kills": _plain(kills), "extra": extra}
               for name, (kills, extra) in runs.items()}
    return rows, notes, details


def _plain(kills):
    return [{k: v for k, v in kill.items() if k not in ("pids",)} for kill in kills]


def describe(args, runs, load_before, load_after):
    out = [f"Job: {job.WORLD} CPU ranks, data parallel over all 8; the residual MLP of "
           f"examples/elastic/train.py at tp 1 ({job.LAYERS} blocks of width {job.HIDDEN}, "
           f"{job.parameter_count_formula():,} parameters), global batch {job.GLOBAL_BATCH}, SGD "
           "with momentum, fixed synthetic data, 1 torch thread per rank "
           "(benchmarks/recovery/job.py). One rank SIGKILLed from outside per kill, at a seeded "
           f"random phase of a step (seed {args.seed}); medians over the kills that recovered. "
           f"Load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after: other "
           "engineers share the 2 cores. Methodology: benchmarks/run_recovery.py's docstring and "
           "benchmarks/recovery/README.md.", ""]
    for name, (kills, extra) in runs.items():
        summ = analysis.summarize(kills, KEYS)
        line = f"- {name}: {summ['recovered']}/{summ['kills']} kills recovered"
        if summ["kill_to_step"] is not None:
            line += (f"; kill -> first step min {summ['kill_to_step_min']:.2f} / median "
                     f"{summ['kill_to_step']:.2f} / max {summ['kill_to_step_max']:.2f} s")
        errors = sorted({k["error"] for k in kills if k.get("error")})
        if errors:
            line += "; failures: " + " | ".join(errors)
        if name == "torchrun":
            line += (f"; import torch {_f(extra.get('import_torch_s'))} s per process (median), "
                     f"checkpoint {_f((extra.get('ckpt_bytes') or 0) / 1e6)} MB saved in "
                     f"{_f(extra.get('ckpt_save_s'))} s")
        if name.startswith("torchft"):
            crashed = sorted({r for k in kills for r in (k.get("crashed") or [])})
            line += (f"; torchft {extra.get('torchft')} on torch {extra.get('torch')}; "
                     f"spurious failed steps outside recoveries: {extra.get('spurious_failures')}; "
                     f"survivor replicas that crashed: {crashed or 'none'}")
            if name == "torchft-ddp":
                line += "; DDP wrapper errors: " + (" | ".join(extra.get("ddp_errors") or []) or "none")
        out.append(line)
    return out


def _f(v):
    return "-" if v is None else f"{v:.2f}"


def attach_details(path, details):
    """Per-kill figures next to the rows (RESULTS.md shows only the rows)."""
    import json
    with open(path) as f:
        doc = json.load(f)
    doc["details"] = details
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
