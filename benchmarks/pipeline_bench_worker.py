"""One rank of the pipeline benchmark (run by run_pipeline.py under mpirun).

The same model (p stages of `layers` x Linear(hidden, hidden) + tanh, fp32,
the same initial weights on every rank) is trained one step at a time by
strata.pipeline.Schedule1F1B over strata's Gloo (--backend gloo) or MPI
communicator and by torch.distributed.pipelining.Schedule1F1B over gloo,
on the same ranks,
alternating round by round so that load on the machine hits both alike.
A step's time is that of the slowest rank (barrier, step, max over ranks);
each case reports the median over rounds. strata's runner also reports,
per rank, the time spent in the stage's forward and backward (busy time):
the measured bubble is 1 - busy / makespan (the slowest rank's step, as
in the simulator), averaged over the ranks.
"""

import argparse
import json
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed import pipelining as tpp

import strata
from strata import pipeline


class _Timed(torch.autograd.Function):
    """x * w that takes `seconds` in forward and twice that in backward
    without using a core (it sleeps)."""

    @staticmethod
    def forward(ctx, x, w, seconds):
        ctx.save_for_backward(x, w)
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        time.sleep(2 * ctx.seconds)
        return g * w, (g * x).sum(0), None


class FixedCostStage(torch.nn.Module):
    """A stage of fixed costs (F = `seconds`, B = 2F): the pipeline's own
    behaviour (schedule, transfers, overhead) without CPU contention, which
    on a machine with fewer cores than ranks would dominate the bubble."""

    def __init__(self, hidden, seconds):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(hidden))
        self.seconds = seconds

    def forward(self, x):
        return _Timed.apply(x, self.w, self.seconds)


class InputGrad(torch.nn.Module):
    """Makes the stage's input a leaf that needs its gradient, so that the
    first stage computes its first layer's input gradient as every other
    stage does (a gradient of the whole batch's input instead would add a
    full-size copy per microbatch)."""

    def forward(self, x):
        return x.detach().requires_grad_()


def make_stage(index, hidden, layers, fixed_ms=None, input_grad=False):
    if fixed_ms is not None:
        return FixedCostStage(hidden, fixed_ms / 1e3)
    torch.manual_seed(1000 + index)
    mods = [InputGrad()] if input_grad and index == 0 else []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


_COMPUTE = re.compile(r"(\d+)([FBIW])(\d+)")


def kind_of(token):
    """"F", "B", "I" or "W" of a compute action's token."""
    return _COMPUTE.fullmatch(token).group(2)


def compute_spread(timings, kinds):
    """How much this rank's forwards (and backwards) vary within a step:
    their coefficient of variation, mean over `kinds` (0 with fewer than
    two of each)."""
    cvs = []
    for kind in kinds:
        d = [e - b for label, b, e in timings if kind_of(label) == kind]
        if len(d) > 1:
            cvs.append(statistics.pstdev(d) / statistics.mean(d))
    return statistics.mean(cvs) if cvs else 0.0


def compute_lists(schedule):
    """Each rank's compute actions in its list's order, as (kind, stage,
    microbatch), with what each waits for: [(action, dependency)] per rank,
    the dependency being the action whose output it reads (F(s, i) reads
    F(s-1, i)'s, B(s, i) reads B(s+1, i)'s, I(s, i) I(s+1, i)'s) or None
    (W reads only its own rank's I, which comes before it)."""
    last_stage = schedule.num_stages - 1
    lists = []
    for r in range(schedule.num_ranks):
        acts = []
        for token in schedule.actions(r):
            match = _COMPUTE.fullmatch(token)
            if not match:
                continue
            stage, kind, mb = int(match.group(1)), match.group(2), int(match.group(3))
            dep = (("F", stage - 1, mb) if kind == "F" and stage > 0 else
                   (kind, stage + 1, mb) if kind in "BI" and stage < last_stage else None)
            acts.append(((kind, stage, mb), dep))
        lists.append(acts)
    return lists


def stage_noise(module, rows, hidden, iters, group):
    """The spread of this stage's compute outside the pipeline: the
    coefficient of variation of `iters` forwards (and backwards, mean of
    the two) of one microbatch, first with each rank computing alone in
    turn (the others wait at a barrier), then with all ranks computing at
    once, as in 1F1B's steady state. Returns (alone, at_once), each the
    mean over the ranks."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, hidden, generator=g)
    dy = torch.randn(rows, hidden, generator=g)
    flag = torch.zeros(1)

    def measure():
        f, b = [], []
        for k in range(iters + 5):  # five to warm up
            t0 = time.perf_counter()
            out = module(x)
            t1 = time.perf_counter()
            out.backward(dy)
            t2 = time.perf_counter()
            if k >= 5:
                f.append(t1 - t0)
                b.append(t2 - t1)
        module.zero_grad()
        return statistics.mean(statistics.pstdev(d) / statistics.mean(d) for d in (f, b))

    alone = 0.0
    for turn in range(group.size):
        group.all_reduce(flag)
        if group.rank == turn:
            alone = measure()
    group.all_reduce(flag)
    at_once = measure()
    out = torch.tensor([alone, at_once], dtype=torch.float64)
    group.all_reduce(out, op="avg")
    return out.tolist()


def transfer_latency(schedule, spans):
    """The median time from the end of a compute action to the start of the
    one on another rank that was waiting for its output (its activation or
    gradient): what a transfer on the critical path costs, runner and
    transport together. spans[r]: rank r's compute actions in order, as
    (start, end) on the shared wall clock. None when no rank waited."""
    lists = compute_lists(schedule)
    where = {action: (r, j) for r, acts in enumerate(lists)
             for j, (action, _) in enumerate(acts)}
    waits = []
    for r, acts in enumerate(lists):
        for j, (_, dep) in enumerate(acts):
            if dep is None or where[dep][0] == r:
                continue
            pr, pj = where[dep]
            produced = spans[pr][pj][1]
            free = spans[r][j - 1][1] if j > 0 else float("-inf")
            if produced > free:  # this rank was waiting for the data
                waits.append(spans[r][j][0] - produced)
    return statistics.median(waits) if waits else None


def replayed_bubble(schedule, durations):
    """The bubble this step would have had with free transfers and no
    runner overhead: every rank's F and B actions replayed in its list's
    order with the durations measured in the step (durations[r]: rank r's
    compute actions in order), each starting once its rank is free and its
    input is there (F(s, i) after F(s-1, i); B(s, i) after B(s+1, i)).
    Returns the mean over ranks of 1 - busy / makespan, as measured."""
    p = schedule.num_ranks
    lists = compute_lists(schedule)
    end, free, pos = {}, [0.0] * p, [0] * p
    while any(pos[r] < len(lists[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                action, dep = lists[r][pos[r]]
                if dep is not None and dep not in end:
                    break
                start = max(free[r], end[dep] if dep else 0.0)
                free[r] = end[action] = start + durations[r][pos[r]]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("replay: the schedule does not progress")
    makespan = max(free)
    return statistics.mean(1.0 - sum(d) / makespan for d in durations)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--microbatch", type=int, default=32, help="rows per microbatch")
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="mpi", choices=["mpi", "gloo"],
                    help="strata's communicator: MPI, or Gloo through torch's TCPStore")
    ap.add_argument("--input-grad", action="store_true",
                    help="the first stage computes its input's gradient, so that every "
                         "stage runs the same backward")
    ap.add_argument("--noise-iters", type=int, default=0,
                    help="first measure the stage's compute spread alone and with all ranks "
                         "at once over this many microbatches (0: not measured)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "zb"],
                    help="1F1B against torch's Schedule1F1B, or ZB-H1 against torch's "
                         "ScheduleInterleavedZeroBubble with one stage per rank")
    ap.add_argument("--fixed-ms", type=float, default=None,
                    help="stages of fixed costs (F ms forward, 2F backward) instead of the MLP")
    args = ap.parse_args()
    torch.set_num_threads(1)

    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ["STRATA_BENCH_PORT"]
    # torch first: rank 0 serves the TCPStore at MASTER_ADDR:MASTER_PORT,
    # through which strata's Gloo backend bootstraps too.
    dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]), world_size=n)
    store = (dist.PrefixStore("strata/", dist.distributed_c10d._get_default_store())
             if args.backend == "gloo" else None)
    world = strata.init(strata.Mesh(n, pp=n), backend=args.backend, timeout=300, store=store)
    assert world.rank == dist.get_rank()
    pp = world.group("pp")
    rank, p = pp.rank, pp.size

    # Two copies of this rank's stage with the same weights.
    ours = make_stage(rank, args.hidden, args.layers, args.fixed_ms, args.input_grad)
    theirs = make_stage(rank, args.hidden, args.layers, args.fixed_ms, args.input_grad)
    theirs.load_state_dict(ours.state_dict())
    strata_stage = pipeline.PipelineStage(ours, rank, world)
    torch_stage = tpp.PipelineStage(theirs, rank, p, torch.device("cpu"))

    barrier_flag = torch.zeros(1)
    noise = (stage_noise(ours, args.microbatch, args.hidden, args.noise_iters, world.group())
             if args.noise_iters > 0 and args.fixed_ms is None else None)

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        world.group().all_reduce(t, op="max")
        return t.item()

    results = []
    for m in [int(x) for x in args.ms.split(",")]:
        rows = m * args.microbatch
        g = torch.Generator().manual_seed(m)
        x = torch.randn(rows, args.hidden, generator=g)
        y = torch.randn(rows, args.hidden, generator=g)
        if args.schedule == "zb":
            ours_sched = pipeline.ScheduleZeroBubble(strata_stage, m, loss_fn, timeout=120)
            torch_sched = tpp.ScheduleInterleavedZeroBubble([torch_stage], m, loss_fn=loss_fn)
        else:
            ours_sched = pipeline.Schedule1F1B(strata_stage, m, loss_fn, timeout=120)
            torch_sched = tpp.Schedule1F1B(torch_stage, m, loss_fn=loss_fn)
        kinds = "FIW" if args.schedule == "zb" else "FB"

        def run_strata():
            ours.zero_grad()
            world.group().all_reduce(barrier_flag)
            t0 = time.perf_counter()
            ours_sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
            return time.perf_counter() - t0, ours_sched.stats

        def run_torch():
            theirs.zero_grad()
            world.group().all_reduce(barrier_flag)
            t0 = time.perf_counter()
            if rank == 0:
                torch_sched.step(x)
            elif rank == p - 1:
                torch_sched.step(target=y, losses=[])
            else:
                torch_sched.step()
            return time.perf_counter() - t0

        ours_t, torch_t, bubbles, sim_bubbles, spreads, means = [], [], [], [], [], []
        latencies = []
        for k in range(args.warmup + args.rounds):
            # Alternate which goes first, so neither always follows the other.
            order = (0, 1) if k % 2 == 0 else (1, 0)
            for which in order:
                if which == 0:
                    seconds, stats = run_strata()
                    s = slowest(seconds)
                    # As the simulator: 1 - busy / makespan, the makespan
                    # being the slowest rank's step (the barrier aligned
                    # the starts), averaged over the ranks.
                    busy = torch.tensor([stats.busy_seconds], dtype=torch.float64)
                    world.group().all_reduce(busy, op="avg")
                    makespan = slowest(stats.step_seconds)
                    # Every rank's compute durations, for the replay.
                    mine = torch.tensor([e - b for _, b, e in stats.timings],
                                        dtype=torch.float64)
                    spread = torch.tensor([compute_spread(stats.timings, kinds)],
                                          dtype=torch.float64)
                    world.group().all_reduce(spread, op="avg")
                    every = torch.zeros(p * mine.numel(), dtype=torch.float64)
                    world.group().all_gather(every, mine)
                    # ... and when they ran, on the host's wall clock.
                    spans = torch.tensor([[stats.start_time + b, stats.start_time + e]
                                          for _, b, e in stats.timings], dtype=torch.float64)
                    every_span = torch.zeros(p * spans.numel(), dtype=torch.float64)
                    world.group().all_gather(every_span, spans.flatten())
                    if k >= args.warmup:
                        ours_t.append(s)
                        bubbles.append(1.0 - busy.item() / makespan)
                        sim_bubbles.append(replayed_bubble(ours_sched.schedule,
                                                           every.view(p, -1).tolist()))
                        spreads.append(spread.item())
                        latency = transfer_latency(ours_sched.schedule,
                                                   every_span.view(p, -1, 2).tolist())
                        if latency is not None:
                            latencies.append(latency)
                        # Each rank's mean forward and backward (ms; I
                        # and W for a split backward).
                        fb = torch.tensor([1e3 * statistics.mean(
                            e - b for label, b, e in stats.timings if kind_of(label) == kind)
                            for kind in kinds], dtype=torch.float64)
                        every_fb = torch.zeros(len(kinds) * p, dtype=torch.float64)
                        world.group().all_gather(every_fb, fb)
                        means.append(every_fb.view(p, len(kinds)).tolist())
                else:
                    s = slowest(run_torch())
                    if k >= args.warmup:
                        torch_t.append(s)
        stage_ms = [[statistics.median(r[s][k] for r in means) for k in range(len(kinds))]
                    for s in range(p)]
        if args.schedule == "zb":
            # ZB-H1's own bubble for these costs: its schedule simulated
            # with the measured mean F, I and W (free transfers).
            mean = [statistics.mean(st[k] for st in stage_ms) for k in range(3)]
            costs = dict(forward=mean[0], backward_input=mean[1], backward_weight=mean[2])
            theory = pipeline.generate("zb-h1", num_ranks=p, num_microbatches=m, **costs) \
                .simulate(**costs).mean_bubble_fraction
        else:
            theory = (p - 1) / (m + p - 1)
        results.append({
            "m": m,
            "strata_ms": 1e3 * statistics.median(ours_t),
            "torch_ms": 1e3 * statistics.median(torch_t),
            "bubble": statistics.median(bubbles),
            "replayed_bubble": statistics.median(sim_bubbles),
            "compute_cv": statistics.median(spreads),
            "transfer_us": 1e6 * statistics.median(latencies) if latencies else None,
            "stage_ms": stage_ms,
            "theory": theory,
            "peak_in_flight": ours_sched.stats.peak_in_flight,
        })
        if rank == 0:
            print(results[-1], flush=True)

    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": p, "hidden": args.hidden, "layers": args.layers,
                       "schedule": args.schedule,
                       "fixed_ms": args.fixed_ms,
                       "microbatch": args.microbatch, "rounds": args.rounds,
                       "noise": noise,
                       "results": results}, f)
    dist.destroy_process_group()
    world.destroy()


if __name__ == "__main__":
    main()
