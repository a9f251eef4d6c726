"""The nccl backend from Python, in one process or, under torchrun, on
several (tools/dev/gpu_checks.sh runs it on 1, 2, 4 and 8 ranks, sharing
one GPU where NCCL allows it). On a machine without a GPU this checks the
parts that need none: that strata uses the libnccl torch loaded (one NCCL
per process), and the clear errors; the CUDA-tensor tests skip there and
run on the device machine."""

import os

import pytest
import torch  # first: torch loads its NCCL, strata must use that one

import strata
import strata.nccl  # not imported by `import strata`

GPU = torch.cuda.is_available()


def _mapped_nccl():
    """Real paths of the libnccl files mapped into this process (the reference)."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            if name == "libnccl.so" or name.startswith("libnccl.so."):
                paths.add(os.path.realpath(path))
    return paths


def test_nccl_is_in_the_build():
    assert "nccl" in strata.available_backends()


def test_strata_uses_the_nccl_torch_loaded():
    torch_nccl = _mapped_nccl()
    if not torch_nccl:
        pytest.skip("this torch build does not load a libnccl")
    info = strata.nccl.library()
    assert {info["path"]} == torch_nccl
    assert info["version"] == tuple(torch.cuda.nccl.version())
    assert "already loaded" in info["reason"]
    # Still one copy after strata resolved it.
    assert _mapped_nccl() == torch_nccl


def test_asking_for_another_nccl_is_refused(tmp_path):
    info = strata.nccl.library()
    other = tmp_path / "libnccl.so.2"
    other.write_bytes(b"not really a library")
    with pytest.raises(strata.CommError, match="one NCCL per process"):
        strata.nccl.library(str(other))
    assert strata.nccl.library() == info


@pytest.mark.skipif(GPU, reason="a GPU is visible: test_cuda_collectives covers init")
def test_init_nccl_without_a_gpu_says_so():
    with pytest.raises(strata.CommError, match="needs a CUDA device"):
        strata.init(backend="nccl", timeout=30)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device (runs on the device machine)")
def test_cuda_collectives_on_the_current_stream():
    # The rank's device, as strata picks it (the local rank modulo the
    # devices): under a launcher several ranks may share one GPU.
    torch.cuda.set_device(strata.launch_env().local_rank % torch.cuda.device_count())
    with strata.init(backend="nccl", timeout=60) as world:
        g = world.group("world")
        assert (g.backend, g.memory) == ("nccl", "cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
            ref = x.clone()  # a world of one: the sum is the tensor itself
            g.all_reduce(x)
            out = torch.empty(world.size * x.numel(), device="cuda")
            g.all_gather(out, x)
        stream.synchronize()
        torch.testing.assert_close(x, ref)
        torch.testing.assert_close(out, ref.repeat(world.size))
        for dtype in (torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64):
            y = torch.ones(1000, device="cuda", dtype=dtype)
            g.all_reduce(y, op="max")
            assert torch.equal(y, torch.ones_like(y))
        with pytest.raises(strata.InvalidArgument, match="works on CUDA tensors"):
            g.all_reduce(torch.ones(4))
        work = g.all_reduce(torch.ones(4, device="cuda"), async_op=True)
        assert work.wait(timeout=30)
