#!/usr/bin/env python3
"""What strata.nn.ShardedParameter costs: the time of a strata.nn layer's
forward + backward, and of an AdamW step, with its sharded parameters as
ShardedParameters (as strata.nn makes them) and as plain Parameters (as
before ShardedParameter existed), interleaved in one process so that noise
on a shared machine falls on both. One process, no communication
(group=None): what is left is the per-call cost of the Python
__torch_function__ that carries the shard layout.

    PYTHONPATH=build/python python3 benchmarks/sharded_parameter_overhead.py [--repeats 7]
"""

import argparse
import statistics
import time

import torch

import strata.nn as snn


def plain(model):
    """``model`` with every ShardedParameter replaced by a plain Parameter."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(p, snn.ShardedParameter):
                setattr(mod, name, torch.nn.Parameter(p.detach().clone()))
    return model


def timed(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def case(name, make, run, calls, repeats):
    a, b = make(), plain(make())
    run(a), run(b)  # warm up
    sharded, base = [], []
    for _ in range(repeats):
        sharded.append(timed(lambda: run(a), calls))
        base.append(timed(lambda: run(b), calls))
    s, p = statistics.median(sharded), statistics.median(base)
    print(f"{name:<58} {p * 1e6:10.1f} {s * 1e6:10.1f} {(s - p) * 1e6:+9.1f} {s / p:7.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats}")
    print(f"{'case':<58} {'plain us':>10} {'sharded us':>10} {'delta us':>9} {'ratio':>7}")

    x_small = torch.randn(4, 2, 64)

    def fwd_bwd(x):
        def run(model):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        return run

    case("ColumnParallelLinear(64, 64) fwd+bwd, x [4, 2, 64]",
         lambda: snn.ColumnParallelLinear(64, 64, group=None), fwd_bwd(x_small), 2000,
         args.repeats)
    case("RowParallelLinear(64, 64) fwd+bwd, x [4, 2, 64]",
         lambda: snn.RowParallelLinear(64, 64, group=None), fwd_bwd(x_small), 2000,
         args.repeats)
    x_big = torch.randn(128, 4, 1024)
    case("ColumnParallelLinear(1024, 4096) fwd+bwd, x [128, 4, 1024]",
         lambda: snn.ColumnParallelLinear(1024, 4096, group=None), fwd_bwd(x_big), 20,
         args.repeats)
    ids = torch.randint(0, 256, (16, 2))

    def gpt():
        torch.manual_seed(0)
        return snn.ParallelGPT(256, 64, 4, 2, 16, group=None)

    def gpt_step(m):
        m.zero_grad(set_to_none=True)
        m.loss(ids, torch.roll(ids, 1, 0)).backward()

    case("ParallelGPT(vocab 256, hidden 64, 2 layers) fwd+bwd", gpt, gpt_step, 200, args.repeats)

    for foreach in (False, True):
        def with_adamw(foreach=foreach):
            m = gpt()
            m.loss(ids, torch.roll(ids, 1, 0)).backward()
            m.opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=foreach)
            return m

        def step(m):
            m.opt.step()

        a = with_adamw()
        b = plain(gpt())
        b.loss(ids, torch.roll(ids, 1, 0)).backward()
        b.opt = torch.optim.AdamW(b.parameters(), lr=1e-3, foreach=foreach)
        step(a), step(b)
        sharded, base = [], []
        for _ in range(args.repeats):
            sharded.append(timed(lambda: step(a), 200))
            base.append(timed(lambda: step(b), 200))
        s, p = statistics.median(sharded), statistics.median(base)
        name = f"AdamW(foreach={foreach}).step over ParallelGPT's {len(list(a.parameters()))} params"
        print(f"{name:<58} {p * 1e6:10.1f} {s * 1e6:10.1f} {(s - p) * 1e6:+9.1f} {s / p:7.3f}")


if __name__ == "__main__":
    main()
