#!/usr/bin/env python3
"""One torchft replica group of the recovery benchmark (run_recovery.py).

Run by the driver with the torchft venv's python, one process per replica
group (8 groups of 1 rank), all pointed at one Lighthouse started from the
wheel's ``torchft_lighthouse``. Each process serves its replica group's own
TCPStore (``is_master=True``, as torchft's integration tests do; with one rank
per group there is nobody else to serve it) and trains job.py's model with

  - ``torchft.ProcessGroupGloo`` (CPU), ``torchft.Manager``,
  - ``torchft.Optimizer`` (the OptimizerWrapper: ``zero_grad`` starts the
    quorum, ``step`` asks ``should_commit`` and steps only on True),
  - gradients averaged with ``Manager.allreduce`` on 25 MB buckets (DDP's
    default bucket size) after backward: the path that recovers here. With
    ``--ddp`` the model is wrapped in ``torchft.DistributedDataParallel``
    instead (its comm hook calls the same ``Manager.allreduce``); the driver
    uses that mode only to record how it behaves on a peer failure.

Events (job.Events): start/imported, quorum (torchft's "reconfiguring" log,
i.e. when the quorum answer arrived), pg_configured, failure_seen (the first
error torchft reported in a step), collective (every successful gradient
all-reduce), step (committed), step_failed (should_commit said False).
"""

import argparse
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import job  # noqa: E402

PROC_START = job.process_start_time()
MAIN = time.time()


class TorchftLogEvents(logging.Handler):
    """Turns torchft's own log lines into timed events (the quorum thread logs
    when a quorum answer arrives and when the process group is configured)."""

    def __init__(self, events):
        super().__init__(level=logging.INFO)
        self._events = events
        self._failure_seen = False

    def arm(self):
        self._failure_seen = False

    def emit(self, record):
        msg = record.getMessage()
        if "reconfiguring for quorum_id=" in msg:
            qid = msg.split("quorum_id=", 1)[1].split()[0]
            self._events.emit("quorum", quorum_id=int(qid), time=record.created)
        elif "resetting fr recording for quorum id" in msg:
            self._events.emit("pg_configured", time=record.created)
        elif ("got exception" in msg or "skipping remaining" in msg) and not self._failure_seen:
            self._failure_seen = True
            self._events.emit("failure_seen", error=msg.splitlines()[0][-300:],
                              time=record.created)


def _torchft_version():
    """The installed distribution's version (the torchft module has no
    __version__)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--pid-dir", default=None)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--min-replicas", type=int, default=1)
    # None = torchft's own default (the Manager's / ProcessGroupGloo's).
    ap.add_argument("--pg-timeout", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--quorum-timeout", type=float, default=None)
    ap.add_argument("--connect-timeout", type=float, default=None)
    ap.add_argument("--heartbeat-ms", type=float, default=None)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--echo", action="store_true", help="also print events on stdout")
    args = ap.parse_args()

    events = job.Events(args.events, args.replica, echo=args.echo)
    job.write_pid(args.pid_dir, args.replica)
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    imported = time.time()
    import torchft
    from torchft import Manager, ProcessGroupGloo
    events.emit("start", proc_start=PROC_START, main=MAIN, imported=imported,
                torchft_imported=time.time(), torch=torch.__version__,
                torchft=_torchft_version())
    handler = TorchftLogEvents(events)
    torchft_logger = logging.getLogger("torchft")
    torchft_logger.setLevel(logging.INFO)
    torchft_logger.addHandler(handler)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    job.set_threads()
    model = job.build_model()
    inner = job.build_optimizer(model)
    data = job.dataset()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def seconds(v):
        return None if v is None else timedelta(seconds=v)

    pg = ProcessGroupGloo() if args.pg_timeout is None else ProcessGroupGloo(
        timeout=seconds(args.pg_timeout))
    kwargs = {}
    for name, value in (("timeout", seconds(args.timeout)),
                        ("quorum_timeout", seconds(args.quorum_timeout)),
                        ("connect_timeout", seconds(args.connect_timeout))):
        if value is not None:
            kwargs[name] = value
    if args.heartbeat_ms is not None:
        kwargs["heartbeat_interval"] = timedelta(milliseconds=args.heartbeat_ms)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=pg, min_replica_size=args.min_replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica_{args.replica}", lighthouse_addr=args.lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      **kwargs)
    optimizer = torchft.Optimizer(manager, inner)
    params = [p for p in model.parameters()]
    net = torchft.DistributedDataParallel(manager, model) if args.ddp else model
    bucket_elems = 25 * 2**20 // 4
    events.emit("ready", params=job.parameter_count(model))

    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        handler.arm()
        optimizer.zero_grad()  # starts the quorum (async)
        x, y = job.replica_batch(data, step, args.replica)
        job.set_lr(inner, step)
        loss = job.loss_fn(net, x, y)
        loss.backward()
        if not args.ddp:
            grads = [p.grad for p in params]
            buckets, start = [], 0
            while start < len(grads):
                end, size = start, 0
                while end < len(grads) and (size == 0 or size + grads[end].numel() <= bucket_elems):
                    size += grads[end].numel()
                    end += 1
                buckets.append((start, end, torch.cat([g.reshape(-1) for g in grads[start:end]])))
                start = end
            works = [manager.allreduce(flat) for _, _, flat in buckets]
            for w in works:
                w.wait()
            if manager.errored() is None:
                events.emit("collective", step=step, world=manager.num_participants())
                for s, e, flat in buckets:
                    offset = 0
                    for g in grads[s:e]:
                        g.copy_(flat[offset:offset + g.numel()].view_as(g))
                        offset += g.numel()
        elif manager.errored() is None:
            events.emit("collective", step=step, world=manager.num_participants())
        optimizer.step()  # should_commit; steps the inner optimizer only on True
        world = manager.num_participants()
        if manager.current_step() == step:
            events.emit("step", step=step, loss=loss.item(), world=world, dp=world,
                        quorum_id=manager._quorum_id)
        else:
            err = manager.errored()
            events.emit("step_failed", step=step, world=world,
                        error=str(err).splitlines()[0][-300:] if err else None)
    events.emit("done", step=manager.current_step())
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
