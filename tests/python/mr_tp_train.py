"""A 2-layer GPT trained 30 steps with tp = 4 (sequence parallelism on)
follows the loss curve of the same model trained with tp = 1, both trained
in this test from the same seed on the same data.

    mpirun -np 4 python -m pytest tests/python/mr_tp_train.py
"""

import pytest
import torch

import strata
import strata.nn as snn

torch.set_num_threads(1)
ENV = strata.launch_env()
VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 32, 4, 2, 16, 4, 30


def batches():
    """Sequences from a fixed random bigram rule, so there is something to learn."""
    g = torch.Generator().manual_seed(1)
    rule = torch.randint(0, VOCAB, (VOCAB,), generator=g)
    for _ in range(STEPS):
        first = torch.randint(0, VOCAB, (1, BATCH), generator=g)
        ids = [first]
        for _ in range(SEQ):
            ids.append(rule[ids[-1]])
        seq = torch.cat(ids)  # [SEQ + 1, BATCH]
        yield seq[:-1], seq[1:]


def train(group, sequence_parallel):
    torch.manual_seed(0)
    model = snn.ParallelGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ, group=group,
                            sequence_parallel=sequence_parallel)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for ids, targets in batches():
        loss = model.loss(ids, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.skipif(ENV.world_size != 4, reason="needs 4 ranks (tp = 4)")
def test_tp4_follows_tp1_loss_curve():
    with strata.init(strata.Mesh(4, tp=4)) as world:
        tp4 = train(world, sequence_parallel=True)
    tp1 = train(None, sequence_parallel=False)
    worst = max(abs(a - b) / abs(b) for a, b in zip(tp4, tp1))
    if ENV.rank == 0:
        print(f"\nloss {tp1[0]:.4f} -> {tp1[-1]:.4f}; largest per-step relative difference "
              f"tp=4 vs tp=1: {worst:.2e}")
    for step, (a, b) in enumerate(zip(tp4, tp1)):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-5, (
            f"step {step}: tp=4 loss {a:.7f} vs tp=1 loss {b:.7f}\ntp4 {tp4}\ntp1 {tp1}")
    assert tp1[-1] < 0.7 * tp1[0], f"the loss did not fall: {tp1}"
