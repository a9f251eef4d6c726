"""A launcher made by hand, the way torch.distributed's env:// rendezvous
lets a user start a job without torchrun or srun: N processes of a script,
each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
(127.0.0.1) and MASTER_PORT (a free port) set; there is no agent, so rank
0's process serves the TCPStore (as under srun). Like srun with
``--kill-on-bad-exit=0`` it does not stop the others when one dies.

    python tests/python/env_launch.py --np 4 -- script.py ARGS...

With ``--netns NS0,NS1,...`` rank r runs in network namespace NSr (made
by the caller: ``ip netns exec``) and a UTS namespace named NSr, as on a
host of its own: one rank per node (GROUP_RANK r), Gloo on the namespace's
``eth0`` (or ``--gloo-iface``: a data network apart from the store's), no
host copies. With
``--master-addr``/``--master-port`` the store is one the caller serves, as
torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE=True): no rank serves
it.

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
    p.add_argument("--netns", help="comma-separated network namespaces, one per rank")
    p.add_argument("--gloo-iface", default="eth0",
                   help="with --netns: the namespaces' interface Gloo uses")
    p.add_argument("--master-addr", help="the address of a store served elsewhere")
    p.add_argument("--master-port", type=int)
    p.add_argument("script", nargs=argparse.REMAINDER)
    args = p.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    netns = args.netns.split(",") if args.netns else None
    if netns is not None and len(netns) != args.np:
        p.error(f"--netns names {len(netns)} namespaces for {args.np} ranks")
    addr = args.master_addr or "127.0.0.1"
    port = str(args.master_port or free_port())
    procs = []
    for r in range(args.np):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.np), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.np), MASTER_ADDR=addr, MASTER_PORT=port)
        if args.master_addr:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        cmd = [sys.executable] + script
        if netns is not None:
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(r),
                       GROUP_WORLD_SIZE=str(args.np), GLOO_SOCKET_IFNAME=args.gloo_iface,
                       STRATA_GLOO_CMA="0")
            # A UTS namespace too, with a host name of its own: the ranks'
            # process records then name other hosts, as on a cluster (no
            # /proc probe of a peer, no fencing of one).
            cmd = (["ip", "netns", "exec", netns[r], "unshare", "--uts", "sh", "-c",
                    f'hostname {netns[r]} && exec "$@"', "sh"] + cmd)
        procs.append(subprocess.Popen(cmd, env=env))
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
