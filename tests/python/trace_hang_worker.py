"""One rank of a job that hangs in one of the usual ways, for test_trace.py:

    mpirun -np 4 python trace_hang_worker.py SCENARIO

with STRATA_TRACE_DIR set. Every rank runs three all-reduces, then:

- skip: rank 3 skips the 4th all-reduce (16 floats) and stalls elsewhere
  (as a rank stuck in its data loader); the others time out in it;
- size: rank 2 calls the 4th all-reduce with 32 floats, the others with 16;
- die:  rank 3 exits before the 4th all-reduce (run with --with-ft ulfm);
- p2p:  rank 1 receives 8 floats from rank 0, which never sends.

The ranks whose operation fails dump their flight recorder and ask every
rank to (the stalled rank's dumper answers); rank 0 also asks in the size
case, where MPI may complete the mismatched call. Each rank then waits
until every live rank's dump is in the directory and exits.
"""

import datetime
import os
import sys
import time

import torch

import strata

TIMEOUT = 3.0


def wait_for_dumps(directory, count, limit=40.0):
    end = time.time() + limit
    while time.time() < end:
        names = [n for n in os.listdir(directory) if n.endswith(".json")]
        if len(names) >= count:
            return
        time.sleep(0.2)


def main():
    scenario = sys.argv[1]
    env = strata.launch_env()
    world = strata.init(timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = env.rank
    g = world.group("world")
    x = torch.ones(8)
    for _ in range(3):
        g.all_reduce(x)
    live = world.size
    try:
        if scenario == "skip":
            if rank == 3:
                time.sleep(4 * TIMEOUT)
            else:
                g.all_reduce(torch.ones(16))
        elif scenario == "size":
            g.all_reduce(torch.ones(32 if rank == 2 else 16))
        elif scenario == "die":
            live = world.size - 1
            if rank == 3:
                os._exit(0)
            g.all_reduce(torch.ones(16))
        elif scenario == "p2p":
            if rank == 1:
                g.recv(torch.empty(8), src=0)
            else:
                time.sleep(2 * TIMEOUT)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except strata.Error as e:
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if scenario == "size" and rank == 0:
        world.request_trace_dump("the test asks after the mismatched all-reduce")
    wait_for_dumps(world.trace_dir, live)
    time.sleep(0.5)
    os._exit(0)


if __name__ == "__main__":
    main()
