#!/usr/bin/env python3
"""One rank of run_metrics_overhead.py: step time with metrics on against
off, in the same run. Two worlds live side by side, one whose communicators
record into a strata.metrics.Metrics (its steps marked with Metrics.step)
and one with metrics=False (--baseline nothing: the flight recorder off too,
trace=False), each with its own copy of the case; steps
alternate between them one by one (the order of each pair flips), so that
the pairs see the same machine and the ratio of a pair cancels a slow
spell of a shared machine. Rank 0 prints one JSON line per case:
{"case", "on": [step seconds], "off": [...], "ops_per_step"} (on[i],
off[i] a pair; ops_per_step: the operations the "on" world recorded per
step, read from its registry), and one line {"check": "marker",
"ns_per_step"}: what a Metrics.step() marker costs around an empty step
(the per-step part of the cost; the per-operation part is
metrics_sink_bench's BM_OperationLife).

Cases: the demo's model (strata.nn.ParallelGPT, 2 layers x 128 hidden, 4
heads, seq 64, batch 8; tp2 x dp2 on 4 ranks, gradients averaged by
strata.nn.DataParallel) and a collective-heavy loop (64 all-reduces of
4 KiB per step on the world group).
"""

import argparse
import json
import time

import torch

import strata
import strata.metrics as sm
import strata.nn as snn


def demo_case(world):
    tp = world.group("tp")
    torch.manual_seed(0)
    full = snn.ParallelGPT(256, 128, 4, 2, 64, group=tp)
    model = snn.DataParallel(full, world)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
    dp = world.group("dp")
    gen = torch.Generator().manual_seed(dp.rank)

    def step():
        ids = torch.randint(0, 256, (64, 8), generator=gen)
        opt.zero_grad(set_to_none=False)
        logits = model(ids)  # through DataParallel, so its hooks reduce the gradients
        loss = snn.vocab_parallel_cross_entropy(logits, ids, group=tp).mean()
        loss.backward()
        opt.step()
        return 64 * 8

    return step


def collective_case(world):
    g = world.group("world")
    x = torch.ones(1024, dtype=torch.float32)  # 4 KiB

    def step():
        for _ in range(64):
            g.all_reduce(x)
        return 0

    return step


def recorded_ops(metrics):
    """Operations the registry has recorded so far (every duration
    histogram's count)."""
    total = 0.0
    for line in metrics.text().splitlines():
        if line.startswith("strata_collective_duration_seconds_count{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def perf_control(fifo, command):
    """Tells perf record (--control fifo:...) to enable or disable."""
    with open(fifo, "w") as f:
        f.write(command + "\n")


def marker_ns(reps=5, n=20000):
    """Nanoseconds one ``with Metrics.step() as s: s.tokens = ...`` adds to
    a step (median of reps, each over n empty steps less an empty loop), in
    this thread's CPU time: the other ranks share the cores, and wall time
    would count their turns too."""
    m = sm.Metrics(job="marker")
    out = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        for _ in range(n):
            with m.step() as s:
                s.tokens = 512
        t1 = time.thread_time_ns()
        for _ in range(n):
            pass
        t2 = time.thread_time_ns()
        out.append(((t1 - t0) - (t2 - t1)) / n)
    m.close()
    return sorted(out)[len(out) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=150, help="steps per side, in pairs")
    p.add_argument("--baseline", choices=["no-metrics", "nothing", "same"], default="no-metrics",
                   help="the 'off' side: metrics off (the flight recorder on, as by default), "
                        "metrics and the flight recorder both off, or the same as the 'on' "
                        "side (an A/A control: metrics of its own, the recorder on, steps "
                        "marked): what the comparison shows when nothing differs")
    p.add_argument("--on-only", action="store_true",
                   help="step the 'on' world only (under a profiler: every sample is of it)")
    p.add_argument("--case", choices=["demo model", "collective-heavy"],
                   help="run this case only (default: both)")
    p.add_argument("--perf-ctl", help="a perf record --control fifo (perf started with "
                                      "-D -1): enabled around the timed steps only")
    p.add_argument("--off-first", action="store_true",
                   help="make the 'off' world before the 'on' one (a control for the order)")
    args = p.parse_args()
    torch.set_num_threads(1)
    env = strata.launch_env()
    marker = marker_ns()
    if env.rank == 0:
        print(json.dumps({"check": "marker", "ns_per_step": marker}), flush=True)
    mesh = strata.Mesh(env.world_size, tp=2 if env.world_size % 2 == 0 else 1)
    metrics = sm.Metrics(job="bench")
    other = sm.Metrics(job="bench-aa") if args.baseline == "same" else None
    make_world = {
        "on": lambda: strata.init(mesh, timeout=300, metrics=metrics),
        "off": lambda: strata.init(mesh, timeout=300, metrics=other if other else False,
                                   trace=args.baseline != "nothing"),
    }
    worlds = {}
    for side in (("off", "on") if args.off_first else ("on", "off")):
        worlds[side] = make_world[side]()
    for name, make in (("demo model", demo_case), ("collective-heavy", collective_case)):
        if args.case and name != args.case:
            continue
        steps = {side: make(w) for side, w in worlds.items()}
        for side in ("on", "off"):  # warm-up
            for _ in range(2):
                steps[side]()
        times = {"on": [], "off": []}
        worlds["on"].group("world").barrier()
        worlds["off"].group("world").barrier()
        ops_before = recorded_ops(metrics)
        if args.perf_ctl:
            perf_control(args.perf_ctl, "enable")
        for i in range(args.pairs):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            for side in (("on",) if args.on_only else order):
                t0 = time.perf_counter()
                if side == "on":
                    with metrics.step() as s:
                        s.tokens = steps["on"]()
                elif other is not None:
                    with other.step() as s:
                        s.tokens = steps["off"]()
                else:
                    steps["off"]()
                times[side].append(time.perf_counter() - t0)
        if args.perf_ctl:
            perf_control(args.perf_ctl, "disable")
        ops_per_step = (recorded_ops(metrics) - ops_before) / args.pairs
        if env.rank == 0:
            print(json.dumps({"case": name, "on": times["on"], "off": times["off"],
                              "ranks": env.world_size, "baseline": args.baseline,
                              "off_first": args.off_first,
                              "ops_per_step": ops_per_step}), flush=True)
    # The registry really recorded: steps and collectives of the "on" world only.
    if env.rank == 0:
        t = metrics.totals()
        print(json.dumps({"check": "recorded", "steps": t["steps"],
                          "has_collectives": "strata_collective_bytes_total{" in metrics.text()}),
              flush=True)
    worlds["off"].destroy()
    worlds["on"].destroy()


if __name__ == "__main__":
    main()
