#!/usr/bin/env python3
"""One rank of run_metrics_overhead.py: step time with metrics on against
off, in the same run. Rounds alternate (the order flips every round, so a
slow spell of a shared machine falls on both sides): each round builds a
World, either one whose communicators record into a strata.metrics.Metrics
(the same one every "on" round; steps marked with its step()) or one with
metrics=False, runs warm-up and measured steps, and destroys it. (Two
worlds alive at once would not do: the MPI backend's progress threads of
one slow the other's operations.) Rank 0 prints one JSON line per case:
{"case", "on": [step seconds], "off": [...]}.

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
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps per round and side")
    args = p.parse_args()
    torch.set_num_threads(1)
    env = strata.launch_env()
    mesh = strata.Mesh(env.world_size, tp=2 if env.world_size % 2 == 0 else 1)
    metrics = sm.Metrics(job="bench")
    for name, make in (("demo model", demo_case), ("collective-heavy", collective_case)):
        times = {"on": [], "off": []}
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            for side in order:
                world = strata.init(mesh, timeout=300,
                                    metrics=metrics if side == "on" else False)
                step = make(world)
                for _ in range(2):  # warm-up
                    step()
                world.group("world").barrier()
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    if side == "on":
                        with metrics.step() as s:
                            s.tokens = step()
                    else:
                        step()
                    times[side].append(time.perf_counter() - t0)
                del step
                world.destroy()
        if env.rank == 0:
            print(json.dumps({"case": name, "on": times["on"], "off": times["off"],
                              "ranks": env.world_size}), flush=True)
    # The registry really recorded: steps and collectives of the "on" world only.
    if env.rank == 0:
        t = metrics.totals()
        print(json.dumps({"check": "recorded", "steps": t["steps"],
                          "has_collectives": "strata_collective_bytes_total{" in metrics.text()}),
              flush=True)


if __name__ == "__main__":
    main()
