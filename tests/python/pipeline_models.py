"""Small models for the pipeline tests, cut into stages, and the unpipelined
reference they are compared with (computed in the same process).

Each stage passes on two tensors of different dtypes: the hidden state
(fp64 [rows, d]) and the token ids (int64 [rows], which need no gradient).
With a batch that does not divide evenly into the microbatches, the
microbatches differ in shape.
"""

import copy

import torch
from torch import nn

DTYPE = torch.float64


class Block(nn.Module):
    """(h, ids) -> (tanh(W h + b) + 0.1 emb[ids], ids)."""

    def __init__(self, d, vocab=5):
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=DTYPE)
        self.emb = nn.Embedding(vocab, d, dtype=DTYPE)

    def forward(self, h, ids):
        return torch.tanh(self.lin(h)) + 0.1 * self.emb(ids), ids


class Head(nn.Module):
    """The last stage: a block, then a projection to `out` values."""

    def __init__(self, d, out):
        super().__init__()
        self.block = Block(d)
        self.out = nn.Linear(d, out, dtype=DTYPE)

    def forward(self, h, ids):
        h, _ = self.block(h, ids)
        return self.out(h)


def make_stages(num_stages, d=6, out=3, seed=0):
    """The model as a list of stage modules (the same on every rank for a
    given seed)."""
    torch.manual_seed(seed)
    return [Block(d) for _ in range(num_stages - 1)] + [Head(d, out)]


def make_batch(rows, d=6, out=3, seed=1):
    """((x, ids), y) for `rows` samples; y is a fixed function of x that
    the model can learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g, dtype=DTYPE)
    ids = torch.randint(0, 5, (rows,), generator=g)
    teacher = torch.randn(d, out, generator=torch.Generator().manual_seed(42), dtype=DTYPE)
    return (x, ids), torch.tanh(x @ teacher)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def reference_step(stages, inputs, targets, m, scale_grads=True):
    """One unpipelined step over m microbatches (torch.tensor_split along
    dim 0, as the schedules split): accumulates gradients in the stages'
    parameters and returns the per-microbatch losses."""
    xs = [torch.tensor_split(t, m, dim=0) for t in inputs]
    ys = torch.tensor_split(targets, m, dim=0)
    losses = []
    for i in range(m):
        args = tuple(x[i] for x in xs)
        for stage in stages[:-1]:
            args = stage(*args)
        loss = loss_fn(stages[-1](*args), ys[i])
        losses.append(loss.detach())
        (loss / m if scale_grads else loss).backward()
    return losses


def copy_of(stages):
    """Stages with the same parameters, for a pipelined run beside the
    reference."""
    return [copy.deepcopy(s) for s in stages]
