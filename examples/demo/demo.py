"""The strata demo, launched on 8 CPU ranks by `make demo`.

The main act is training: a small GPT, pipelined over 2 ranks (1F1B),
tensor-parallel over 2 (with sequence parallelism) and data-parallel over
2, learns strata's own docs, printing the pipeline schedule's grid once,
then step, loss, tokens/s and time per step with a progress bar, and at the
end the measured pipeline bubble. Before it, briefly:
  0. the machine's topology, the NCCL profile for it and the NCCL settings lint;
  1. the launch environment each rank detects;
  2. the dp2 x tp2 x pp2 mesh: its groups, and each rank's coordinates;
  3. the World: one communicator per group; every rank allreduces its rank
     over each axis, and rank 0 prints what each group summed;
  4. the bus bandwidth of a 64 MiB allreduce over all ranks.
Then 5. the training (examples/demo/train_gpt.py), saving a checkpoint
asynchronously every 100 steps and printing how long training was blocked,
serving its metrics (Prometheus, with MFU) and writing them as .prom files,
recording a timeline of steps 2, 3 and 100 (Chrome trace / Perfetto JSON)
and drawing the pipeline schedule, simulated and as measured, as PNG
pictures, all into the output folder (examples/demo/demo_observe.py), with a
summary table at the end; 6. the last checkpoint reloaded under another
split (dp4 x tp2), with the loss on a fixed batch compared
(examples/demo/demo_checkpoint.py).
"""

import os
import sys
import time

import numpy as np
import torch

import strata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_checkpoint  # noqa: E402
import demo_observe  # noqa: E402
import train_gpt  # noqa: E402

AXES = ["tp", "pp", "dp", "world"]
TRAIN_STEPS = int(os.environ.get("STRATA_DEMO_STEPS", "300"))
BUSBW_BYTES = 64 << 20


def show_topology(env):
    """Rank 0 prints the detected topology, its class and NCCL profile, and the
    lint of the NCCL settings in this environment (strata-topo's report)."""
    if env.rank != 0:
        return
    topo = strata.topology.detect()
    gpus = f"{len(topo.gpus)} GPU(s)" if topo.gpus else "no GPU"
    rdma = [n["name"] for n in topo.nics if n["kind"] != "Ethernet"]
    net = f"RDMA via {', '.join(rdma)}" if rdma else "TCP only (no InfiniBand, RoCE or EFA)"
    print(f"This machine: {gpus}, {net}. Topology class: {topo.cls}.", flush=True)
    print(topo.text(), flush=True)
    errors = sum(f.severity == "error" for f in topo.lint)
    print(f"NCCL settings lint: {errors} error(s), {len(topo.lint) - errors} other finding(s)\n",
          flush=True)


def show_mesh(env, mesh):
    if env.rank == 0:
        print(f"strata {strata.__version__} on {env.world_size} ranks via {env.launcher}", flush=True)
        print(mesh.describe(), flush=True)
    coords = mesh.coords(env.rank)
    print(f"[rank {env.rank}] {env} coords {coords} tp group {mesh.group_of(env.rank, 'tp')}",
          flush=True)


def show_group_sums(world):
    """Each rank allreduces its rank over each axis; rank 0 gathers every
    rank's results and prints one line per group."""
    mesh = world.mesh
    mine = np.zeros(len(AXES), dtype=np.int64)
    for i, axes in enumerate(AXES):
        x = np.array([world.rank], dtype=np.int64)
        world.group(axes).all_reduce(x)
        mine[i] = x[0]
    everyone = np.zeros((world.size, len(AXES)), dtype=np.int64)
    world.group().all_gather(everyone, mine)
    if world.rank != 0:
        return
    print("\nallreduce(sum) of each rank's number over its groups:", flush=True)
    for i, axes in enumerate(AXES):
        groups = [list(range(world.size))] if axes == "world" else mesh.groups(axes)
        for members in groups:
            got = {int(everyone[r, i]) for r in members}
            want = sum(members)
            status = "ok" if got == {want} else f"WRONG (expected {want})"
            print(f"  {axes:6s} group {members}: sum = {sorted(got)[0]} {status}", flush=True)


def show_busbw(world):
    g = world.group()
    x = np.ones(BUSBW_BYTES // 4, dtype=np.float32)
    g.all_reduce(x)  # warm-up
    iters = 5
    g.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        g.all_reduce(x)
    elapsed = np.array([(time.perf_counter() - start) / iters])
    g.all_reduce(elapsed, op="max")
    n = world.size
    algbw = BUSBW_BYTES / elapsed[0] / 1e9
    if world.rank == 0:
        print(f"\nallreduce of 64 MiB over {n} ranks ({g.transport}): {elapsed[0] * 1e3:.1f} ms, "
              f"algbw {algbw:.2f} GB/s, busbw {algbw * 2 * (n - 1) / n:.2f} GB/s", flush=True)


def main():
    env = strata.launch_env()
    show_topology(env)
    tp = pp = 2 if env.world_size % 4 == 0 else 1
    mesh = strata.Mesh(env.world_size, tp=tp, pp=pp, ranks_per_node=env.local_world_size)
    show_mesh(env, mesh)
    torch.set_num_threads(1)  # ranks outnumber cores here
    with strata.init(mesh, timeout=300, metrics=demo_observe.make_metrics()) as world:
        show_group_sums(world)
        show_busbw(world)
        checkpoints = demo_checkpoint.DemoCheckpoints(world)
        observe = demo_observe.Observe(world, TRAIN_STEPS)
        first, last, schedule = train_gpt.train(world, steps=TRAIN_STEPS, checkpoints=checkpoints,
                                                observe=observe)
        checkpoints.close()
        observe.finish(schedule, checkpoints.blocked)
    if env.rank == 0 and not last < first:
        raise SystemExit(f"demo: the loss did not fall ({first:.3f} -> {last:.3f})")
    if checkpoints.reference is None:  # ZeRO-1 (STRATA_DEMO_ZERO=1): no plain AdamW saved
        return
    if not demo_checkpoint.reload_and_compare(env, checkpoints):
        raise SystemExit("demo: the reloaded checkpoint's loss does not match")


if __name__ == "__main__":
    try:
        main()
    except strata.Error as e:
        raise SystemExit(f"demo: {type(e).__name__}: {e}")
