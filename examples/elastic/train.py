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

The mesh is dp x tp x pp (x ep) from the flags (default: tp 2, dp from the
world size: dp4 x tp2 on 8 ranks). The model is an MLP of residual blocks,
each a column- then a row-parallel linear layer over tp (strata.nn), wrapped
in strata.nn.DataParallel; with pp > 1 the blocks are split into pipeline
stages run by strata.pipeline's 1F1B schedule (made again after a recovery,
in on_world_changed). ``--experts N`` adds a mixture-of-experts layer after
the head: a top-1 router and N experts split over the ``--ep`` axis, tokens
sent to their expert's rank and back with all-to-alls; the experts'
gradients are summed over expert-data-parallel ("edp") by a DataParallel of
their own. The data is a synthetic regression set; each step takes a global
batch of ``--batch`` samples from strata.elastic.ElasticSampler, split over
the data-parallel replicas there are now (the global batch is kept when dp
shrinks), and DataParallel sums the gradients over dp, so the update is the
mean over the global batch whatever dp is. After a recovery
strata.elastic.run rebuilds the DataParallel layers on the new groups.

Rank 0 prints one JSON line per completed step ({"event": "step", "step",
"loss", "world", "dp", "time"}) and one per recovery ({"event": "recovery",
"failed", "detect_s", "agree_s", "rebuild_s", "restore_s", "world", "dp",
...}). Every rank writes its pid to ``--pid-dir``/<world rank>.pid, and
the process at mesh position p to ``--pid-dir``/pos-<p>.pid (taken over by
a spare or joiner placed there).
``--report DIR`` makes every rank that finishes write DIR/rank<r>.json
(its view of the run, for tests) and the survivors save the final model
as a strata checkpoint in DIR/final.

``--straggler-policy evict`` (or ``report``) turns on strata's straggler
policy (strata.elastic.StragglerPolicy; ``--straggler-factor``,
``--straggler-percentile``, ``--straggler-window``): a rank whose compute
time stays above 2x the P95 of the others' for 5 steps is evicted with its
replica, and rank 0 prints ``{"event": "eviction", "rank", "reason":
"straggler", "ratio", "steps", ...}``. Slow a rank down from outside with
``tools/slow_rank.py --pid-file PIDDIR/5.pid``, or from inside with ``--slow
RANK:FACTOR:FIRST[:LAST]`` (that rank sleeps FACTOR x ``--step-sleep``).

``--hold OP:RANK:STEP`` is for tests that kill a rank inside an operation:
rank RANK (a job rank) writes ``--pid-dir``/hold.json when it reaches OP
at step STEP and waits there (``--hold-seconds``) for the test to kill it.
OP is ``allreduce`` (the last gradient bucket of DataParallel's dp
all-reduce, the other ranks of the dp group waiting in it), ``send`` (a
pipeline stage's send: stage 0's forward output or a later stage's input
gradient, its peer waiting in the matching receive) or ``checkpoint`` (the
background writer of the asynchronous checkpoint saved after step STEP,
its first file partly written, the other ranks waiting to agree on the
write). A rank that was not killed writes hold.released and goes on.
"""

import sys

import strata.elastic as elastic


def _restarts(argv):
    """--restarts N, read before anything else (supervise forks first)."""
    for i, a in enumerate(argv):
        if a == "--restarts" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--restarts="):
            return int(a.split("=", 1)[1])
    return 0


# Before anything else: under torchrun, survive a killed rank, and start a
# new process for it (up to --restarts times) that joins the running job.
elastic.supervise(restarts=_restarts(sys.argv))

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
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
    p.add_argument("--restarts", type=int, default=0,
                   help="under torchrun: start a new process for a killed rank (or one whose "
                   "replica was dropped) up to N times; it joins the running job as a spare, "
                   "or completes a replica and dp grows back")
    p.add_argument("--joiner-dies", metavar="MARKER",
                   help="test: the first process that joins the running job (no file MARKER "
                   "yet: it makes it) is SIGKILLed while it would receive its state")
    p.add_argument("--spares", type=int, default=0,
                   help="hot spares: the last N ranks stand by and take a failed rank's place")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --experts)")
    p.add_argument("--experts", type=int, default=0,
                   help="experts of a top-1 mixture-of-experts layer after the head (0: none)")
    p.add_argument("--hidden", type=int, default=64, help="width of the residual stream")
    p.add_argument("--layers", type=int, default=4, help="residual blocks (split over pp)")
    p.add_argument("--batch", type=int, default=48, help="global batch (samples per step)")
    p.add_argument("--bucket-kib", type=int, default=64,
                   help="DataParallel's gradient bucket size in KiB")
    p.add_argument("--microbatch", type=int, default=8,
                   help="samples per pipeline microbatch (pp > 1)")
    p.add_argument("--samples", type=int, default=4096, help="samples in the data set")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--pid-dir", help="write this rank's pid to DIR/<world rank>.pid")
    p.add_argument("--report", help="write per-rank reports and the final model here")
    p.add_argument("--timeline", metavar="DIR",
                   help="record every step and recovery as a Chrome trace per rank in DIR "
                        "(strata.timeline; python -m strata.timeline DIR merges them)")
    p.add_argument("--drop", metavar="RANK@STEP",
                   help="a planned membership change without a failure: at step STEP, rank "
                        "RANK's replica leaves (the reference of the fault tests)")
    p.add_argument("--backend", default="auto", help="strata.init backend")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model and data live (cuda: one GPU per local rank, modulo "
                        "the GPUs visible; use with --backend nccl)")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds without a heartbeat before a rank counts as hung")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds an operation may take before it fails (strata.init timeout): "
                        "what finds a peer that is alive but unreachable")
    p.add_argument("--rebuild-timeout", type=float, default=None,
                   help="seconds a regroup (shrink, rebuild) may take (Options.rebuild_timeout, "
                        "60 by default)")
    p.add_argument("--no-fence", action="store_true",
                   help="do not kill a rank of this host taken as failed while its process "
                        "runs (Options.fence_unresponsive=False): as across hosts, it must stop "
                        "by itself")
    p.add_argument("--restore", default="auto", choices=["auto", "memory", "checkpoint"])
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a checkpoint every N steps into --report/ckpt (0: never)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step sleeps (to stretch a run for a demo or a test)")
    p.add_argument("--hold", metavar="OP:RANK:STEP",
                   help="for tests: rank RANK waits inside OP (allreduce, send, checkpoint) at "
                        "step STEP, announced in --pid-dir/hold.json, to be killed there")
    p.add_argument("--hold-seconds", type=float, default=5.0,
                   help="how long --hold waits for the kill before going on")
    p.add_argument("--straggler-policy", default="off", choices=["off", "report", "evict"],
                   help="strata.elastic.StragglerPolicy: a rank whose compute time stays above "
                        "--straggler-factor x the P95 of the others' for --straggler-window "
                        "steps is reported or evicted (off: no policy)")
    p.add_argument("--straggler-factor", type=float, default=2.0)
    p.add_argument("--straggler-percentile", type=float, default=95.0)
    p.add_argument("--straggler-window", type=int, default=5)
    p.add_argument("--straggler-exchange", default="auto", choices=["auto", "gather", "histogram"])
    p.add_argument("--slow", metavar="RANK:FACTOR:FIRST[:LAST]", action="append", default=[],
                   help="for tests: job rank RANK sleeps FACTOR x --step-sleep in steps FIRST to "
                        "LAST (a straggler made from inside; a rank can also be slowed from "
                        "outside: tools/slow_rank.py)")
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
        # Keyed by the block's place in the whole model, so that every
        # stage's parameters have the names the unsplit model gives them.
        self.blocks = torch.nn.ModuleDict(
            {str(i): blocks[i] for i in range(stage * per, (stage + 1) * per)})
        self.head = head if stage == stages - 1 else None

    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return self.head(x) if self.head is not None else x


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group`` (``send[r]`` rows to rank r;
    ``recv[r]`` rows come from it); backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        group.all_to_all_single(out, x.detach().contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        ctx.group.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None, None


class Experts(torch.nn.Module):
    """This ep rank's experts (``n`` in all, split over ep): expert e maps a
    token x to gelu(x W1[e]) W2[e]. Drawn from a fixed seed, whole, then
    sliced, so that every split of the experts starts from the same ones."""

    def __init__(self, hidden, n, ep_rank, ep_size):
        super().__init__()
        g = torch.Generator().manual_seed(99)
        w1 = torch.randn(n, hidden, 2 * hidden, generator=g) / hidden ** 0.5
        w2 = torch.randn(n, 2 * hidden, hidden, generator=g) / (2 * hidden) ** 0.5
        per = n // ep_size
        self.w1 = torch.nn.Parameter(w1[ep_rank * per:(ep_rank + 1) * per].clone())
        self.w2 = torch.nn.Parameter(w2[ep_rank * per:(ep_rank + 1) * per].clone())

    def forward(self, x, counts):
        """``x``: tokens grouped by local expert, ``counts[e]`` of expert e."""
        out, at = [], 0
        for e, n in enumerate(counts):
            xe = x[at:at + n]
            out.append(torch.nn.functional.gelu(xe @ self.w1[e]) @ self.w2[e])
            at += n
        return torch.cat(out)


class Dense(torch.nn.Module):
    """The stage and, with experts, the router: returns (h, router logits)."""

    def __init__(self, stage, hidden, experts):
        super().__init__()
        self.stage = stage
        torch.manual_seed(4321)
        self.router = torch.nn.Linear(hidden, experts, bias=False)

    def forward(self, x):
        h = self.stage(x)
        return h, self.router(h)


class MoEModel(torch.nn.Module):
    """h = the dense model; y = h + p(h) * expert(h), expert(h) the top-1
    expert the router picks, p its probability. Tokens travel to the ep
    rank holding their expert and back (all-to-all over "ep"). ``dense``
    and ``experts`` are DataParallel layers: the first reduces over "dp",
    the second over "edp" (the ranks holding the same experts)."""

    def __init__(self, dense, experts, n_experts, world):
        super().__init__()
        self.dense, self.experts = dense, experts
        self.n = n_experts
        self.world = world

    def forward(self, x):
        h, logits = self.dense(x)
        ep = self.world.group("ep")
        per = self.n // ep.size
        probs = torch.softmax(logits, dim=-1)
        top = probs.argmax(dim=-1)
        p = probs.gather(1, top[:, None])
        order = torch.argsort(top, stable=True)  # tokens by expert, so by ep rank
        counts = torch.bincount(top, minlength=self.n)  # tokens per expert
        if ep.size > 1:
            theirs = torch.empty_like(counts)  # [source rank, my expert]
            ep.all_to_all_single(theirs, counts)
            send = counts.view(ep.size, per).sum(1).tolist()
            recv = theirs.view(ep.size, per).sum(1).tolist()
            got = _AllToAll.apply(h[order], ep, send, recv)
            # Received rows are by source rank, then expert: regroup by expert.
            src_expert = torch.arange(per).repeat(ep.size).repeat_interleave(theirs)
            by_expert = torch.argsort(src_expert, stable=True)
            y = self.experts(got[by_expert], theirs.view(ep.size, per).sum(0).tolist())
            back = torch.empty_like(y).index_copy(0, by_expert, y)
            y = _AllToAll.apply(back, ep, recv, send)
        else:
            y = self.experts(h[order], counts.tolist())
        out = torch.empty_like(y).index_copy(0, order, y)
        return h + p * out


class Hold:
    """``--hold OP:RANK:STEP``: for tests that kill a rank inside an
    operation (see the module's docstring)."""

    OPS = ("allreduce", "send", "checkpoint")

    def __init__(self, spec, rank, directory, seconds):
        try:
            op, r, step = spec.split(":")
            self.rank, self.step = int(r), int(step)
        except ValueError:
            raise SystemExit(f"--hold {spec!r}: expected OP:RANK:STEP") from None
        if op not in self.OPS:
            raise SystemExit(f"--hold {spec!r}: OP must be one of {', '.join(self.OPS)}")
        if not directory:
            raise SystemExit("--hold needs --pid-dir (where it announces the hold)")
        self.op, self.seconds = op, seconds
        self.mine = rank == self.rank
        self.path = os.path.join(directory, "hold.json")
        self.step_now = None  # the step under way (set by train_step)
        self.done = False
        self.ready = 0  # gradients accumulated in this step's backward
        self.microbatches = 0  # this step's forwards through the stage

    def begin_step(self, step):
        self.step_now, self.ready, self.microbatches = step, 0, 0

    def checkpoint_hook(self, nth):
        """The checkpointer's test hook: waits in the ``nth`` save, once
        its first data file is partly written."""
        seen = [0]

        def hook(point):
            if point != "file_partial" or not self.mine:
                return
            seen[0] += 1
            if seen[0] == nth:
                self.wait("checkpoint", {"point": point, "save": nth})

        return hook

    def here(self, op, **where):
        """Called where OP happens: on the chosen rank and step, announces
        the hold and waits for the kill."""
        if self.done or not self.mine or op != self.op or self.step_now != self.step:
            return
        self.wait(op, where)

    def wait(self, op, where):
        self.done = True
        announce(self.path, {"op": op, "rank": self.rank, "step": self.step, "pid": os.getpid(),
                             "time": time.time(), **where})
        time.sleep(self.seconds)
        announce(self.path.replace(".json", ".released"), {"time": time.time()})


def announce(path, value):
    """Writes ``value`` as JSON to ``path`` at once (a rename: a reader sees
    all of it or nothing)."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def write_pid(directory, rank, name=None):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name or f"{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def write_position(directory, world):
    """DIR/pos-<world rank>.pid: the process that holds this mesh position
    now (a placed spare or joiner takes the file over), for tools that slow
    or kill "whoever trains at position p"."""
    if directory and not world.is_spare:
        write_pid(directory, None, f"pos-{world.rank}.pid")


def main(argv=None):
    args = parse(argv)
    launch = strata.launch_env()
    if args.pid_dir:
        write_pid(args.pid_dir, launch.rank)
    if args.layers % args.pp:
        raise SystemExit(f"--layers {args.layers} must be divisible by --pp {args.pp}")
    if args.experts and (args.experts % args.ep or args.pp > 1):
        raise SystemExit(f"--experts {args.experts} must be divisible by --ep {args.ep}, and "
                         f"the experts layer runs without pipeline stages (--pp {args.pp})")
    if args.ep > 1 and not args.experts:
        raise SystemExit(f"--ep {args.ep} needs --experts (how many, split over ep)")
    sizes = {"tp": args.tp, "pp": args.pp, "ep": args.ep}
    if args.dp:
        sizes["dp"] = args.dp
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    world = strata.init(strata.Mesh(launch.world_size - args.spares, **sizes),
                        backend=args.backend, timeout=args.timeout, spares=args.spares)
    joiner = world.joining  # a process joining the running job (a restarted rank)
    # This rank's strata.timeline.Timeline (--timeline), made in build(world):
    # a spare, or a process that joins, has no place before.
    timelines = []
    x_all, y_all = (t.to(device) for t in dataset(args.samples, args.hidden))
    pp = model = opt = params = state = hold = stage = None

    def build(world):
        """The model, optimizer and State of this rank's mesh position (on a
        spare: once a failure gave it one)."""
        nonlocal pp, model, opt, params, state, hold, stage
        if args.timeline and not timelines:
            timelines.append(strata.timeline.Timeline(args.timeline, world=world))
        if joiner and args.joiner_dies and not os.path.exists(args.joiner_dies):
            with open(args.joiner_dies, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)  # its dp group is about to send its state
        pp = world.group("pp")
        hold = Hold(args.hold, launch.rank, args.pid_dir, args.hold_seconds) if args.hold else None
        if hold is not None and hold.op != "checkpoint" and (hold.op == "send") != (args.pp > 1):
            raise SystemExit(f"--hold {args.hold}: 'send' holds in a pipeline send (--pp > 1), "
                             "'allreduce' in DataParallel's all-reduce without pipeline (--pp 1)")
        stage = Stage(args.hidden, args.layers, pp.rank, pp.size, world)
        if hold is not None:
            hold_points(hold, stage, pp)
        # Gradients are summed over the data-parallel replicas by DataParallel
        # (buckets reduced while backward runs); the loss below is divided by
        # the global batch, so the sum is the mean over the global batch
        # whatever dp is. Small buckets: several reductions overlap backward.
        dp_options = {"reduce_op": "sum", "bucket_bytes": args.bucket_kib * 1024}
        if args.experts:
            ep = world.group("ep")
            dense = snn.DataParallel(Dense(stage, args.hidden, args.experts).to(device), world,
                                     **dp_options)
            experts = snn.DataParallel(
                Experts(args.hidden, args.experts, ep.rank, ep.size).to(device), world, axes="edp",
                **dp_options)
            model = MoEModel(dense, experts, args.experts, world)
        else:
            model = snn.DataParallel(stage.to(device), world, **dp_options)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        sampler = elastic.ElasticSampler(args.samples, args.batch, seed=3)
        state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                              trained_samples=[])
        params = [p for p in model.parameters()]
        return state

    # A spare (or a process joining the running job) builds once it has a
    # place (elastic.run).
    deferred = world.joining or world.is_spare
    if not deferred:
        build(world)
        write_position(args.pid_dir, world)
    slow = [parse_slow(v, args.step_sleep) for v in args.slow]
    drop = None
    if args.drop:
        r, s = args.drop.split("@")
        drop = (int(r), int(s))
    pipe = {}

    def schedule(ctx):
        """The 1F1B schedule of this replica's microbatches, made again when
        their number changes (fewer replicas take more microbatches) and
        after a recovery (on_world_changed)."""
        from strata import pipeline
        n = max(1, -(-len(ctx.samples) // args.microbatch))
        if pipe.get("n") != n:
            stage = pipeline.PipelineStage(model, pp.rank, world, num_stages=pp.size)
            pipe["n"] = n
            pipe["schedule"] = pipeline.Schedule1F1B(
                stage, n, lambda out, y: torch.nn.functional.mse_loss(out, y, reduction="sum"),
                scale_grads=False)
        return pipe["schedule"]

    def on_world_changed(event, world):
        # The pipeline group was rebuilt: a schedule of the new world's.
        pipe.clear()
        write_position(args.pid_dir, world)

    def train_step(ctx):
        if drop is not None and ctx.step == drop[1] and ctx.epoch == 1 and world.rank == 0:
            ctx.request_change([drop[0]], f"--drop {args.drop}")
        if hold is not None:
            hold.begin_step(ctx.step)
        if args.step_sleep:
            factor = max([f for r, f, a, b in slow if r == launch.rank and a <= ctx.step <= b],
                         default=1.0)
            time.sleep(factor * args.step_sleep)
        opt.zero_grad(set_to_none=False)
        idx = torch.tensor(ctx.samples, dtype=torch.long, device=device)
        x, y = x_all[idx], y_all[idx]
        # The sum of squared errors over this replica's samples, divided by
        # the global batch: the dp sum below makes it the global mean.
        if pp.size == 1:
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / ctx.global_batch
            loss.backward()
        else:
            losses = schedule(ctx).step(x if pp.rank == 0 else None,
                                        y if pp.rank == pp.size - 1 else None)
            loss = (torch.stack(losses).sum() if losses else torch.zeros((), device=device)) \
                / ctx.global_batch
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

    # What a process joining this job must match: the model's configuration.
    config = json.dumps({k: getattr(args, k) for k in ("hidden", "layers", "tp", "pp", "ep",
                                                       "experts", "samples", "lr")})
    options = elastic.Options(restore=args.restore,
                              config=hashlib.sha256(config.encode()).hexdigest()[:16])
    if args.straggler_policy != "off":
        options.straggler = elastic.StragglerPolicy(
            factor=args.straggler_factor, percentile=args.straggler_percentile,
            window=args.straggler_window, action=args.straggler_policy,
            exchange=args.straggler_exchange)
    if args.heartbeat_timeout:
        options.heartbeat_timeout = args.heartbeat_timeout
    if args.rebuild_timeout:
        options.rebuild_timeout = args.rebuild_timeout
    if args.no_fence:
        options.fence_unresponsive = False
    if args.checkpoint_every or args.restore == "checkpoint":
        if not args.report:
            raise SystemExit("--checkpoint-every and --restore checkpoint need --report DIR")
        if args.experts:
            raise SystemExit("--checkpoint-every: checkpoints do not hold expert-parallel "
                             "shards yet (the experts are not tensor-parallel shards)")
        options.checkpoint_dir = os.path.join(args.report, "ckpt")
        options.checkpoint_every = args.checkpoint_every
        if hold is not None and hold.op == "checkpoint":
            if args.hold and hold.step % args.checkpoint_every:
                raise SystemExit(f"--hold checkpoint at step {hold.step}: no checkpoint is saved "
                                 f"then (--checkpoint-every {args.checkpoint_every})")
            options.checkpoint_options = {
                "_test_hook": hold.checkpoint_hook(hold.step // args.checkpoint_every)}
    if not deferred and world.rank == 0:
        n = sum(p.numel() for p in params)
        print(f"strata elastic example: {world.mesh!r}, {n:,} parameters on rank 0, "
              f"{args.steps} steps of {args.batch} samples", file=sys.stderr, flush=True)
    result = elastic.run(train_step, build if deferred or args.spares else state, world, options,
                         steps=args.steps, on_world_changed=on_world_changed)
    for timeline in timelines:
        timeline.close()
    if args.report:
        write_report(args.report, launch.rank, world, state, result, params, model)
    elastic.shutdown(world, result)


def parse_slow(value, step_sleep):
    """``--slow RANK:FACTOR:FIRST[:LAST]`` as (rank, factor, first, last)."""
    parts = value.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        last = int(parts[3]) if len(parts) == 4 else 1 << 62
        slow = (int(parts[0]), float(parts[1]), int(parts[2]), last)
    except ValueError:
        raise SystemExit(f"--slow {value!r}: expected RANK:FACTOR:FIRST[:LAST], e.g. 3:3:10")
    if not step_sleep:
        raise SystemExit(f"--slow {value}: multiplies --step-sleep, which is 0")
    return slow


def hold_points(hold, stage, pp):
    """Where ``--hold`` waits, on the module before DataParallel wraps it
    (so that its hooks run before DataParallel's)."""
    if hold.op == "allreduce":
        # After DataParallel's hooks of the other parameters started their
        # buckets' all-reduces, before its hook of the last parameter
        # starts the last bucket's: the other ranks of the dp group are
        # then waiting in that all-reduce.
        params = [p for p in stage.parameters() if p.requires_grad]

        def ready(p):
            hold.ready += 1
            if hold.ready == len(params):
                hold.here("allreduce", bucket="last", pp_stage=pp.rank)

        for p in params:
            p.register_post_accumulate_grad_hook(ready)
    elif hold.op == "send" and pp.rank == 0:
        # Stage 0's forward of the second microbatch returned: the runner
        # sends its output next, the next stage waits in its receive.
        def forwarded(module, args, out):
            hold.microbatches += 1
            if hold.microbatches == 2 and torch.is_grad_enabled():
                hold.here("send", action="SEND_F", microbatch=1, pp_stage=0)

        stage.register_forward_hook(forwarded)
    elif hold.op == "send":
        # The input gradient of the second microbatch is computed: the
        # runner sends it to the previous stage next, which waits for it.
        def forward(module, args):
            x = args[0]
            if x.requires_grad:
                hold.microbatches += 1
                if hold.microbatches == 2:
                    x.register_hook(lambda g: hold.here("send", action="SEND_B", microbatch=1,
                                                        pp_stage=pp.rank))

        stage.register_forward_pre_hook(forward)


def write_report(directory, rank, world, state, result, params, model):
    os.makedirs(directory, exist_ok=True)
    if result.stood_by:  # a spare the job never needed: nothing trained
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "stood_by": True, "events": result.events}, f)
        return
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    coords = world.mesh.coords(world.rank)
    report = {
        "rank": rank,
        "world_rank": world.rank,
        "world": world.size,
        "coords": {k: coords.get(k, 0) for k in ("tp", "pp", "dp", "ep")},
        "mesh": repr(world.mesh),
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
    if isinstance(model, MoEModel):
        # The experts whole (gathered over ep, in expert order) beside the
        # dense model's state, so that any split of the experts compares.
        final = dict(model.dense.module.state_dict())
        ep = world.group("ep")
        for name, p in model.experts.module.named_parameters():
            whole = torch.empty((ep.size,) + tuple(p.shape), dtype=p.dtype)
            ep.all_gather(whole, p.detach().contiguous())
            final["experts." + name] = whole.flatten(0, 1)
    else:
        final = model.module
    checkpoint.save({"model": final}, os.path.join(directory, "final"), step=result.steps,
                    world=world)


if __name__ == "__main__":
    main()
