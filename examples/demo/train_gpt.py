"""The training part of the strata demo: a small character-level GPT,
tensor-parallel over tp and data-parallel over dp, trained on strata's own
documentation (bundled text: README.md and docs/*.md).

Every rank builds the same model from the same seed (strata.nn keeps only
its shards) and reads the same text; the dp replicas take different
batches, and their gradients are averaged with one all-reduce over the dp
group per step. Rank 0 prints a progress bar with the step, the loss, the
tokens per second and the time per step.
"""

import glob
import os
import sys
import time

import torch

import strata.nn as snn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def corpus():
    """The bytes of README.md and docs/*.md, as a uint8 tensor."""
    paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    data = b"\n\n".join(open(p, "rb").read() for p in paths if os.path.exists(p))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(text, step, dp_rank, seq, batch_size):
    """[seq, batch] inputs and next-byte targets; each dp rank its own rows."""
    g = torch.Generator().manual_seed(step * 1000 + dp_rank)
    starts = torch.randint(0, len(text) - seq - 1, (batch_size,), generator=g)
    rows = torch.stack([text[s:s + seq + 1] for s in starts.tolist()], dim=1)
    return rows[:-1], rows[1:]


def bar(fraction, width=24):
    filled = int(round(fraction * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def train(world, steps=300, seq=64, batch_size=8, hidden=128, heads=4, layers=2, lr=3e-3,
          checkpoints=None):
    tp, dp = world.group("tp"), world.group("dp")
    text = corpus()
    torch.manual_seed(1234)
    model = snn.ParallelGPT(256, hidden, heads, layers, seq, group=tp, sequence_parallel=True)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    n_params = sum(p.numel() for p in params)
    tokens_per_step = seq * batch_size * dp.size
    if world.rank == 0:
        print(f"\nTraining a {layers}-layer GPT ({hidden} hidden, {heads} heads, "
              f"{n_params:,} parameters on each rank) on {len(text):,} bytes of strata's docs", flush=True)
        print(f"dp {dp.size} x tp {tp.size} on {world.size} ranks, sequence parallelism on, "
              f"{tokens_per_step} tokens per step, {steps} steps (loss: mean since the previous "
              "line; ms/step: mean since the start)\n", flush=True)
    flat = torch.zeros(sum(p.numel() for p in params))
    first = None
    window = []  # losses since the last line printed
    start = last = time.perf_counter()
    for step in range(1, steps + 1):
        ids, targets = batch(text, step, dp.rank, seq, batch_size)
        loss = model.loss(ids, targets)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        # One all-reduce for every gradient (dp average), and one for the loss.
        offset = 0
        for p in params:
            flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        dp.allreduce(flat, op="avg")
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        opt.step()
        sched.step()
        if checkpoints is not None:  # examples/demo/demo_checkpoint.py
            checkpoints.after_step(step, steps, model, opt, sched,
                                   dict(seq=seq, hidden=hidden, heads=heads, layers=layers, lr=lr,
                                        steps=steps))
        shown = torch.tensor([loss.item()])
        dp.allreduce(shown, op="avg")
        now = time.perf_counter()
        first = first if first is not None else shown.item()
        window.append(shown.item())
        if world.rank == 0 and (step % 25 == 0 or step == 1 or step == steps):
            per_step = (now - start) / step
            mean = sum(window) / len(window)
            print(f"{bar(step / steps)} step {step:4d}/{steps}  loss {mean:.3f}  "
                  f"{tokens_per_step / per_step:7.0f} tokens/s  {per_step * 1e3:6.1f} ms/step",
                  flush=True)
        if step % 25 == 0 or step == 1:
            window = []
        last = now
    continuation = sample(model, tp, seq)  # collective over tp
    if world.rank == 0:
        total = last - start
        print(f"\nloss {first:.3f} -> {shown.item():.3f} in {steps} steps, {total:.0f} s "
              f"({tokens_per_step * steps / total:.0f} tokens/s)", flush=True)
        print(f"the model continues 'strata ' with: {continuation!r}", flush=True)
    sys.stdout.flush()
    return first, shown.item()


def sample(model, tp, seq, length=120, temperature=0.8):
    """A continuation of a prompt, sampled at ``temperature`` from a fixed
    seed; collective over the tp group (every rank draws the same bytes,
    since the all-gathered logits are the same everywhere)."""
    prompt = b"strata "
    ids = list(prompt)
    gen = torch.Generator().manual_seed(0)
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            window = ids[-seq:]
            # Sequence parallelism needs a full window: pad on the right,
            # which causal attention keeps from affecting the last real byte.
            x = torch.tensor(window + [0] * (seq - len(window))).view(-1, 1)
            logits = model(x)[len(window) - 1, 0]  # this rank's vocabulary shard
            full = torch.empty(logits.numel() * tp.size)
            tp.allgather(full, logits.contiguous())
            probs = torch.softmax(full / temperature, dim=0)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    model.train()
    return bytes(ids[len(prompt):]).decode("utf-8", errors="replace")
