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
    model = torch.nn.Sequential(
        snn.ColumnParallelLinear(64, 256, group=world),   # output features split over tp
        torch.nn.GELU(),
        snn.RowParallelLinear(256, 64, group=world, input_is_parallel=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = world.group("dp")                     # this rank's data-parallel group
    torch.manual_seed(1 + dp.rank)             # each replica its own data
    for step in range(1, 21):
        x = torch.randn(32, 64)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():           # torch.distributed's names and conventions
            dp.all_reduce(p.grad, op=strata.ReduceOp.AVG)
        opt.step()
    ckpt.save(model.state_dict(), "ckpt", step=step, world=world)   # global tensors, sharded
    if env.rank == 0:
        print(f"step {step}: loss {loss.item():.4f}; checkpoint in ./ckpt")
