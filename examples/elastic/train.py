"""Elastic training with strata: a small tensor-parallel model trained with
strata.elastic.run, which survives a rank killed from outside at any moment
(SIGKILL, or SIGSTOP: a hung rank) and goes on, in the same processes, on a
smaller mesh.

    mpirun --with-ft ulfm -np 8 python examples/elastic/train.py --steps 200
    torchrun --standalone --nproc-per-node 8 examples/elastic/train.py --steps 200

(as root, mpirun also needs --allow-run-as-root; with more ranks than
cores, --oversubscribe). Kill one rank while it trains, e.g. with
``--pid-dir /tmp/pids`` and ``kill -9 $(cat /tmp/pids/5.pid)``: the
survivors print a recovery line and train on; the ranks of the replica that
lost the rank leave with status 0; the job exits 0.

The mesh is dp x tp x pp from the flags (default: tp 2, dp from the world
size: dp4 x tp2 on 8 ranks). The model is an MLP of residual blocks, each a
column- then a row-parallel linear layer over tp (strata.nn), wrapped in
strata.nn.DataParallel; with pp > 1 the blocks are split into pipeline
stages run by strata.pipeline's 1F1B schedule. The data is a synthetic regression set; each step takes a global
batch of ``--batch`` samples from strata.elastic.ElasticSampler, split over
the data-parallel replicas there are now (the global batch is kept when dp
shrinks), and DataParallel sums the gradients over dp, so the update is the
mean over the global batch whatever dp is. After a recovery
strata.elastic.run rebuilds the DataParallel on the new dp group.

Rank 0 prints one JSON line per completed step ({"event": "step", "step",
"loss", "world", "dp", "time"}) and one per recovery ({"event": "recovery",
"failed", "detect_s", "agree_s", "rebuild_s", "restore_s", "world", "dp",
...}). Every rank writes its pid to ``--pid-dir``/<world rank>.pid.
``--report DIR`` makes every rank that finishes write DIR/rank<r>.json
(its view of the run, for tests) and the survivors save the final model
as a strata checkpoint in DIR/final.
"""

import strata.elastic as elastic

elastic.supervise()  # before anything else: under torchrun, survive a killed rank

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import strata  # noqa: E402
import strata.nn as snn  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps (global batches)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (1F1B)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (0: the rest)")
    p.add_argument("--hidden", type=int, default=64, help="width of the residual stream")
    p.add_argument("--layers", type=int, default=4, help="residual blocks (split over pp)")
    p.add_argument("--batch", type=int, default=48, help="global batch (samples per step)")
    p.add_argument("--bucket-kib", type=int, default=64,
                   help="DataParallel's gradient bucket size in KiB")
    p.add_argument("--microbatch", type=int, default=8,
                   help="samples per pipeline microbatch (pp > 1)")
    p.add_argument("--samples", type=int, default=4096, help="samples in the data set")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--pid-dir", help="write this rank's pid to DIR/<world rank>.pid")
    p.add_argument("--report", help="write per-rank reports and the final model here")
    p.add_argument("--drop", metavar="RANK@STEP",
                   help="a planned membership change without a failure: at step STEP, rank "
                        "RANK's replica leaves (the reference of the fault tests)")
    p.add_argument("--backend", default="auto", help="strata.init backend")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds without a heartbeat before a rank counts as hung")
    p.add_argument("--restore", default="auto", choices=["auto", "memory", "checkpoint"])
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a checkpoint every N steps into --report/ckpt (0: never)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step sleeps (to stretch a run for a demo or a test)")
    return p.parse_args(argv)


def dataset(n, hidden):
    """Inputs and targets of a synthetic regression task (the same on every
    rank: a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, hidden, generator=g)
    w = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    return x, torch.tanh(x @ w)


class Block(torch.nn.Module):
    """x + W2 gelu(W1 x): W1 column-parallel, W2 row-parallel over tp."""

    def __init__(self, hidden, world):
        super().__init__()
        self.fc1 = snn.ColumnParallelLinear(hidden, 4 * hidden, group=world)
        self.fc2 = snn.RowParallelLinear(4 * hidden, hidden, group=world, input_is_parallel=True)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stage(torch.nn.Module):
    """Blocks [first, last) of the model; the last stage adds the head."""

    def __init__(self, hidden, layers, stage, stages, world):
        super().__init__()
        torch.manual_seed(1234)  # the same model on every rank, whatever the split
        blocks = [Block(hidden, world) for _ in range(layers)]
        head = torch.nn.Linear(hidden, hidden)
        per = layers // stages
        self.blocks = torch.nn.ModuleList(blocks[stage * per:(stage + 1) * per])
        self.head = head if stage == stages - 1 else None

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x


def write_pid(directory, rank):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def main(argv=None):
    args = parse(argv)
    launch = strata.launch_env()
    if args.pid_dir:
        write_pid(args.pid_dir, launch.rank)
    if args.layers % args.pp:
        raise SystemExit(f"--layers {args.layers} must be divisible by --pp {args.pp}")
    mesh = strata.Mesh(launch.world_size, tp=args.tp, pp=args.pp, dp=args.dp) if args.dp \
        else strata.Mesh(launch.world_size, tp=args.tp, pp=args.pp)
    world = strata.init(mesh, backend=args.backend, timeout=120)
    pp = world.group("pp")
    # Gradients are summed over the data-parallel replicas by DataParallel
    # (buckets reduced while backward runs); the loss below is divided by
    # the global batch, so the sum is the mean over the global batch
    # whatever dp is. Small buckets: several reductions overlap backward.
    model = snn.DataParallel(Stage(args.hidden, args.layers, pp.rank, pp.size, world), world,
                             reduce_op="sum", bucket_bytes=args.bucket_kib * 1024)
    x_all, y_all = dataset(args.samples, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = elastic.ElasticSampler(args.samples, args.batch, seed=3)
    state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                          trained_samples=[])
    params = [p for p in model.parameters()]
    drop = None
    if args.drop:
        r, s = args.drop.split("@")
        drop = (int(r), int(s))
    pipe = {}

    def schedule(ctx):
        """The 1F1B schedule of this replica's microbatches, made again when
        their number changes (fewer replicas take more microbatches)."""
        from strata import pipeline
        n = max(1, -(-len(ctx.samples) // args.microbatch))
        if pipe.get("n") != n:
            stage = pipeline.PipelineStage(model, pp.rank, world, num_stages=pp.size)
            pipe["n"] = n
            pipe["schedule"] = pipeline.Schedule1F1B(
                stage, n, lambda out, y: torch.nn.functional.mse_loss(out, y, reduction="sum"),
                scale_grads=False)
        return pipe["schedule"]

    def train_step(ctx):
        if drop is not None and ctx.step == drop[1] and ctx.epoch == 1 and world.rank == 0:
            ctx.request_change([drop[0]], f"--drop {args.drop}")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        opt.zero_grad(set_to_none=False)
        idx = torch.tensor(ctx.samples, dtype=torch.long)
        x, y = x_all[idx], y_all[idx]
        # The sum of squared errors over this replica's samples, divided by
        # the global batch: the dp sum below makes it the global mean.
        if pp.size == 1:
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / ctx.global_batch
            loss.backward()
        else:
            losses = schedule(ctx).step(x if pp.rank == 0 else None,
                                        y if pp.rank == pp.size - 1 else None)
            loss = (torch.stack(losses).sum() if losses else torch.zeros(())) / ctx.global_batch
            with torch.no_grad():
                for p in params:
                    p.grad /= ctx.global_batch
        # backward() returned with every gradient bucket reduced over dp.
        global_loss = loss.detach().clone()
        ctx.group("dp").all_reduce(global_loss)  # for the log line
        if pp.size > 1:
            ctx.group("pp").all_reduce(global_loss)  # only the last stage has it
        opt.step()  # every rank agrees the step completed, or nothing is applied
        state.trained_samples.append([ctx.step, ctx.replica, ctx.replicas, ctx.samples[:4]])
        return global_loss

    options = elastic.Options(restore=args.restore)
    if args.heartbeat_timeout:
        options.heartbeat_timeout = args.heartbeat_timeout
    if args.checkpoint_every or args.restore == "checkpoint":
        if not args.report:
            raise SystemExit("--checkpoint-every and --restore checkpoint need --report DIR")
        options.checkpoint_dir = os.path.join(args.report, "ckpt")
        options.checkpoint_every = args.checkpoint_every
    if world.rank == 0:
        n = sum(p.numel() for p in params)
        print(f"strata elastic example: {world.mesh!r}, {n:,} parameters on rank 0, "
              f"{args.steps} steps of {args.batch} samples", file=sys.stderr, flush=True)
    result = elastic.run(train_step, state, world, options, steps=args.steps)
    if args.report:
        write_report(args.report, launch.rank, world, state, result, params)
    elastic.shutdown(world, result)


def write_report(directory, rank, world, state, result, params):
    os.makedirs(directory, exist_ok=True)
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    coords = world.mesh.coords(world.rank)
    report = {
        "rank": rank,
        "world_rank": world.rank,
        "world": world.size,
        "coords": {k: coords[k] for k in ("tp", "pp", "dp")},
        "epoch": result.epoch,
        "steps": result.steps,
        "events": result.events,
        "lr": state.schedulers[0].get_last_lr()[0],
        "scheduler_epoch": state.schedulers[0].last_epoch,
        "sampler_position": state.sampler.position,
        "param_hash": h.hexdigest(),
        "trained_samples": state.trained_samples,
    }
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    from strata import checkpoint
    checkpoint.save({"model": state.models[0].module}, os.path.join(directory, "final"),
                    step=result.steps, world=world)


if __name__ == "__main__":
    main()
