"""Slows a running process from outside: stops it (SIGSTOP) and continues
it (SIGCONT) at a duty cycle, as a throttled GPU, a flapping link or a noisy
neighbour would, without the program's knowledge. For trying strata's
straggler policy (strata.elastic.StragglerPolicy) on a real job:

    mpirun --with-ft ulfm -np 8 python examples/elastic/train.py \\
        --straggler-policy evict --pid-dir /tmp/pids &
    python tools/slow_rank.py --pid-file /tmp/pids/5.pid --stopped 0.75

With ``--stopped 0.75`` the process runs 25% of each ``--period`` (0.04 s
by default): its compute takes about 4x as long. The tool runs until the
process ends (an evicted rank exits), ``--duration`` passes, or it is
interrupted; it always leaves the process continued. It prints one JSON line
when it starts and one when it stops.
"""

import argparse
import json
import os
import signal
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--pid", type=int, help="the process to slow")
    who.add_argument("--pid-file", help="a file holding its pid (waited for up to 60 s)")
    p.add_argument("--stopped", type=float, default=0.75,
                   help="fraction of each period the process is stopped, in [0, 1)")
    p.add_argument("--period", type=float, default=0.04, help="seconds per stop/continue cycle")
    p.add_argument("--duration", type=float, default=0.0,
                   help="stop after this many seconds (0: when the process ends)")
    args = p.parse_args(argv)
    if not 0 <= args.stopped < 1:
        p.error(f"--stopped must be in [0, 1), got {args.stopped}")
    if not args.period > 0:
        p.error(f"--period must be > 0, got {args.period}")
    return args


def read_pid(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return int(f.read())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise SystemExit(f"slow_rank: no pid in {path} after {timeout:g} s")
            time.sleep(0.05)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def keep_time():
    """Runs this tool ahead of the job's processes: on a loaded host a
    starved tool continues the process late and its duty cycle is lost
    (the slowed rank then runs free for tens of milliseconds at a time).
    Real-time scheduling when allowed, else a higher priority, else as is
    (said on stderr)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return "SCHED_FIFO"
    except (AttributeError, PermissionError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice -10"
    except (AttributeError, PermissionError, OSError):
        print("slow_rank: could not raise its priority; on a loaded host the duty cycle is "
              "approximate", file=sys.stderr, flush=True)
        return "normal"


def main(argv=None):
    args = parse(argv)
    scheduling = keep_time()
    pid = args.pid if args.pid is not None else read_pid(args.pid_file)
    stop_s, run_s = args.period * args.stopped, args.period * (1 - args.stopped)
    start = time.time()
    cycles = 0
    print(json.dumps({"event": "slow_rank", "pid": pid, "stopped": args.stopped,
                      "period": args.period, "scheduling": scheduling, "start": start}),
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while alive(pid) and not (args.duration and time.time() - start >= args.duration):
            if stop_s:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stop_s)
                os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
            cycles += 1
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    print(json.dumps({"event": "slow_rank_done", "pid": pid, "cycles": cycles,
                      "seconds": round(time.time() - start, 3), "ended": not alive(pid)}),
          flush=True)


if __name__ == "__main__":
    main()
