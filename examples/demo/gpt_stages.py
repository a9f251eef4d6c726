"""The demo's GPT cut into pipeline stages (tensor-parallel inside each).

Every rank builds the whole strata.nn.ParallelGPT from the same seed (so
the model starts exactly as the unpipelined one), then keeps only what its
pipeline stage runs: stage 0 the embeddings and the first blocks, the last
stage the last blocks, the final layer norm and the output layer.

Parameter names stay those of the whole model (``blocks.3.attn.qkv.weight``
is block 3 of the full model on whichever stage holds it), so a checkpoint
of a pipelined model names each tensor once, whatever the pp size.

Between stages flows the hidden state [seq (/ tp), batch, hidden]. The
schedule splits the inputs into microbatches along dim 0, so the stages
take ids and targets batch-first ([batch, seq]) and turn them sequence-first
inside.
"""

import torch
import torch.nn.functional as F

import strata.nn as snn
from strata import _tp_comm as C
from strata._tp_models import _layer_norm


def stage_layers(num_layers, num_stages, stage):
    """The global indices of the blocks on `stage` (contiguous, as even as
    possible, the earlier stages taking the remainder)."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (stage < extra)))


class GPTStage(torch.nn.Module):
    """Stage `stage` of `num_stages` of `model` (a ParallelGPT), keeping its
    modules under their names in the whole model."""

    def __init__(self, model, stage, num_stages):
        super().__init__()
        self.group, self.sequence_parallel = model.group, model.sequence_parallel
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.layers = stage_layers(len(model.blocks), num_stages, stage)
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        self.blocks = torch.nn.ModuleDict({str(i): model.blocks[i] for i in self.layers})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        if self.first:  # ids [batch, seq] -> hidden [seq (/ tp), batch, hidden]
            ids = x.t()
            x = self.embed(ids)
            positions = torch.arange(ids.shape[0])
            pos_weight = self.pos.weight
            if self.sequence_parallel and C.size_of(self.group) > 1:
                positions = C.split_rows(positions, self.group)
                pos_weight = C.CopyToTP.apply(pos_weight, self.group)
            x = x + F.embedding(positions, pos_weight).unsqueeze(1)
        for i in self.layers:
            x = self.blocks[str(i)](x)
        if self.last:  # logits [seq, batch, vocab / tp]
            x = _layer_norm(self.ln_f, x, self.group, self.sequence_parallel)
            x = self.head(x)
        return x

    def loss(self, logits, targets):
        """Mean token loss of one microbatch; targets [batch, seq]."""
        per_token = snn.vocab_parallel_cross_entropy(logits, targets.t(), group=self.group)
        return per_token.mean()
