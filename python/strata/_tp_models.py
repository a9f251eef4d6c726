"""The composite tensor-parallel modules of :mod:`strata.nn`: MLP,
self-attention with heads split across tp, a pre-norm transformer block and
a small GPT. Re-exported by strata.nn; see its docstring for the layout and
initialisation rules.
"""

import torch
import torch.nn.functional as F

from . import _tp_comm as C
from . import _tp_layers as nn
from .errors import InvalidArgument

__all__ = ["ParallelMLP", "ParallelSelfAttention", "ParallelTransformerBlock", "ParallelGPT"]


def _layer_norm(ln, x, group, sequence_parallel):
    """``ln(x)``; under sequence parallelism its (replicated) parameters see
    only this rank's tokens, so their gradients are summed over tp."""
    if not sequence_parallel or C.size_of(group) == 1:
        return ln(x)
    w = C.CopyToTP.apply(ln.weight, group)
    b = C.CopyToTP.apply(ln.bias, group)
    return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)


class ParallelMLP(torch.nn.Module):
    """``fc2(activation(fc1(x)))`` with a column-parallel fc1 (hidden ->
    ffn_hidden) and a row-parallel fc2 (input_is_parallel): one all-reduce
    forward and one backward (all-gather / reduce-scatter under sequence
    parallelism)."""

    def __init__(self, hidden_size, ffn_hidden_size, *, group, bias=True, sequence_parallel=False,
                 activation=F.gelu, dtype=None, device=None):
        super().__init__()
        self.fc1 = nn.ColumnParallelLinear(hidden_size, ffn_hidden_size, group=group, bias=bias,
                                           sequence_parallel=sequence_parallel, dtype=dtype,
                                           device=device)
        self.fc2 = nn.RowParallelLinear(ffn_hidden_size, hidden_size, group=group, bias=bias,
                                        input_is_parallel=True,
                                        sequence_parallel=sequence_parallel, dtype=dtype,
                                        device=device)
        self.activation = activation

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


class ParallelSelfAttention(torch.nn.Module):
    """Multi-head self-attention with the heads split across tp: a
    column-parallel QKV projection (hidden -> 3 * hidden) whose output
    features are laid out per head as [head][q, k, v][head_dim] (so a
    contiguous shard holds whole heads), scaled dot-product attention on
    this rank's heads, and a row-parallel output projection. Input and
    output [seq, batch, hidden] ([seq / tp, ...] under sequence
    parallelism)."""

    def __init__(self, hidden_size, num_heads, *, group, bias=True, sequence_parallel=False,
                 causal=True, dtype=None, device=None):
        super().__init__()
        group = nn.tp_group(group)
        n = C.size_of(group)
        if hidden_size % num_heads:
            raise InvalidArgument(f"ParallelSelfAttention: hidden_size {hidden_size} is not "
                                  f"divisible by num_heads {num_heads}")
        if num_heads % n:
            raise InvalidArgument(f"ParallelSelfAttention: num_heads {num_heads} is not "
                                  f"divisible by the tensor-parallel size {n}")
        self.num_heads, self.local_heads = num_heads, num_heads // n
        self.head_dim = hidden_size // num_heads
        self.causal = causal
        self.qkv = nn.ColumnParallelLinear(hidden_size, 3 * hidden_size, group=group, bias=bias,
                                           sequence_parallel=sequence_parallel, dtype=dtype,
                                           device=device)
        self.proj = nn.RowParallelLinear(hidden_size, hidden_size, group=group, bias=bias,
                                         input_is_parallel=True,
                                         sequence_parallel=sequence_parallel, dtype=dtype,
                                         device=device)

    def forward(self, x):
        qkv = self.qkv(x)  # [seq, batch, local_heads * 3 * head_dim]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.local_heads, 3, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))  # [batch, heads, seq, dim]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        a = a.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.proj(a)


class ParallelTransformerBlock(torch.nn.Module):
    """A pre-norm GPT block: ``x + attn(ln1(x))``, then ``h + mlp(ln2(h))``."""

    def __init__(self, hidden_size, num_heads, ffn_hidden_size=None, *, group,
                 sequence_parallel=False, dtype=None, device=None):
        super().__init__()
        self.group = nn.tp_group(group)
        self.sequence_parallel = sequence_parallel
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        kw = dict(group=self.group, sequence_parallel=sequence_parallel, dtype=dtype,
                  device=device)
        self.ln1 = torch.nn.LayerNorm(hidden_size, dtype=dtype, device=device)
        self.attn = ParallelSelfAttention(hidden_size, num_heads, **kw)
        self.ln2 = torch.nn.LayerNorm(hidden_size, dtype=dtype, device=device)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, **kw)

    def forward(self, x):
        h = x + self.attn(_layer_norm(self.ln1, x, self.group, self.sequence_parallel))
        return h + self.mlp(_layer_norm(self.ln2, h, self.group, self.sequence_parallel))


class ParallelGPT(torch.nn.Module):
    """A small GPT: vocab-parallel token embedding + learned positions,
    ``num_layers`` blocks, a final layer norm and a column-parallel output
    layer to the vocabulary, trained with vocab_parallel_cross_entropy.
    ``forward(ids)`` takes ids [seq, batch] and returns this rank's logits
    [seq, batch, vocab / tp]; ``loss(ids, targets)`` the mean token loss
    (the same on every rank of the tp group)."""

    def __init__(self, vocab_size, hidden_size, num_heads, num_layers, max_seq_len, *, group,
                 sequence_parallel=False, ffn_hidden_size=None, dtype=None, device=None):
        super().__init__()
        self.group = nn.tp_group(group)
        self.sequence_parallel = sequence_parallel
        self.embed = nn.VocabParallelEmbedding(vocab_size, hidden_size, group=self.group,
                                               sequence_parallel=sequence_parallel, dtype=dtype,
                                               device=device)
        self.pos = torch.nn.Embedding(max_seq_len, hidden_size, dtype=dtype, device=device)
        self.blocks = torch.nn.ModuleList(
            ParallelTransformerBlock(hidden_size, num_heads, ffn_hidden_size, group=self.group,
                                     sequence_parallel=sequence_parallel, dtype=dtype,
                                     device=device) for _ in range(num_layers))
        self.ln_f = torch.nn.LayerNorm(hidden_size, dtype=dtype, device=device)
        self.head = nn.ColumnParallelLinear(hidden_size, vocab_size, group=self.group, bias=False,
                                            sequence_parallel=sequence_parallel, dtype=dtype,
                                            device=device)

    def forward(self, ids):
        seq = ids.shape[0]
        x = self.embed(ids)  # [seq (/ tp), batch, hidden]
        pos_weight = self.pos.weight
        positions = torch.arange(seq, device=ids.device)
        if self.sequence_parallel and C.size_of(self.group) > 1:
            positions = C.split_rows(positions, self.group)
            pos_weight = C.CopyToTP.apply(pos_weight, self.group)
        x = x + F.embedding(positions, pos_weight).unsqueeze(1)
        for block in self.blocks:
            x = block(x)
        x = _layer_norm(self.ln_f, x, self.group, self.sequence_parallel)
        return self.head(x)

    def loss(self, ids, targets, ignore_index=-100):
        logits = self(ids)
        per_token = nn.vocab_parallel_cross_entropy(logits, targets, group=self.group,
                                                       ignore_index=ignore_index)
        valid = (targets != ignore_index).sum().clamp(min=1)
        return per_token.sum() / valid
