"""A launcher made by hand, the way torch.distributed's env:// rendezvous
lets a user start a job without torchrun or srun: N processes of a script,
each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
(127.0.0.1) and MASTER_PORT (a free port) set; there is no agent, so rank
0's process serves the TCPStore (as under srun). Like srun with
``--kill-on-bad-exit=0`` it does not stop the others when one dies.

    python tests/python/env_launch.py --np 4 -- script.py ARGS...

Prints one JSON line per process as it ends (``{"event": "exit", "rank",
"status"}``, status negative for a signal, as subprocess reports it) and
exits 0 when every process exited 0, else 1.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, required=True)
    p.add_argument("script", nargs=argparse.REMAINDER)
    args = p.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    port = str(free_port())
    procs = []
    for r in range(args.np):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.np), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.np), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable] + script, env=env))
    left = dict(enumerate(procs))
    failed = False
    while left:
        for r, proc in list(left.items()):
            status = proc.poll()
            if status is not None:
                del left[r]
                failed = failed or status != 0
                print(json.dumps({"event": "exit", "rank": r, "status": status}), flush=True)
        time.sleep(0.02)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
