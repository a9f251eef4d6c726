"""One rank of the data-parallel benchmark (run by run_data_parallel.py
under torchrun, 4 CPU ranks).

A model of about 50 M parameters (residual MLP blocks, fp32) takes training
steps (zero_grad, forward, backward, the gradient reduction, SGD step) with,
interleaved in rounds so that the noise of a shared machine hits every
figure alike:
  strata       strata.nn.DataParallel over strata's Gloo backend;
  ddp          torch's DistributedDataParallel over gloo (its defaults);
  ddp_views    the same with gradient_as_bucket_view=True (no bucket copies,
               as strata's flat buffers);
  loop         the per-parameter loop a user writes without either:
               ``for p in params: dp.all_reduce(p.grad, op="avg")``.
Each figure is the median over rounds of the slowest rank's step time.

Then the optimizer state per rank: AdamW replicated (torch.optim.AdamW
after one step) against ZeRO-1 (strata.optim.DistributedOptimizer(AdamW)
around DataParallel, after one step), in bytes of state tensors; and the
step time of the two. Rank 0 writes JSON to --out.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import strata
import strata.nn as snn


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    return ap.parse_args()


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def model(h, blocks):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(h) for _ in range(blocks)])


def main():
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's env://
    world = strata.init()            # Gloo under torchrun, through torchrun's store
    dp = world.group("dp")
    rank = world.rank
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g)

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        world.group().all_reduce(t, op="max")
        return t.item()

    def step_fn(module, opt, reduce=None):
        def step():
            opt.zero_grad(set_to_none=False)
            module(x).pow(2).mean().backward()
            if reduce is not None:
                reduce()
            opt.step()
        return step

    from torch.nn.parallel import DistributedDataParallel
    variants = {}
    m = snn.DataParallel(model(args.hidden, args.blocks), world)
    variants["strata"] = step_fn(m, torch.optim.SGD(m.parameters(), lr=1e-3))
    d = DistributedDataParallel(model(args.hidden, args.blocks))
    variants["ddp"] = step_fn(d, torch.optim.SGD(d.parameters(), lr=1e-3))
    dv = DistributedDataParallel(model(args.hidden, args.blocks), gradient_as_bucket_view=True)
    variants["ddp_views"] = step_fn(dv, torch.optim.SGD(dv.parameters(), lr=1e-3))
    plain = model(args.hidden, args.blocks)
    params = list(plain.parameters())

    def loop():
        for p in params:
            dp.all_reduce(p.grad, op="avg")
    variants["loop"] = step_fn(plain, torch.optim.SGD(params, lr=1e-3), loop)
    n_params = sum(p.numel() for p in params)

    times = {k: [] for k in variants}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and sets strata's layout)
        for name, step in variants.items():
            world.group().barrier()
            start = time.perf_counter()
            step()
            t = slowest(time.perf_counter() - start)
            if rnd > 0:
                times[name].append(t)
    result = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    buckets = len(m.buckets)
    del variants, m, d, dv, plain, params

    # Optimizer state: AdamW replicated against ZeRO-1 (one step each), and
    # the step time of the two (median of a few).
    def state_bytes(opt):
        return sum(v.numel() * v.element_size() for s in opt.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    mem = {}
    for zero in (False, True):
        mz = snn.DataParallel(model(args.hidden, args.blocks), world)
        opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, mz.parameters(), world,
                                                 lr=1e-3) if zero
               else torch.optim.AdamW(mz.parameters(), lr=1e-3))
        step = step_fn(mz, opt)
        ts = []
        for rnd in range(4):
            world.group().barrier()
            start = time.perf_counter()
            step()
            if rnd > 0:
                ts.append(slowest(time.perf_counter() - start))
        held = opt.state_bytes() if zero else state_bytes(opt)
        t = torch.tensor([held], dtype=torch.float64)
        world.group().all_reduce(t, op="max")
        mem["zero" if zero else "adamw"] = (t.item(), statistics.median(ts) * 1e3)
        del mz, opt, step
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": world.size, "params": n_params, "hidden": args.hidden,
                       "blocks": args.blocks, "tokens": args.tokens, "rounds": args.rounds,
                       "buckets": buckets, "transport": dp.transport, "step_ms": result,
                       "adamw_state_bytes": mem["adamw"][0], "zero_state_bytes": mem["zero"][0],
                       "adamw_step_ms": mem["adamw"][1], "zero_step_ms": mem["zero"][1]}, f)
    world.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
