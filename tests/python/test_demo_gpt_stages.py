"""The demo's GPT cut into pipeline stages (examples/demo/gpt_stages.py), in
one process: the stages together hold exactly the whole model's parameters
under the whole model's names (so checkpoints of a pipelined model name
tensors as the unpipelined one), and running them one after the other gives
the whole model's logits, loss and gradients."""

import os
import sys

import pytest
import torch

import strata.nn as snn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "demo"))
from gpt_stages import GPTStage, stage_layers  # noqa: E402


def model(layers=4):
    torch.manual_seed(7)
    return snn.ParallelGPT(256, 32, 4, layers, 16, group=None)


@pytest.mark.parametrize("layers,stages", [(4, 2), (5, 2), (4, 3), (4, 4)])
def test_stages_hold_the_whole_model_under_its_names(layers, stages):
    full = model(layers)
    parts = [GPTStage(full, s, stages) for s in range(stages)]
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    assert len(names) == len(set(names))
    full_params = dict(full.named_parameters())
    for p in parts:
        for n, t in p.named_parameters():
            assert t is full_params[n], n


def test_stages_in_turn_equal_the_whole_model():
    full = model(4)
    parts = [GPTStage(full, s, 2) for s in range(2)]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 16), generator=g)  # [batch, seq]
    targets = torch.randint(0, 256, (3, 16), generator=g)
    want_loss = full.loss(ids.t(), targets.t())
    want_loss.backward()
    want = {n: t.grad.clone() for n, t in full.named_parameters()}
    full.zero_grad()
    logits = parts[1](parts[0](ids))
    loss = parts[1].loss(logits, targets)
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for n, t in full.named_parameters():
        torch.testing.assert_close(t.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_zero_bubble_split_backward_equals_the_whole_backward():
    # ScheduleZeroBubble on the GPT (embeddings, attention, norms, the output
    # layer) as one stage of a one-rank world: I, then W from the module
    # outputs I kept, give the whole backward's gradients.
    import strata
    from strata import pipeline

    world = strata.init(timeout=60)
    try:
        full, ref = model(4), model(4)
        stage = GPTStage(full, 0, 1)
        schedule = pipeline.ScheduleZeroBubble(pipeline.PipelineStage(stage, 0, world), 3,
                                               stage.loss)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 256, (6, 16), generator=g)  # [batch, seq]
        targets = torch.randint(0, 256, (6, 16), generator=g)
        losses = schedule.step(ids, targets)
        for i, (x, y) in enumerate(zip(torch.tensor_split(ids, 3), torch.tensor_split(targets, 3))):
            loss = ref.loss(x.t(), y.t())
            (loss / 3).backward()
            torch.testing.assert_close(losses[i], loss.detach(), rtol=1e-6, atol=1e-6)
        for (n, a), b in zip(full.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=n)
    finally:
        world.destroy()


def test_fewer_layers_than_stages_is_refused():
    assert stage_layers(5, 2, 0) == [0, 1, 2] and stage_layers(5, 2, 1) == [3, 4]
    with pytest.raises(ValueError, match="2 layers cannot fill 3 pipeline stages"):
        stage_layers(2, 3, 0)
