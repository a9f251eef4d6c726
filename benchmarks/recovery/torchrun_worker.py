#!/usr/bin/env python3
"""The conventional way, one worker of the recovery benchmark (run_recovery.py).

    torchrun --standalone --nproc-per-node 8 --max-restarts R \\
        torchrun_worker.py --events DIR --pid-dir DIR --steps N --ckpt-dir DIR --ckpt-every K

torch.distributed with gloo, DistributedDataParallel, a checkpoint every K
steps written by rank 0 with torch.save (to a temporary file, then renamed, so
a kill during the write leaves the previous checkpoint), loaded by every rank
when the worker starts. When a rank dies torchrun's agent stops every worker
and starts them all again (``--max-restarts``); the new workers load the latest
checkpoint and redo the steps after it.

Events (job.Events), each with the wall-clock time: start (with the process's
exec time from /proc and the time ``import torch`` finished), pg_ready
(init_process_group returned: the workers' re-rendezvous), model_built,
ckpt_loaded, collective (DDP's constructor broadcast the parameters: the new
world's first collective), step, ckpt_saved.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import job  # noqa: E402

PROC_START = job.process_start_time()
MAIN = time.time()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--pid-dir", default=None)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, required=True)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job.write_pid(args.pid_dir, rank)
    events = job.Events(args.events, rank, echo=rank == 0)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    imported = time.time()
    events.emit("start", attempt=attempt, proc_start=PROC_START, main=MAIN, imported=imported,
                torch=torch.__version__)

    job.set_threads()
    # The agent's store, under a prefix of this attempt. With torch 2.15 the
    # plain env:// init reuses the agent's store without one ("a new
    # TCPStore for every retry", torch/distributed/rendezvous.py), but the
    # store keeps its keys across restarts: the restarted workers read the
    # dead round's Gloo addresses and fail with "connectFullMesh failed ...
    # Connection refused" until --max-restarts is spent (seen here).
    import datetime
    store = dist.PrefixStore(f"bench/attempt_{attempt}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
        timeout=datetime.timedelta(seconds=300)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    events.emit("pg_ready", attempt=attempt)
    model = job.build_model()
    optimizer = job.build_optimizer(model)
    data = job.dataset()
    events.emit("model_built", attempt=attempt)

    latest = os.path.join(args.ckpt_dir, "latest.pt")
    done = 0
    if os.path.exists(latest):
        state = torch.load(latest, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        done = int(state["step"])
    events.emit("ckpt_loaded", attempt=attempt, step=done)

    net = DDP(model)  # broadcasts rank 0's parameters: the first collective
    events.emit("collective", attempt=attempt, what="DDP init broadcast")

    for step in range(done + 1, args.steps + 1):
        x, y = job.replica_batch(data, step, rank)
        job.set_lr(optimizer, step)
        loss = job.loss_fn(net, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        events.emit("step", step=step, loss=loss.item(), world=world, dp=world, attempt=attempt)
        if step % args.ckpt_every == 0 and rank == 0:
            start = time.time()
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = os.path.join(args.ckpt_dir, f".latest.{os.getpid()}.tmp")
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, latest)
            events.emit("ckpt_saved", attempt=attempt, step=step, seconds=time.time() - start,
                        bytes=os.path.getsize(latest))
    events.emit("done", attempt=attempt, step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
