"""One rank of the tensor-parallel benchmark (run by run_tp.py under mpirun).

For each layer case on the tp group of all ranks it measures, interleaved in
rounds so that the noise of a shared machine hits every figure alike:
  layer   strata.nn forward + backward;
  gemm    the same three local GEMMs (forward, input gradient, weight
          gradient) with torch alone;
  comm    the layer's collectives alone (strata, same sizes);
  torch   the same layer built with torch.distributed.tensor.parallel
          (ColwiseParallel / RowwiseParallel) over gloo, forward + backward.
strata runs on its Gloo backend (bootstrapped through torch's TCPStore), or
on MPI with --backend mpi.
Each figure is the median over rounds of the slowest rank's time per
iteration. Rank 0 writes them as JSON to --out.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import strata
import strata.nn as snn
from strata import _tp_comm as tp_comm  # the layers' collectives, measured alone


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=1024)  # seq * batch (batch 4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--backend", default="gloo", choices=["mpi", "gloo"],
                    help="strata's communicator: Gloo through torch's TCPStore, or MPI")
    return ap.parse_args()


def main():
    args = parse()
    torch.set_num_threads(1)
    env = strata.launch_env()
    # torch first: rank 0 serves the TCPStore through which strata's Gloo
    # backend bootstraps too.
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size,
                            init_method=f"tcp://127.0.0.1:{os.environ['STRATA_BENCH_PORT']}")
    store = (dist.PrefixStore("strata/", dist.distributed_c10d._get_default_store())
             if args.backend == "gloo" else None)
    world = strata.init(strata.Mesh(env.world_size, tp=env.world_size), backend=args.backend,
                        timeout=300, store=store)
    tp = world.group("tp")
    n, r = tp.size, tp.rank
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (n,))
    batch = 4
    seq = args.tokens // batch
    h, f = args.hidden, args.ffn

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        world.group("world").all_reduce(t, op="max")
        return t.item()

    def timed(fn):
        world.group("world").barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return slowest((time.perf_counter() - start) / args.iters)

    def rand(*shape):
        return torch.randn(*shape)

    def finish(tx):
        # DTensor leaves the input gradient's reduce-scatter (sequence
        # parallelism) running as an AsyncCollectiveTensor; wait for it, so
        # that torch's time includes it and it does not run into the next
        # measurement.
        if isinstance(tx.grad, AsyncCollectiveTensor):
            tx.grad = tx.grad.wait()

    def column_case(sp):
        torch.manual_seed(0)
        layer = snn.ColumnParallelLinear(h, f, group=tp, sequence_parallel=sp)
        x_local = rand(seq // n if sp else seq, batch, h).requires_grad_()
        x_full = rand(seq, batch, h)
        dy = rand(seq, batch, f // n)
        w = layer.weight.detach().clone()

        def run_layer():
            layer.weight.grad = layer.bias.grad = x_local.grad = None
            layer(x_local).backward(dy)

        def run_gemm():
            F.linear(x_full, w)
            dy.matmul(w)
            dy.reshape(-1, f // n).t().matmul(x_full.reshape(-1, h))

        dx_full = rand(seq, batch, h)

        def run_comm():
            if sp:
                g1 = tp_comm.all_gather_rows(x_local.detach(), tp)
                g2 = tp_comm.all_gather_rows(x_local.detach(), tp)
                tp_comm.reduce_scatter_rows(dx_full, tp)
                del g1, g2
            else:
                tp_comm.all_reduce(dx_full, tp)

        tmodel = torch.nn.Sequential(torch.nn.Linear(h, f))
        plan = ColwiseParallel(input_layouts=Shard(0)) if sp else ColwiseParallel()
        tmodel = parallelize_module(tmodel, mesh, {"0": plan})
        tx = rand(seq // n if sp else seq, batch, h).requires_grad_()

        def run_torch():
            tmodel.zero_grad(set_to_none=True)
            tx.grad = None
            out = tmodel(tx)
            out.backward(torch.ones_like(out))
            finish(tx)

        return run_layer, run_gemm, run_comm, run_torch

    def row_case(sp):
        torch.manual_seed(0)
        layer = snn.RowParallelLinear(f, h, group=tp, input_is_parallel=True,
                                      sequence_parallel=sp)
        x_local = rand(seq, batch, f // n).requires_grad_()
        dy = rand(seq // n if sp else seq, batch, h)
        dy_full = rand(seq, batch, h)
        w = layer.weight.detach().clone()
        x_plain = x_local.detach()

        def run_layer():
            layer.weight.grad = layer.bias.grad = x_local.grad = None
            layer(x_local).backward(dy)

        def run_gemm():
            F.linear(x_plain, w)
            dy_full.matmul(w)
            dy_full.reshape(-1, h).t().matmul(x_plain.reshape(-1, f // n))

        y_full = rand(seq, batch, h)

        def run_comm():
            if sp:
                tp_comm.reduce_scatter_rows(y_full, tp)
                tp_comm.all_gather_rows(dy, tp)
            else:
                tp_comm.all_reduce(y_full, tp)

        tmodel = torch.nn.Sequential(torch.nn.Linear(f, h))
        plan = RowwiseParallel(output_layouts=Shard(0)) if sp else RowwiseParallel()
        tmodel = parallelize_module(tmodel, mesh, {"0": plan})
        tx = rand(seq, batch, f // n).requires_grad_()

        def run_torch():
            tmodel.zero_grad(set_to_none=True)
            tx.grad = None
            out = tmodel(tx)
            out.backward(torch.ones_like(out))
            finish(tx)

        return run_layer, run_gemm, run_comm, run_torch

    cases = [
        (f"column-parallel {h}->{f}", column_case(False)),
        (f"row-parallel {f}->{h}", row_case(False)),
        (f"column-parallel {h}->{f}, sequence-parallel", column_case(True)),
        (f"row-parallel {f}->{h}, sequence-parallel", row_case(True)),
    ]
    results = []
    for name, fns in cases:
        for fn in fns:  # warm up (allocations, first-call costs)
            fn()
        samples = [[] for _ in fns]
        for _ in range(args.rounds):
            for i, fn in enumerate(fns):
                samples[i].append(timed(fn))
        layer, gemm, comm, tdt = (statistics.median(s) for s in samples)
        results.append({"case": name, "layer_ms": layer * 1e3, "gemm_ms": gemm * 1e3,
                        "comm_ms": comm * 1e3, "torch_tp_ms": tdt * 1e3})
        if r == 0:
            print(f"{name:50s} layer {layer * 1e3:8.2f} ms  gemm {gemm * 1e3:8.2f}  "
                  f"comm {comm * 1e3:7.2f}  torch TP {tdt * 1e3:8.2f}", flush=True)
    if env.rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"ranks": n, "tokens": args.tokens, "hidden": h, "ffn": f,
                       "results": results}, fh)
    dist.destroy_process_group()
    world.destroy()


if __name__ == "__main__":
    main()
