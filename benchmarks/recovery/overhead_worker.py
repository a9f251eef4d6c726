"""The elastic loop's cost with no failure (run_recovery.py --sides overhead).

One job, launched like strata's side of the recovery benchmark (mpirun
--with-ft ulfm, N ranks, dpN: recovery/overhead.py), trains the model of examples/elastic/train.py
(imported from it: the same Stage, data and DataParallel with 25 MiB
buckets) in alternating blocks of steps (the third mode is below):

  off: a plain loop: the example's step body (forward, backward with
       DataParallel's bucketed gradient sums, the loss all-reduce,
       optimizer.step()), the sampler and scheduler advanced by hand;
  on:  strata.elastic.run on the same State with the same body: the monitor
       thread (heartbeats, probe, alarm), the per-step commit vote through
       the store in optimizer.step()'s pre-hook, the State's commit copy and
       the step line. A fresh Options(job=...) per block, so each run's
       store keys are its own.

A step's time is the interval between the starts of consecutive steps of a
block (so it holds everything the loop adds between two steps); the first
interval of a block is left out (the run's set-up lands before it). Since
the step itself varies by more than the loop's cost on a shared machine,
the parts the loop adds are timed too: optimizer.step() (with the loop on,
the commit vote runs in its pre-hook), the gap from its end to the start
of the next step, and the vote itself on every rank (its start and end, on
the host's monotonic clock, which all ranks of this one-host job share).
The vote's time on a rank is mostly the wait for the slowest rank to come
to it (skew, which without the vote the next collective absorbs); what the
vote itself costs is the time from the last rank's arrival to each rank's
answer ("after the last voter"). For scale, `sync` blocks run the plain
loop with one more all-reduce (two int64 on the dp group) before
optimizer.step(), timed the same way: what any synchronisation point
costs on this machine.

Rank 0 prints one JSON line per block: {"event": "block", "mode", "block",
"intervals", "opt_step", "gaps", and for on and sync blocks "after_last"
and "waits" (per step: the median over the ranks, seconds)}. Blocks
alternate off, on, (sync,) off, on, ... so that drift in the machine's load
hits every mode alike.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "elastic", "train.py")


def load_example():
    spec = importlib.util.spec_from_file_location("strata_elastic_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bucket-kib", type=int, default=25600)
    ap.add_argument("--blocks", type=int, default=4, help="blocks of each mode")
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--sync-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="also run sync blocks (the plain loop + one small all-reduce)")
    args = ap.parse_args()

    ex = load_example()
    import torch
    import strata
    import strata.elastic as elastic
    import strata.nn as snn

    torch.set_num_threads(1)
    launch = strata.launch_env()
    world = strata.init(strata.Mesh(launch.world_size, tp=1, dp=launch.world_size), timeout=120)
    model = snn.DataParallel(ex.Stage(args.hidden, args.layers, 0, 1, world), world,
                             reduce_op="sum", bucket_bytes=args.bucket_kib * 1024)
    x_all, y_all = ex.dataset(args.samples, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = elastic.ElasticSampler(args.samples, args.batch, seed=3)
    state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    dp = world.group("dp")
    starts, marks, syncs = [], [], []
    flag = torch.ones(2, dtype=torch.int64)

    # The vote's start and end on this rank (the Controller's vote, which
    # optimizer.step()'s pre-hook calls), kept apart from its callers.
    votes = []
    vote = elastic.Controller._vote

    def timed_vote(self, ctx, ok):
        t0 = time.perf_counter()
        try:
            return vote(self, ctx, ok)
        finally:
            votes.append((t0, time.perf_counter()))

    elastic.Controller._vote = timed_vote

    def body(samples, global_batch, sync=False):
        starts.append(time.perf_counter())
        opt.zero_grad(set_to_none=False)
        idx = torch.tensor(samples, dtype=torch.long)
        loss = torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx],
                                            reduction="sum") / global_batch
        loss.backward()
        global_loss = loss.detach().clone()
        dp.all_reduce(global_loss)
        if sync:
            t = time.perf_counter()
            dp.all_reduce(flag)
            syncs.append((t, time.perf_counter()))
        t1 = time.perf_counter()
        opt.step()  # on: the commit vote runs first, in the pre-step hook
        marks.append((t1, time.perf_counter()))
        return global_loss

    def plain_block(n, sync):
        for _ in range(n):
            body(sampler.batch(dp.rank, dp.size), sampler.global_batch, sync)
            sched.step()
            sampler.advance(sampler.global_batch)
            state.step = state.step + 1

    def on_block(n, i):
        options = elastic.Options(job=f"overhead-{i}", log=False)
        elastic.run(lambda ctx: body(ctx.samples, ctx.global_batch), state, world, options,
                    steps=state.step + n)

    def across_ranks(spans):
        """Per step (the first left out, like the first interval): the
        median over the ranks of (end - the last rank's start) and of
        (end - start), from every rank's (start, end) pairs."""
        mine = torch.tensor(spans[1:], dtype=torch.float64).reshape(-1, 2)
        every = [torch.zeros_like(mine) for _ in range(dp.size)]
        dp.all_gather(every, mine)
        every = torch.stack(every)  # ranks x steps x (start, end)
        last = every[:, :, 0].max(0).values
        return ((every[:, :, 1] - last).median(0).values.tolist(),
                (every[:, :, 1] - every[:, :, 0]).median(0).values.tolist())

    modes = ("off", "on", "sync") if args.sync_probe else ("off", "on")
    for i in range(args.blocks):
        for mode in modes:
            starts.clear()
            marks.clear()
            votes.clear()
            syncs.clear()
            if mode == "on":
                on_block(args.block_steps, i)
            else:
                plain_block(args.block_steps, mode == "sync")
            dp.barrier()
            intervals = [b - a for a, b in zip(starts[1:], starts[2:])]
            # What the loop adds, apart from the step's own noise:
            # optimizer.step() (the commit vote) and the gap from the end of
            # one optimizer.step() to the start of the next step (run's
            # finish_step / State commit / begin_step against the plain loop's
            # scheduler and sampler updates).
            opt_step = [b - a for a, b in marks[1:]]
            gaps = [nxt - b for (_, b), nxt in zip(marks[1:], starts[2:])]
            rec = {"event": "block", "mode": mode, "block": i, "intervals": intervals,
                   "opt_step": opt_step, "gaps": gaps}
            if mode != "off":
                rec["after_last"], rec["waits"] = across_ranks(votes if mode == "on" else syncs)
            if world.rank == 0:
                print(json.dumps(rec), flush=True)
    world.destroy()


if __name__ == "__main__":
    sys.exit(main())
