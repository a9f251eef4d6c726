"""Checkpoints in the strata demo.

During training (examples/demo/train_gpt.py calls ``after_step``), the
model, its AdamW state, the LR schedule and the step are saved
asynchronously every ``STRATA_DEMO_CKPT_EVERY`` steps (and at the last
one): ``save()`` returns once the tensors are staged, and the demo prints
how long training was blocked. At the last step it also records the loss on
a fixed batch.

After training, ``reload_and_compare`` builds a world with another split of
the same ranks (dp2 x tp4 instead of dp2 x tp2 x pp2), loads the last
checkpoint into a freshly built model and AdamW (strata reshards every
tensor-parallel weight and Adam state, and each pipeline stage's states,
keyed by parameter name, go to their layers), and shows that the loss on the
same batch and the sum of Adam's exp_avg_sq over the model match.

Parameter names are those of the full model (``blocks.<layer index>...``),
so a checkpoint does not depend on how the model is split.
"""

import os
import shutil
import tempfile
import time

import torch

import strata
import strata.checkpoint as ckpt
import strata.nn as snn

import train_gpt

EVERY = int(os.environ.get("STRATA_DEMO_CKPT_EVERY", "100"))
TOLERANCE = 1e-4  # relative: tp changes the order of float reductions


def _shared_tempdir(world):
    """A directory made by rank 0 (or $STRATA_DEMO_CKPT_DIR), known to all."""
    name = os.environ.get("STRATA_DEMO_CKPT_DIR", "")
    if not name and world.rank == 0:
        name = tempfile.mkdtemp(prefix="strata-demo-ckpt-")
    buf = torch.zeros(512, dtype=torch.uint8)
    if world.rank == 0:
        raw = list(name.encode())
        buf[:len(raw)] = torch.tensor(raw, dtype=torch.uint8)
    world.group("world").broadcast(buf, src=0)
    return bytes(buf[buf != 0].tolist()).decode()


def _split_name(world):
    name = f"dp{world.group('dp').size} x tp{world.group('tp').size}"
    pp = world.group("pp").size
    return name + (f" x pp{pp}" if pp > 1 else "")


def fixed_batch_loss(model, seq, loss_fn=None, batch_size=8):
    """The loss on one fixed batch (the same on every rank); collective over
    tp (and pp through `loss_fn`, for a pipelined model)."""
    ids, targets = train_gpt.batch(train_gpt.corpus(), 0, 0, seq, batch_size)
    if loss_fn is not None:
        return loss_fn(ids, targets)
    model.eval()
    with torch.no_grad():
        loss = model.loss(ids, targets).item()
    model.train()
    return loss


def adam_fingerprint(world, model, opt):
    """The sum of Adam's exp_avg_sq over the whole model, each element of the
    global tensors counted once (a tensor-parallel shard on every tp rank, a
    replicated tensor on tp rank 0; dp rank 0 only), so it is the same under
    any split; collective over the world."""
    tp, dp = world.group("tp"), world.group("dp")
    total = torch.zeros(1, dtype=torch.float64)
    if dp.rank == 0:
        for p in model.parameters():
            st = opt.state.get(p)
            if st and (getattr(p, "tensor_parallel_sharding", None) is not None or tp.rank == 0):
                total += st["exp_avg_sq"].double().sum()
    world.group("world").all_reduce(total)
    return total.item()


class DemoCheckpoints:
    """Owns the demo's AsyncCheckpointer (collective: every rank makes one)."""

    def __init__(self, world, every=EVERY):
        self.world = world
        self.every = every
        self.directory = _shared_tempdir(world)
        self.owned = not os.environ.get("STRATA_DEMO_CKPT_DIR")
        self.saver = ckpt.AsyncCheckpointer(self.directory, world=world, keep_last=2)
        self.blocked = []  # seconds each save() blocked training
        self.last_step_saved = None
        # (split, tp, loss on the fixed batch, Adam fingerprint) at the last step
        self.reference = None

    def after_step(self, step, total, model, opt, sched, config, fixed_loss=None):
        """Saves every `every` steps and at the last one (called by train_gpt).
        `fixed_loss(ids, targets)` computes the model's loss on a batch (for a
        pipelined model, through its stages)."""
        if step % self.every != 0 and step != total:
            return
        if step == total:
            split = _split_name(self.world)
            self.reference = (split, self.world.group("tp").size,
                              fixed_batch_loss(model, config["seq"], fixed_loss),
                              adam_fingerprint(self.world, model, opt))
        # The optimizer's states are keyed by parameter name (the model's
        # parameters are named as in the whole model), so each stage's
        # states load under any other split (docs/checkpoint.md).
        state = {"model": model, "optimizer": opt, "sched": sched, "step": step,
                 "config": config}
        before = self.saver.status()  # the previous save, finished in the background
        start = time.perf_counter()
        self.saver.save(state, step=step, optimizer_step=step)
        blocked = time.perf_counter() - start
        self.blocked.append(blocked)
        if self.world.rank == 0:
            prev = ""
            if self.last_step_saved is not None:
                prev = (f"; the previous save (step {self.last_step_saved}) was written and "
                        f"committed in the background in "
                        f"{(before['write_seconds'] + before['commit_seconds']) * 1e3:.0f} ms")
            first = " (the first save allocates the staging buffers)" if len(self.blocked) == 1 \
                else ""
            print(f"  checkpoint of step {step} saved asynchronously: training blocked "
                  f"{blocked * 1e3:.1f} ms{first}{prev}", flush=True)
        self.last_step_saved = step

    def close(self):
        """Waits for the last save to commit and prints a summary."""
        self.saver.close()
        if self.world.rank == 0 and self.blocked:
            st = self.saver.status()
            print(f"\n{len(self.blocked)} checkpoints saved to {self.directory}: training blocked "
                  f"{sum(self.blocked) / len(self.blocked) * 1e3:.1f} ms per save on average "
                  f"(max {max(self.blocked) * 1e3:.1f} ms); {st['bytes_written'] / 1e6:.1f} MB "
                  f"written by rank 0 per save; latest = step {ckpt.latest_step(self.directory)}",
                  flush=True)


def reload_and_compare(env, checkpoints, timeout=300):
    """Loads the last checkpoint under another tp/dp split of the same ranks
    and compares the loss on the fixed batch; returns True when it matches."""
    saved_split, saved_tp, want, want_adam = checkpoints.reference
    tp = 2 if saved_tp != 2 and env.world_size % 2 == 0 else (4 if env.world_size % 4 == 0 else 1)
    mesh = strata.Mesh(env.world_size, tp=tp, ranks_per_node=env.local_world_size)
    with strata.init(mesh, timeout=timeout) as world:
        meta = ckpt.load(checkpoints.directory, {"config": None, "step": None}, world=world,
                         strict=False)
        c = meta["config"]
        torch.manual_seed(4321)  # other initial weights: the load must replace them all
        model = snn.ParallelGPT(256, c["hidden"], c["heads"], c["layers"], c["seq"],
                                group=world.group("tp"), sequence_parallel=True)
        opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=c["lr"], total_steps=c["steps"],
                                                    pct_start=0.1)
        state = {"model": model, "optimizer": opt, "sched": sched, "step": 0, "config": None}
        start = time.perf_counter()
        ckpt.load(checkpoints.directory, state, world=world)
        load_s = time.perf_counter() - start
        got = fixed_batch_loss(model, c["seq"])
        got_adam = adam_fingerprint(world, model, opt)
        split = _split_name(world)
        # float64 sums of the same float32 values, in another order
        adam_ok = abs(got_adam - want_adam) <= 1e-9 * abs(want_adam) and want_adam > 0
        ok = abs(got - want) <= TOLERANCE * abs(want) and adam_ok
        if world.rank == 0:
            print(f"\nReloaded checkpoint step {state['step']} (saved as {saved_split}) as {split} "
                  f"in {load_s * 1e3:.0f} ms, checksums verified, weights and AdamW state "
                  "resharded", flush=True)
            print(f"loss on a fixed batch: {want:.6f} trained as {saved_split}, {got:.6f} "
                  f"reloaded as {split} (difference {abs(got - want):.1e}): "
                  f"{'match' if abs(got - want) <= TOLERANCE * abs(want) else 'MISMATCH'}",
                  flush=True)
            print(f"AdamW state, sum of exp_avg_sq over the model: {want_adam:.9e} trained, "
                  f"{got_adam:.9e} reloaded: {'match' if adam_ok else 'MISMATCH'}", flush=True)
        world.group("world").barrier()
        if world.rank == 0 and checkpoints.owned:
            shutil.rmtree(checkpoints.directory, ignore_errors=True)
    return ok
