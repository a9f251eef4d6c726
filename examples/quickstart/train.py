import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn

env = strata.launch_env()                      # rank, world size, node, launcher
mesh = strata.Mesh(env.world_size, tp=2)       # dp = world size / tp
with strata.init(mesh) as world:               # one communicator per group of the mesh
    if env.rank == 0:
        print(mesh.describe())                 # every group of every axis
    torch.manual_seed(0)                       # the same initial model on every rank
    mlp = torch.nn.Sequential(
        snn.ColumnParallelLinear(64, 256, group=world),   # output features split over tp
        torch.nn.GELU(),
        snn.RowParallelLinear(256, 64, group=world, input_is_parallel=True))
    start = ckpt.latest_step("ckpt") or 0      # a checkpoint of an earlier run?
    if start:                                  # resume: each rank loads its shards in place
        ckpt.load("ckpt", mlp.state_dict(), world=world)
    model = snn.DataParallel(mlp, world)       # gradients averaged over dp, as torch's DDP
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = world.group("dp")                     # this rank's data-parallel group
    torch.manual_seed(1 + dp.rank + start)     # each replica its own data
    for step in range(start + 1, start + 21):
        x = torch.randn(32, 64)
        loss = (model(x) - x).pow(2).mean()
        model.zero_grad()                      # zeroes DataParallel's gradient buffers
        loss.backward()                        # reduces bucket by bucket while it runs
        opt.step()
    ckpt.save(mlp.state_dict(), "ckpt", step=step, world=world)   # global tensors, sharded
    if env.rank == 0:
        print(f"steps {start + 1}-{step}: loss {loss.item():.4f}; checkpoint in ./ckpt")
