"""Tensor-parallel PyTorch modules over strata collectives.

Megatron-Core's layers, with the same option names, as ``torch.nn.Module``
subclasses whose communication runs on a strata group::

    import torch, strata
    from strata import nn as snn

    world = strata.init(strata.Mesh(8, tp=4))            # dp2 x tp4
    torch.manual_seed(0)                                  # same seed on every rank
    fc1 = snn.ColumnParallelLinear(1024, 4096, group=world)   # World -> its "tp" group
    fc2 = snn.RowParallelLinear(4096, 1024, group=world.group("tp"), input_is_parallel=True)
    y = fc2(torch.nn.functional.gelu(fc1(x)))             # x: [seq, batch, 1024]

Activations are sequence-first ([seq, batch, hidden]): under sequence
parallelism each rank holds ``seq / tp`` tokens of the activations outside
the tensor-parallel regions, split along dim 0.

Computation uses torch operators on the tensors' device (CPU or CUDA) and
autograd; communication uses the group's collectives (CUDA tensors go to a
group on NCCL as they are, and are staged through host memory for a group
on MPI or Gloo). Backward overlaps each input-gradient collective with the
weight-gradient GEMM (on CUDA, the collective runs on a side stream).
See docs/tensor-parallel.md for why the modules use torch's GEMMs rather
than strata's C++ kernels.

Initialisation: each module draws its *unsharded* weights from torch's
default CPU generator exactly as ``torch.nn.Linear`` / ``torch.nn.Embedding``
would, then keeps its shard. With the same ``torch.manual_seed`` a model
built with tp = N therefore starts exactly as the same model built with
tp = 1 (or ``group=None``, which means one rank and no communication).

Checkpoints: each sharded parameter is a :class:`ShardedParameter`, which
carries ``tensor_parallel_sharding = (dim, index, count)`` (see
:func:`tensor_sharding`) and passes it on to the tensors ``detach()``,
``clone()`` and ``*_like`` make of it: ``model.state_dict()`` and the
optimizer states torch creates with ``torch.zeros_like(param)`` (Adam's
``exp_avg``, ``exp_avg_sq``). So ``strata.checkpoint.save(model.state_dict(),
..., world=world)`` (or ``{"model": model, "optim": opt}``) writes each
global tensor once and ``load`` reshards it to another tp size.

Gradients are complete after ``backward()``: parameters replicated across
the tp group but applied to token shards under sequence parallelism (layer
norms, the row-parallel bias under skip_bias_add, position embeddings) have
their gradient all-reduced in backward.
"""

from ._tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedParameter,
    VocabParallelEmbedding,
    tensor_sharding,
    tp_group,
    vocab_parallel_cross_entropy,
)
from ._tp_models import ParallelGPT, ParallelMLP, ParallelSelfAttention, ParallelTransformerBlock

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerBlock",
    "ParallelGPT",
    "tp_group",
    "tensor_sharding",
    "ShardedParameter",
    "DataParallel",
    "DataParallelOptions",
    "BucketMismatchError",
    "GradientSyncFailed",
    "ModuleChangedError",
    "ParameterMismatchError",
    "UnusedParametersError",
]

# Data parallelism (bucketed gradient reduction, ZeRO-1's partner) lives in
# _data_parallel.py; see its docstring and docs/data-parallel.md.
from ._data_parallel import (  # noqa: E402
    BucketMismatchError,
    DataParallel,
    DataParallelOptions,
    GradientSyncFailed,
    ModuleChangedError,
    ParameterMismatchError,
    UnusedParametersError,
)
