"""The training job every side of the recovery benchmark runs (run_recovery.py).

One definition of the model, the data, the optimizer and the per-rank events,
imported by the peers' workers (torchrun_worker.py, torchft_worker.py). It is
the model of strata's example (examples/elastic/train.py) with tp = 1, at the
size given here, so that strata's side trains the same thing when launched
with ``--tp 1 --dp 8 --hidden HIDDEN --layers LAYERS --batch GLOBAL_BATCH``:

- Model: LAYERS residual blocks ``x + W2 gelu(W1 x)`` (W1: HIDDEN -> 4 HIDDEN,
  W2: 4 HIDDEN -> HIDDEN, with biases) and a Linear(HIDDEN, HIDDEN) head, fp32,
  initialised from torch.manual_seed(MODEL_SEED).
- Data: a fixed synthetic regression set, SAMPLES inputs x ~ N(0, 1) of width
  HIDDEN and targets tanh(x W / sqrt(HIDDEN)) (generator seed DATA_SEED).
- Global step n (1-based) takes samples (n-1)*GLOBAL_BATCH .. n*GLOBAL_BATCH-1
  (mod SAMPLES); data-parallel replica r of the original 8 takes its
  contiguous GLOBAL_BATCH / 8 of them.
- Loss: mean squared error over a replica's samples; gradients averaged over
  the replicas (with equal shares, the mean over the global batch).
- SGD, momentum 0.9, lr LR x min(1, n / WARMUP) at step n (the example's
  LambdaLR warm-up), set from the step number so a restart needs no scheduler
  state.

No torch import at module level: the workers time ``import torch`` themselves.
"""

import json
import os
import sys
import time

WORLD = int(os.environ.get("STRATA_BENCH_WORLD", "8"))  # run_goodput.py runs 6
HIDDEN = 512
LAYERS = 6
GLOBAL_BATCH = 48
SAMPLES = 4096
LR = 0.05
MOMENTUM = 0.9
WARMUP = 10
MODEL_SEED = 1234
DATA_SEED = 7


def job_spec():
    """The job as a dict (recorded in the results, and the placeholders of
    strata's command template)."""
    return {"world": WORLD, "hidden": HIDDEN, "layers": LAYERS, "batch": GLOBAL_BATCH,
            "samples": SAMPLES, "lr": LR, "strata_lr": strata_lr(), "momentum": MOMENTUM,
            "warmup": WARMUP,
            "parameters": parameter_count_formula()}


def strata_lr():
    """The --lr of strata's example that trains the same updates: its loss is
    the sum of squared errors over a replica's samples and HIDDEN outputs
    divided by the global batch, summed over the replicas, i.e. HIDDEN times
    the peers' mean over every element; SGD with momentum (no weight decay)
    is linear in the gradient, so LR / HIDDEN gives the same steps."""
    return LR / HIDDEN


def parameter_count_formula():
    block = HIDDEN * 4 * HIDDEN + 4 * HIDDEN + 4 * HIDDEN * HIDDEN + HIDDEN
    return LAYERS * block + HIDDEN * HIDDEN + HIDDEN


def process_start_time():
    """Wall-clock time this process was created (exec), from /proc, to ~10 ms."""
    with open("/proc/self/stat") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces; the fields after it do not.
    fields = stat[stat.rindex(")") + 2:].split()
    start_ticks = int(fields[19])  # field 22 of proc(5): starttime
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class Events:
    """JSON lines, one file per rank (and on stdout when `echo`), flushed at
    once so the driver sees them as they happen and nothing is lost on SIGKILL."""

    def __init__(self, directory, rank, echo):
        os.makedirs(directory, exist_ok=True)
        self._file = open(os.path.join(directory, f"events.{rank}.jsonl"), "a", buffering=1)
        self._rank = rank
        self._echo = echo

    def emit(self, event, **fields):
        record = {"event": event, "rank": self._rank, "pid": os.getpid(), **fields}
        if "time" not in record:
            record["time"] = time.time()
        line = json.dumps(record)
        self._file.write(line + "\n")
        if self._echo:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def write_pid(pid_dir, rank):
    if pid_dir:
        os.makedirs(pid_dir, exist_ok=True)
        tmp = os.path.join(pid_dir, f".{rank}.pid.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(pid_dir, f"{rank}.pid"))


def build_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
            self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(MODEL_SEED)
    return Model()


def build_optimizer(model):
    import torch
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def set_lr(optimizer, step):
    for group in optimizer.param_groups:
        group["lr"] = LR * min(1.0, step / WARMUP)


def loss_fn(model, x, y):
    import torch
    return torch.nn.functional.mse_loss(model(x), y)


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def dataset():
    """(inputs, targets), the same in every process."""
    import torch
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(SAMPLES, HIDDEN, generator=g)
    w = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    return x, torch.tanh(x @ w)


def replica_batch(data, step, replica):
    """(inputs, targets) of global step `step` (1-based) for original replica `replica`."""
    import torch
    per = GLOBAL_BATCH // WORLD
    first = (step - 1) * GLOBAL_BATCH + replica * per
    rows = torch.arange(first, first + per) % SAMPLES
    x, y = data
    return x[rows], y[rows]


def set_threads():
    """One intra-op thread per rank: 8 ranks share 2 cores."""
    import torch
    torch.set_num_threads(1)
