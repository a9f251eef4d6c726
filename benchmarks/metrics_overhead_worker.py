#!/usr/bin/env python3
"""One rank of run_metrics_overhead.py: step time with metrics on against
off, in the same run. Two worlds live side by side, one whose communicators
record into a strata.metrics.Metrics (its steps marked with Metrics.step)
and one with metrics=False (--baseline nothing: the flight recorder off too,
trace=False), each with its own copy of the case; steps
alternate between them one by one (the order of each pair flips), so that
the pairs see the same machine and the ratio of a pair cancels a slow
spell of a shared machine. Rank 0 prints one JSON line per case:
{"case", "on": [step seconds], "off": [...]} (on[i], off[i] a pair).

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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=150, help="steps per side, in pairs")
    p.add_argument("--baseline", choices=["no-metrics", "nothing"], default="no-metrics",
                   help="the 'off' side: metrics off (the flight recorder on, as by default), "
                        "or metrics and the flight recorder both off")
    args = p.parse_args()
    torch.set_num_threads(1)
    env = strata.launch_env()
    mesh = strata.Mesh(env.world_size, tp=2 if env.world_size % 2 == 0 else 1)
    metrics = sm.Metrics(job="bench")
    worlds = {"on": strata.init(mesh, timeout=300, metrics=metrics),
              "off": strata.init(mesh, timeout=300, metrics=False,
                                 trace=args.baseline == "no-metrics")}
    for name, make in (("demo model", demo_case), ("collective-heavy", collective_case)):
        steps = {side: make(w) for side, w in worlds.items()}
        for side in ("on", "off"):  # warm-up
            for _ in range(2):
                steps[side]()
        times = {"on": [], "off": []}
        worlds["on"].group("world").barrier()
        worlds["off"].group("world").barrier()
        for i in range(args.pairs):
            for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
                t0 = time.perf_counter()
                if side == "on":
                    with metrics.step() as s:
                        s.tokens = steps["on"]()
                else:
                    steps["off"]()
                times[side].append(time.perf_counter() - t0)
        if env.rank == 0:
            print(json.dumps({"case": name, "on": times["on"], "off": times["off"],
                              "ranks": env.world_size, "baseline": args.baseline}), flush=True)
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
