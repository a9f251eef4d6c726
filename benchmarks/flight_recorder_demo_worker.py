"""One rank of the flight recorder's cost on the demo's model (run by
run_flight_recorder.py under mpirun): the demo's GPT (examples/demo,
dp x tp x pp with 1F1B and DataParallel), built twice over two Worlds of the
same ranks, one with the flight recorder (the default) and one without
(strata.init(trace=False)), trained in alternating rounds of steps so that
the machine's noise falls on both alike. Rank 0 prints one JSON line: the
median over rounds of the slowest rank's time per step, per side, and the
operations per step the recorder saw (the most of any rank: the figure
that, times the cost of recording one, gives the recorder's share).
"""

import json
import os
import statistics
import sys
import time

import torch

import strata
import strata.nn as snn
from strata import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "demo"))
from gpt_stages import GPTStage  # noqa: E402
from train_gpt import batch, corpus  # noqa: E402


def build(world, seq=64, hidden=128, heads=4, layers=2, microbatches=4):
    tp, pp = world.group("tp"), world.group("pp")
    torch.manual_seed(1234)
    full = snn.ParallelGPT(256, hidden, heads, layers, seq, group=tp, sequence_parallel=True)
    model = GPTStage(full, pp.rank, pp.size)
    stage = pipeline.PipelineStage(snn.DataParallel(model, world), pp.rank, world,
                                   num_stages=pp.size)
    schedule = pipeline.Schedule1F1B(stage, microbatches, model.loss)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    return schedule, opt


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 11
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    env = strata.launch_env()
    mesh = strata.Mesh(env.world_size, tp=2, pp=2)
    worlds = {"on": strata.init(mesh), "off": strata.init(mesh, trace=False)}
    assert worlds["on"].trace_dir and worlds["off"].trace_dir is None
    models = {k: build(w) for k, w in worlds.items()}
    text = corpus()
    seq, batch_size = 64, 8
    times = {"on": [], "off": []}
    step = 0

    ops_per_step = []

    def run(side, n):
        nonlocal step
        world = worlds[side]
        schedule, opt = models[side]
        dp = world.group("dp")
        world.group().barrier()
        t_ns = time.time_ns()
        t0 = time.perf_counter()
        for _ in range(n):
            step += 1
            ids, targets = batch(text, step, dp.rank, seq, batch_size)
            opt.zero_grad(set_to_none=False)
            schedule.step(ids.t(), targets.t())
            opt.step()
        mine = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64)
        if side == "on":
            # Counted after the timing: the operations this rank issued in
            # the round (the ring holds 2000, more than a round's).
            ops = [o for o in world._raw.recorded_ops(t_ns) if o["created_ns"] >= t_ns]
            count = torch.tensor([len(ops) / n], dtype=torch.float64)
            world.group().all_reduce(count, op="max")
            ops_per_step.append(count.item())
        world.group().all_reduce(mine, op="max")
        return mine.item()

    for side in ("on", "off"):
        run(side, 2)  # warm up
    for r in range(rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for side in order:
            times[side].append(run(side, steps))
    if env.rank == 0:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(json.dumps({"ranks": env.world_size, "mesh": "dp2 x tp2 x pp2" if env.world_size == 8
                          else f"{env.world_size} ranks, tp2 pp2", "rounds": rounds,
                          "steps_per_round": steps, "s_per_step_on": on, "s_per_step_off": off,
                          "ratio": on / off, "rounds_on": times["on"],
                          "ops_per_step": statistics.median(ops_per_step),
                          "rounds_off": times["off"]}), flush=True)
    for w in worlds.values():
        w.destroy()


if __name__ == "__main__":
    main()
