"""Training a model pipelined over the ranks of a ``pp`` group.

Every rank of the pipeline group builds its stage(s) and a schedule, then
calls ``step`` with the same batch (the first stage reads the inputs, the
last the targets; others may pass None)::

    import torch, strata
    from strata import pipeline

    world = strata.init(strata.Mesh(8, tp=2, pp=2))
    pp = world.group("pp")
    stage = pipeline.PipelineStage(build_stage(pp.rank), pp.rank, world)
    schedule = pipeline.Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    losses = schedule.step(inputs, targets)     # list on the last stage, else None
    ...                                          # dp allreduce, optimizer.step()

``ScheduleGPipe`` has the same arguments; ``ScheduleInterleaved1F1B`` takes
the list of this rank's stages (rank r holds stages r, r + p, r + 2p, ...).
The inputs (a tensor or a tuple of tensors) and the targets are split into
``n_microbatches`` microbatches along dim 0. Parameter gradients accumulate
in ``.grad`` over the microbatches; ``scale_grads=True`` makes them the
mean over microbatches, ``False`` the plain sum (as in
torch.distributed.pipelining).

The schedule is generated and validated by strata (see docs/pipeline.md)
and executed by the C++ runner: it walks this rank's actions with the GIL
released, moves activations and gradients with the group's communicator
(shapes and dtypes may change from one microbatch to the next), and calls
back into Python only to run the stage's forward and backward and to
allocate receive buffers. Tensors cross without copies.

A failure on any rank (an exception in a stage, a peer that does not
answer by the deadline) ends the step on every rank with
:class:`strata.PipelineError` naming the rank, the action, its stage and
its microbatch; the exception raised in the stage is its ``__cause__``.
The pipeline group is unusable afterwards (rebuild the world).
"""

import torch

from ._strata import pipeline as _core
from .errors import InvalidArgument, PipelineError

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"]

_TORCH_DTYPES = {
    "fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16,
    "bf16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def _wire(t, what):
    """A tensor as the runner takes it: (tensor, address, dtype, shape)."""
    name = _NAMES.get(t.dtype)
    if name is None:
        raise InvalidArgument(f"{what} has dtype {t.dtype}, which strata cannot send "
                              f"(supported: {', '.join(map(str, _NAMES))})")
    return (t, t.data_ptr(), name, tuple(t.shape))


class PipelineStage:
    """One stage of a model cut into pipeline stages: ``module`` runs stage
    ``stage_index`` on this rank of ``world``'s pipeline group.

    ``module(*inputs)`` takes the previous stage's outputs (stage 0: the
    microbatch of the inputs) and returns a tensor or a tuple of tensors;
    the last stage's output goes to the schedule's ``loss_fn``.
    ``num_stages`` (optional) is checked against the schedule; ``group``
    names the pipeline axis of the world's mesh (a strata.Group is also
    accepted in place of the world).
    """

    def __init__(self, module, stage_index, world, *, num_stages=None, group="pp"):
        if not callable(module):
            raise InvalidArgument(f"module must be a torch.nn.Module (or callable), got "
                                  f"{type(module).__name__}")
        if isinstance(stage_index, bool) or not isinstance(stage_index, int) or stage_index < 0:
            raise InvalidArgument(f"stage_index must be an int >= 0, got {stage_index!r}")
        if num_stages is not None and not 0 <= stage_index < num_stages:
            raise InvalidArgument(f"stage_index {stage_index} is not a stage of {num_stages}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = world.group(group) if hasattr(world, "group") else world
        if not hasattr(self.group, "_raw"):
            raise InvalidArgument(f"world must be a strata.World or strata.Group, got "
                                  f"{type(world).__name__}")

    def __repr__(self):
        return (f"<strata.pipeline.PipelineStage {self.stage_index} on rank {self.group.rank} "
                f"of group {self.group.name}>")


class _Live:
    """Counts the activations alive (held by the runner) and their peak."""

    def __init__(self):
        self.now = 0
        self.peak = 0


class _Activation:
    """What one (stage, microbatch) keeps from its forward to its backward:
    the outputs with their autograd graph, and the inputs as leaves whose
    .grad the backward reads. The runner holds it, and drops it as soon as
    the backward is done."""

    __slots__ = ("outputs", "leaves", "loss", "_live")

    def __init__(self, outputs, leaves, loss, live):
        self.outputs, self.leaves, self.loss, self._live = outputs, leaves, loss, live
        live.now += 1
        live.peak = max(live.peak, live.now)

    def __del__(self):
        self._live.now -= 1


def _split(value, m, what):
    """``value`` (a tensor or a tuple/list of tensors) cut into m
    microbatches along dim 0: a list of m tuples."""
    tensors = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    columns = []
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{what}[{k}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] < m:
            rows = 0 if t.dim() == 0 else t.shape[0]
            raise InvalidArgument(f"{what}{'' if len(tensors) == 1 else f'[{k}]'} has {rows} "
                                  f"rows along dim 0, fewer than the {m} microbatches")
        columns.append(torch.tensor_split(t, m, dim=0))
    return [tuple(c[i] for c in columns) for i in range(m)]


class _PipelineSchedule:
    _kind = None

    def __init__(self, stages, n_microbatches, loss_fn, *, scale_grads, timeout,
                 microbatch_group_size=None):
        stages = list(stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise InvalidArgument(f"{type(self).__name__} needs PipelineStage objects, got "
                                  f"{[type(s).__name__ for s in stages]}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) \
                or n_microbatches < 1:
            raise InvalidArgument(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        group = stages[0].group
        if any(s.group is not group for s in stages):
            raise InvalidArgument("every stage of a schedule must use the same pipeline group")
        if group.memory != "host":
            raise InvalidArgument(
                f"strata.pipeline runs over the host backends (mpi, gloo); pipeline group "
                f"'{group.name}' uses {group.backend} ({group.memory} memory). On GPUs, the C++ "
                "PipelineRunner runs over nccl with declared shapes (docs/pipeline.md)")
        p, r, v = group.size, group.rank, len(stages)
        kwargs = {}
        if microbatch_group_size is not None:
            kwargs["microbatch_group_size"] = microbatch_group_size
        self.schedule = _core.generate(self._kind, num_ranks=p, num_microbatches=n_microbatches,
                                       virtual_stages=v, **kwargs)
        self.num_stages = self.schedule.num_stages
        want = [r + k * p for k in range(v)]
        got = sorted(s.stage_index for s in stages)
        if got != want:
            raise PipelineError(
                f"under {self.schedule.name}, rank {r} of pipeline group '{group.name}' holds "
                f"stage{'s' if v > 1 else ''} {', '.join(map(str, want))}; it was given "
                f"stage{'s' if v > 1 else ''} {', '.join(map(str, got))}")
        for s in stages:
            if s.num_stages is not None and s.num_stages != self.num_stages:
                raise PipelineError(f"stage {s.stage_index} was built for {s.num_stages} stages "
                                    f"but {self.schedule.name} has {self.num_stages}")
        if not callable(loss_fn):
            raise InvalidArgument(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
        self._stages = {s.stage_index: s for s in stages}
        self._loss_fn = loss_fn
        self._m = n_microbatches
        self._group = group
        self._device = torch.device("cpu")  # the host backends (mpi, gloo)
        self._runner = _core._Runner(self.schedule, group._raw, timeout=float(timeout),
                                     scale_grads=bool(scale_grads))
        self.stats = None
        self.peak_live_activations = 0

    @property
    def n_microbatches(self):
        return self._m

    def step(self, inputs=None, targets=None):
        """One training step over ``n_microbatches`` microbatches of
        ``inputs`` (used on the rank of stage 0) and ``targets`` (on the
        rank of the last stage). Returns the per-microbatch losses (detached
        tensors) on the last stage's rank and None elsewhere. Gradients
        accumulate in the stages' parameters. ``stats`` then holds this
        rank's StepStats (timings, busy time, peak activations)."""
        first = 0 in self._stages
        last = self.num_stages - 1 in self._stages
        if first and inputs is None:
            raise InvalidArgument(f"rank {self._group.rank} holds stage 0: step() needs inputs")
        self._inputs = _split(inputs, self._m, "inputs") if first else None
        self._targets = (_split(targets, self._m, "targets")
                         if last and targets is not None else None)
        self._losses = [None] * self._m
        self._live = _Live()
        try:
            self.stats = self._runner.step(self._forward, self._backward, self._allocate)
        finally:
            self._inputs = self._targets = None
            self.peak_live_activations = self._live.peak
        return list(self._losses) if last else None

    # ---- callbacks of the runner (GIL held, on the caller's thread) --------
    def _forward(self, index, microbatch, inputs):
        stage = self._stages[index]
        if index == 0:
            args, leaves = self._inputs[microbatch], ()
        else:
            leaves = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
            args = leaves
        with torch.enable_grad():
            out = stage.module(*args)
            if index == self.num_stages - 1:
                target = self._targets
                loss = (self._loss_fn(out) if target is None
                        else self._loss_fn(out, *target[microbatch]))
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise InvalidArgument(f"loss_fn must return a tensor of one element, got "
                                          f"{loss!r:.80}")
                detached = loss.detach()
                self._losses[microbatch] = detached
                return (), float(detached), _Activation((), leaves, loss, self._live)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for k, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise InvalidArgument(f"stage {index} returned {type(o).__name__} as output "
                                      f"{k}; stages must return tensors")
            if o.device != self._device:
                raise InvalidArgument(f"stage {index}'s output {k} is on {o.device}; the "
                                      f"{self._group.backend} backend sends {self._device} "
                                      "tensors")
        outs = tuple(o.contiguous() for o in outs)
        sent = [_wire(o.detach(), f"stage {index}'s output {k}") for k, o in enumerate(outs)]
        return sent, None, _Activation(outs, leaves, None, self._live)

    def _backward(self, index, microbatch, output_grads, act, loss_scale):
        if act.loss is not None:
            torch.autograd.backward(act.loss, torch.full_like(act.loss, loss_scale))
        else:
            pairs = [(o, g) for o, g in zip(act.outputs, output_grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = []
        for k, x in enumerate(act.leaves):
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            grads.append(_wire(g.contiguous(), f"the gradient of stage {index}'s input {k}"))
        act.outputs = act.leaves = act.loss = None  # the graph goes now
        return grads

    def _allocate(self, dtype, shape):
        t = torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device=self._device)
        return (t, t.data_ptr(), dtype, tuple(shape))

    def __repr__(self):
        return (f"<strata.pipeline.{type(self).__name__} {self.schedule.name}, stages "
                f"{sorted(self._stages)} on rank {self._group.rank}>")


class ScheduleGPipe(_PipelineSchedule):
    """All forwards, then all backwards: holds n_microbatches activations."""

    _kind = "gpipe"

    def __init__(self, stage, n_microbatches, loss_fn, scale_grads=True, *, timeout=300.0):
        super().__init__([stage], n_microbatches, loss_fn, scale_grads=scale_grads,
                         timeout=timeout)


class Schedule1F1B(_PipelineSchedule):
    """One forward, one backward: holds at most p - rank activations."""

    _kind = "1f1b"

    def __init__(self, stage, n_microbatches, loss_fn, scale_grads=True, *, timeout=300.0):
        super().__init__([stage], n_microbatches, loss_fn, scale_grads=scale_grads,
                         timeout=timeout)


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """1F1B over several stages per rank (rank r holds r, r + p, ...): the
    bubble shrinks by the number of stages per rank. ``n_microbatches``
    must be a multiple of the group size unless ``microbatch_group_size``
    says otherwise (see docs/pipeline.md for what is refused and why)."""

    _kind = "interleaved-1f1b"

    def __init__(self, stages, n_microbatches, loss_fn, scale_grads=True, *,
                 microbatch_group_size=None, timeout=300.0):
        if isinstance(stages, PipelineStage):
            stages = [stages]
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads,
                         timeout=timeout, microbatch_group_size=microbatch_group_size)
