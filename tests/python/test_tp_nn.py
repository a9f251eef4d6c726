"""strata.nn in one process (group=None: one rank, no communication): the
modules equal their torch counterparts from the same seed, and every
argument error is raised as strata.InvalidArgument naming the values."""

import pytest
import torch
import torch.nn.functional as F

import strata
import strata.nn as snn


def test_linear_layers_equal_torch_linear():
    for make in (lambda: snn.ColumnParallelLinear(6, 4, group=None),
                 lambda: snn.RowParallelLinear(6, 4, group=None)):
        torch.manual_seed(0)
        ref = torch.nn.Linear(6, 4)
        torch.manual_seed(0)
        layer = make()
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
        x = torch.randn(3, 2, 6)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        layer(xa).sum().backward()
        ref(xb).sum().backward()
        assert torch.allclose(xa.grad, xb.grad)
        assert torch.allclose(layer.weight.grad, ref.weight.grad)
        assert torch.allclose(layer.bias.grad, ref.bias.grad)


def test_skip_bias_add_returns_the_bias():
    layer = snn.ColumnParallelLinear(4, 4, group=None, skip_bias_add=True)
    out, bias = layer(torch.randn(2, 4))
    assert bias is layer.bias
    no_bias = snn.RowParallelLinear(4, 4, group=None, bias=False, skip_bias_add=True)
    assert no_bias(torch.randn(2, 4))[1] is None


def test_embedding_and_cross_entropy_equal_torch():
    torch.manual_seed(1)
    ref = torch.nn.Embedding(10, 3)
    torch.manual_seed(1)
    emb = snn.VocabParallelEmbedding(10, 3, group=None)
    ids = torch.tensor([[1, 9], [0, 4]])
    assert torch.equal(emb(ids), ref(ids))
    z = torch.randn(5, 10, requires_grad=True)
    t = torch.tensor([1, -100, 9, 0, 3])
    got = snn.vocab_parallel_cross_entropy(z, t, group=None, label_smoothing=0.2)
    z2 = z.detach().clone().requires_grad_()
    want = F.cross_entropy(z2, t, reduction="none", label_smoothing=0.2)
    assert torch.allclose(got, want, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    assert torch.allclose(z.grad, z2.grad, atol=1e-6)


def test_gpt_loss_falls_in_one_process():
    torch.manual_seed(0)
    model = snn.ParallelGPT(16, 16, 2, 1, 8, group=None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.arange(8).repeat(2, 1).t() % 16
    first = None
    for _ in range(20):
        loss = model.loss(ids, (ids + 1) % 16)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_strata_nn_is_loaded_on_first_use():
    import importlib
    assert strata.nn is importlib.import_module("strata.nn")


def test_argument_errors():
    with pytest.raises(strata.InvalidArgument, match="group must be a strata.World"):
        snn.RowParallelLinear(4, 4, group=3)
    with pytest.raises(strata.InvalidArgument, match="sequence_parallel needs input_is_parallel"):
        snn.RowParallelLinear(4, 4, group=None, sequence_parallel=True)
    with pytest.raises(strata.InvalidArgument, match="hidden_size 10 is not divisible by "
                                                     "num_heads 4"):
        snn.ParallelSelfAttention(10, 4, group=None)
    emb = snn.VocabParallelEmbedding(4, 2, group=None)
    with pytest.raises(strata.InvalidArgument, match="ids must be int64 or int32"):
        emb(torch.zeros(2))
    with pytest.raises(strata.InvalidArgument, match="id -1 is outside the vocabulary"):
        emb(torch.tensor([-1]))
    z = torch.zeros(3, 4)
    with pytest.raises(strata.InvalidArgument, match=r"label_smoothing -0.5 is outside \[0, 1\)"):
        snn.vocab_parallel_cross_entropy(z, torch.zeros(3, dtype=torch.long), group=None,
                                         label_smoothing=-0.5)
    with pytest.raises(strata.InvalidArgument, match=r"target shape \(2,\) does not match"):
        snn.vocab_parallel_cross_entropy(z, torch.zeros(2, dtype=torch.long), group=None)
    with pytest.raises(strata.InvalidArgument, match="target 4 is outside the vocabulary"):
        snn.vocab_parallel_cross_entropy(z, torch.tensor([0, 4, 1]), group=None)
