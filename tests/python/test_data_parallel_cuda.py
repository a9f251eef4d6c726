"""strata.nn.DataParallel and ZeRO-1 on CUDA tensors over the nccl backend
(a world of one rank, one GPU): the buckets' collectives on the layer's own
stream, ordered after autograd's; training equals the same model trained
without them. Skipped where there is no GPU (here); the device machine runs
it (tools/dev/gpu_checks.sh).
"""

import pytest
import torch

import strata
import strata.nn as snn

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or "nccl" not in strata.available_backends(),
    reason="needs a GPU and strata's nccl backend")


def mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 8)).to(device)


def train(model, opt, device, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g).to(device)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


@needs_gpu
@pytest.mark.parametrize("zero", [False, True])
def test_cuda_training_equals_plain(zero):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ref = mlp(device)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), device)
    with strata.init(backend="nccl") as world:
        dp = snn.DataParallel(mlp(device), world, bucket_bytes=64 << 10, record_events=True)
        opt = (strata.optim.DistributedOptimizer(torch.optim.AdamW, dp.parameters(), world,
                                                 lr=1e-3)
               if zero else torch.optim.AdamW(dp.parameters(), lr=1e-3))
        train(dp, opt, device)
        torch.cuda.synchronize()
        assert len(dp.buckets) >= 2
        assert sum(1 for e in dp.events if e[0] == "launch") == 5 * len(dp.buckets)
        for p, q in zip(dp.module.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
