"""The training part of the strata demo: a small character-level GPT,
pipelined over pp (1F1B), tensor-parallel over tp and data-parallel over
dp, trained on strata's own documentation (bundled text: README.md and
docs/*.md).

Every rank builds the same model from the same seed (strata.nn keeps only
its tp shards; gpt_stages keeps only its pipeline stage) and reads the same
text; the dp replicas take different batches, each cut into microbatches
that strata.pipeline.Schedule1F1B runs over the pp group, and their
gradients are averaged over the dp group by strata.nn.DataParallel (once
per step, bucket by bucket during the last microbatch's backward). With
STRATA_DEMO_ZERO=1 the optimizer is ZeRO-1's
strata.optim.DistributedOptimizer (AdamW's state sharded over dp); the
checkpoint round trip, which reloads into a plain AdamW under another tp,
is then skipped.
Rank 0 prints the schedule's grid once, then a progress bar with the step,
the loss, the tokens per second and the time per step, and at the end the
pipeline bubble measured from every rank's busy time next to the
theoretical one.
"""

import contextlib
import glob
import os
import sys
import time

import torch

import strata
import strata.nn as snn
from strata import pipeline

from gpt_stages import GPTStage

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
          microbatches=4, checkpoints=None, zero=None, observe=None):
    if zero is None:
        zero = os.environ.get("STRATA_DEMO_ZERO", "0") == "1"
    tp, dp, pp = world.group("tp"), world.group("dp"), world.group("pp")
    text = corpus()
    torch.manual_seed(1234)
    full = snn.ParallelGPT(256, hidden, heads, layers, seq, group=tp, sequence_parallel=True)
    model = GPTStage(full, pp.rank, pp.size)
    del full
    data_parallel = snn.DataParallel(model, world)  # over dp, once per schedule step
    stage = pipeline.PipelineStage(data_parallel, pp.rank, world, num_stages=pp.size)
    schedule = pipeline.Schedule1F1B(stage, microbatches, model.loss)
    params = [p for p in model.parameters()]
    if zero:
        opt = strata.optim.DistributedOptimizer(torch.optim.AdamW, params, world, lr=lr,
                                                weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    n_params = torch.tensor([sum(p.numel() for p in params)])
    pp.all_reduce(n_params)
    tokens_per_step = seq * batch_size * dp.size
    if observe is not None:  # examples/demo/demo_observe.py: metrics, MFU, timeline
        observe.start(model, seq, seq * batch_size)
    if world.rank == 0:
        print(f"\nTraining a {layers}-layer GPT ({hidden} hidden, {heads} heads, "
              f"{int(n_params):,} parameters on each tp rank) on {len(text):,} bytes of "
              "strata's docs", flush=True)
        print(f"dp {dp.size} x tp {tp.size} x pp {pp.size} on {world.size} ranks, sequence "
              f"parallelism on, {schedule.schedule.name} over {microbatches} microbatches, "
              f"{tokens_per_step} tokens per step, {steps} steps (loss: mean since the "
              "previous line; ms/step: mean since the start)\n", flush=True)
        print(f"{schedule.schedule.name} on {pp.size} pipeline ranks (columns: unit time "
              "steps; 0F1 = stage 0's forward of microbatch 1, 0B1 its backward):", flush=True)
        print(schedule.schedule.grid(), flush=True)
        which = ("ZeRO-1: strata.optim.DistributedOptimizer(AdamW), its state sharded over dp"
                 if zero else "AdamW, its state replicated over dp")
        print(f"gradients averaged over dp by strata.nn.DataParallel; optimizer {which}",
              flush=True)
    first = None
    window = []  # losses since the last line printed
    busy = elapsed = 0.0  # this rank's time in the stage's compute, and in steps
    start = last = time.perf_counter()
    for step in range(1, steps + 1):
        with observe.step(step) if observe is not None else contextlib.nullcontext():
            ids, targets = batch(text, step, dp.rank, seq, batch_size)
            opt.zero_grad(set_to_none=False)
            losses = schedule.step(ids.t(), targets.t())  # batch-first: split by rows
            busy += schedule.stats.busy_seconds
            elapsed += schedule.stats.step_seconds
            opt.step()  # the schedule's step averaged the gradients over dp
            sched.step()
            if checkpoints is not None and not zero:  # examples/demo/demo_checkpoint.py
                checkpoints.after_step(
                    step, steps, model, opt, sched,
                    dict(seq=seq, hidden=hidden, heads=heads, layers=layers, lr=lr, steps=steps,
                         pp=pp.size),
                    fixed_loss=lambda ids, targets: stage_loss(model, pp, ids, targets))
        # The last stage holds the losses: sum over pp (the others add 0).
        shown = torch.tensor([sum(l.item() for l in losses) / len(losses) if losses else 0.0])
        pp.all_reduce(shown)
        dp.all_reduce(shown, op="avg")
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
    bubble = measured_bubble(world, busy, elapsed)
    # ZeRO-1's optimizer state on the fullest rank, and AdamW's replicated one.
    memory = torch.tensor([opt.state_bytes() if zero else 0,
                           2.0 * sum(p.numel() * p.element_size() for p in params)],
                          dtype=torch.float64)
    world.group().all_reduce(memory, op="max")
    continuation = sample(model, tp, pp, seq)  # collective over tp and pp
    if world.rank == 0:
        total = last - start
        theory = pipeline.bubble_fraction("1f1b", num_ranks=pp.size,
                                          num_microbatches=microbatches)
        print(f"\nloss {first:.3f} -> {shown.item():.3f} in {steps} steps, {total:.0f} s "
              f"({tokens_per_step * steps / total:.0f} tokens/s)", flush=True)
        if zero:
            held, full = memory.tolist()
            print(f"ZeRO-1: AdamW state of {held / 1e6:.2f} MB per rank at most, against "
                  f"{full / 1e6:.2f} MB replicated ({held / full:.2f}x at dp {dp.size}); the "
                  "checkpoint round trip reloads into a plain AdamW and is skipped", flush=True)
        print(f"pipeline bubble measured {bubble:.3f} (1 - busy / step time, mean over ranks); "
              f"theory (p-1)/(m+p-1) = {theory:.3f} for p={pp.size}, m={microbatches}. "
              f"{world.size} ranks share {os.cpu_count()} cores here, so ranks also wait for "
              "a core.", flush=True)
        equal = dict(forward=1.0, backward_input=1.0, backward_weight=1.0)
        zb = pipeline.generate("zb-h1", num_ranks=pp.size, num_microbatches=microbatches,
                               **equal).simulate(**equal)
        print(f"ZB-H1 (pipeline.ScheduleZeroBubble: the backward split into input and weight "
              f"gradients, the weight gradients filling the bubble) for the same p and m: "
              f"{zb.mean_bubble_fraction:.3f} in simulation with F = I = W, against 1F1B's "
              f"{theory:.3f}", flush=True)
        print(f"the model continues 'strata ' with: {continuation!r}", flush=True)
    sys.stdout.flush()
    return first, shown.item(), schedule


def measured_bubble(world, busy, elapsed):
    """1 - busy / makespan, mean over ranks (the makespan: the slowest rank's
    total step time)."""
    b = torch.tensor([busy], dtype=torch.float64)
    e = torch.tensor([elapsed], dtype=torch.float64)
    world.group().all_reduce(b, op="avg")
    world.group().all_reduce(e, op="max")
    return 1.0 - b.item() / e.item()


def forward_stages(model, pp, x):
    """The stages' forward in turn, one batch, no pipelining: the hidden state
    moves from stage to stage by all-reduces over pp. Returns the last
    stage's output there (something else elsewhere)."""
    h = None
    for s in range(pp.size):
        if s == pp.rank:
            h = model(x if s == 0 else h).contiguous()
        if s < pp.size - 1:  # pass the hidden state on to stage s + 1
            shape = torch.tensor(list(h.shape) if s == pp.rank else [0, 0, 0])
            pp.all_reduce(shape)
            moved = h.clone() if s == pp.rank else torch.zeros(shape.tolist())
            pp.all_reduce(moved)
            h = moved if pp.rank == s + 1 else h
    return h


def stage_loss(model, pp, ids, targets):
    """The loss of the pipelined model on one batch ([seq, batch] ids and
    targets), the same on every rank; collective over tp and pp."""
    model.eval()
    with torch.no_grad():
        h = forward_stages(model, pp, ids.t())
        loss = torch.tensor([model.loss(h, targets.t()).item() if model.last else 0.0],
                            dtype=torch.float64)
    model.train()
    pp.all_reduce(loss)
    return loss.item()


def sample(model, tp, pp, seq, length=120, temperature=0.8):
    """A continuation of a prompt, sampled at ``temperature`` from a fixed
    seed; collective over tp and pp: the hidden state moves from stage to
    stage and the drawn byte back to every stage by all-reduces over pp
    (one sequence, so no pipelining). Every tp rank draws the same bytes,
    since the all-gathered logits are the same everywhere."""
    prompt = b"strata "
    ids = list(prompt)
    gen = torch.Generator().manual_seed(0)
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            window = ids[-seq:]
            # Sequence parallelism needs a full window: pad on the right,
            # which causal attention keeps from affecting the last real byte.
            x = torch.tensor(window + [0] * (seq - len(window))).view(1, -1)  # [batch, seq]
            h = forward_stages(model, pp, x)
            drawn = torch.zeros(1, dtype=torch.int64)
            if pp.rank == pp.size - 1:
                logits = h[len(window) - 1, 0]  # this rank's vocabulary shard
                full = torch.empty(logits.numel() * tp.size)
                tp.all_gather(full, logits.contiguous())
                probs = torch.softmax(full / temperature, dim=0)
                drawn[0] = int(torch.multinomial(probs, 1, generator=gen))
            pp.all_reduce(drawn)
            ids.append(int(drawn))
    model.train()
    return bytes(ids[len(prompt):]).decode("utf-8", errors="replace")
