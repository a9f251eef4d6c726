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
    optimizer.step()

A stage module wrapped in :class:`strata.nn.DataParallel` has its
gradients reduced over dp once per step: every microbatch's backward but
the last accumulates without reducing, the last one's starts the buckets as
its gradients appear, and ``step`` returns once they are reduced (under
``ScheduleZeroBubble``, whose split backward accumulates some gradients
outside autograd's hooks, all buckets are reduced after the last W). Inside
``DataParallel.no_sync()`` nothing is reduced, for accumulation over
several steps.

``ScheduleGPipe`` and ``ScheduleZeroBubble`` (zero-bubble H1: the backward
split into input and weight gradients) have the same arguments;
``ScheduleInterleaved1F1B`` takes the list of this rank's stages (rank r
holds stages r, r + p, r + 2p, ...).
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

import re
import weakref

import torch

from ._strata import pipeline as _core
from .axes import Axis
from .errors import InvalidArgument, PipelineError

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble"]

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

    def __init__(self, module, stage_index, world, *, num_stages=None, group=Axis.PP):
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

    __slots__ = ("outputs", "leaves", "loss", "records", "_live")

    def __init__(self, outputs, leaves, loss, live, records=None):
        self.outputs, self.leaves, self.loss, self._live = outputs, leaves, loss, live
        # Split backward: the forward's (module, output) pairs; after I, the
        # (output, parameters, gradient) that W needs.
        self.records = records
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


def _graph(roots):
    """The autograd graph behind ``roots``: {node: number of edges into it},
    and {id(parameter): its AccumulateGrad node}."""
    refs, accumulators = {}, {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            accumulators[id(variable)] = node
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            refs[nxt] = refs.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return refs, accumulators


def _deferrable(records, graph, params):
    """Which of ``params`` can have their gradients wait for W: [(output,
    [parameters])] for each module run once in the forward whose parameters
    every path from the loss reaches only through that module's output
    (their gradients then follow from the output's gradient alone).
    ``graph``: _graph of the roots. Every other parameter (used outside its
    module, shared, behind a module that returns a tuple) gets its gradient
    in I with the inputs'."""
    counts = {}
    for module, out in records:
        counts[id(module)] = counts.get(id(module), 0) + 1
    records = [(m, o) for m, o in records if counts[id(m)] == 1 and o.grad_fn is not None]
    fns = [o.grad_fn for _, o in records]
    stops = {f for f in fns if fns.count(f) == 1}
    refs, accumulators = graph
    wanted = {id(p) for p in params}
    out = []
    for module, o in records:
        if o.grad_fn not in stops:
            continue
        # The nodes only this output's node reaches: all their edges come
        # from nodes already owned, up to the other modules' outputs.
        owned, reached, stack = {o.grad_fn}, {}, [o.grad_fn]
        while stack:
            for nxt, _ in stack.pop().next_functions:
                if nxt is None or nxt in stops or nxt in owned:
                    continue
                reached[nxt] = reached.get(nxt, 0) + 1
                if reached[nxt] == refs.get(nxt, 0):
                    owned.add(nxt)
                    stack.append(nxt)
        mine = [p for p in module.parameters(recurse=False)
                if id(p) in wanted and accumulators.get(id(p)) in owned]
        if mine:
            out.append((o, mine))
    return out


def _accumulate(param, grad):
    if param.grad is None:
        param.grad = grad if grad.is_contiguous() else grad.contiguous()
    else:
        param.grad += grad


class _Recorder:
    """The (module, output) pairs of the forward being recorded (None: no
    recording). One for the process: forwards run one at a time."""

    records = None


_RECORDER = _Recorder()
_HOOKED = weakref.WeakSet()


def _record(module, args, output):
    if (_RECORDER.records is not None and isinstance(output, torch.Tensor)
            and output.requires_grad):
        _RECORDER.records.append((module, output))


def _hook(module):
    """Records the outputs of ``module``'s submodules that own parameters
    (one forward hook each, added once, a no-op outside a split schedule's
    forward)."""
    if not isinstance(module, torch.nn.Module):
        return
    for mod in module.modules():
        if mod not in _HOOKED and any(True for _ in mod.parameters(recurse=False)):
            mod.register_forward_hook(_record)
            _HOOKED.add(mod)


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
        # strata.nn.DataParallel stage modules: one gradient reduction per step.
        self._dp = {s.stage_index: s.module for s in stages
                    if callable(getattr(s.module, "_pipeline_begin", None))}
        self._backwards = {}
        self._loss_fn = loss_fn
        self._m = n_microbatches
        self._group = group
        self._device = torch.device("cpu")  # the host backends (mpi, gloo)
        self._split = any(re.fullmatch(r"\d+I\d+", t) for t in self.schedule.actions(r))
        if self._split:
            for s in stages:
                _hook(s.module)
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
        self._backwards = {index: 0 for index in self._dp}
        for dp in self._dp.values():
            dp._pipeline_begin()
        ok = False
        # strata.metrics: the World's registry marks the step (a user's
        # strata.metrics.step around this call counts it once).
        world = getattr(self._group, "_world", None)
        metrics = getattr(world, "metrics", None)
        try:
            if metrics is None:
                self.stats = self._runner.step(self._forward, self._backward, self._allocate)
            else:
                with metrics.step():
                    self.stats = self._runner.step(self._forward, self._backward,
                                                   self._allocate)
            ok = True
            timeline = getattr(world, "timeline", None)
            if timeline is not None:
                timeline._pipeline_step(self.stats, self.schedule.name)
        finally:
            self._inputs = self._targets = None
            self.peak_live_activations = self._live.peak
            for dp in self._dp.values():
                dp._pipeline_end(ok)  # waits for the reduction (raises its failure)
        return list(self._losses) if last else None

    # ---- callbacks of the runner (GIL held, on the caller's thread) --------
    def _forward(self, index, microbatch, inputs):
        stage = self._stages[index]
        if index == 0:
            args, leaves = self._inputs[microbatch], ()
        else:
            leaves = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
            args = leaves
        records = None
        with torch.enable_grad():
            if self._split:
                _RECORDER.records = records = []
            try:
                out = stage.module(*args)
            finally:
                _RECORDER.records = None
            if index == self.num_stages - 1:
                target = self._targets
                loss = (self._loss_fn(out) if target is None
                        else self._loss_fn(out, *target[microbatch]))
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise InvalidArgument(f"loss_fn must return a tensor of one element, got "
                                          f"{loss!r:.80}")
                detached = loss.detach()
                self._losses[microbatch] = detached
                return (), float(detached), _Activation((), leaves, loss, self._live, records)
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
        return sent, None, _Activation(outs, leaves, None, self._live, records)

    def _backward(self, index, microbatch, output_grads, act, loss_scale, part="B"):
        dp = self._dp.get(index)
        if dp is not None and part == "B":
            self._backwards[index] += 1
            dp._pipeline_backward(self._backwards[index] == self._m)
        if part == "W":
            for out, params, grad in act.records:
                torch.autograd.backward(out, grad, inputs=params, retain_graph=True)
            act.outputs = act.leaves = act.loss = act.records = None  # the graph goes now
            return None
        if act.loss is not None:
            roots, root_grads = [act.loss], [torch.full_like(act.loss, loss_scale)]
        else:
            pairs = [(o, g) for o, g in zip(act.outputs, output_grads) if o.requires_grad]
            roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
        if part == "I":
            self._backward_input(index, act, roots, root_grads)
        elif roots:
            torch.autograd.backward(roots, root_grads)
        grads = []
        for k, x in enumerate(act.leaves):
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            grads.append(_wire(g.contiguous(), f"the gradient of stage {index}'s input {k}"))
        if part == "B":
            act.outputs = act.leaves = act.loss = None  # the graph goes now
        return grads

    def _backward_input(self, index, act, roots, root_grads):
        """I of a split backward: the inputs' gradients (left in the leaves'
        .grad), the gradients of the parameters that cannot wait, and, kept
        for W, the gradient at the output of each module whose parameters
        can (see _deferrable). The graph stays until W."""
        records, act.records = act.records or [], []
        if not roots:
            return
        # Every tensor the graph accumulates a gradient into, not only the
        # module's parameters (a loss_fn's, a closure's, a stage that is a
        # plain function): those W does not take get theirs here.
        graph = _graph(roots)
        inputs = {id(x) for x in act.leaves}
        params = [n.variable for i, n in graph[1].items() if i not in inputs]
        deferred = _deferrable(records, graph, params)
        later = {id(p) for _, ps in deferred for p in ps}
        now = [p for p in params if id(p) not in later]
        leaves = [x for x in act.leaves if x.requires_grad]
        targets = leaves + now + [o for o, _ in deferred]
        if not targets:
            return
        got = torch.autograd.grad(roots, targets, root_grads, retain_graph=True,
                                  allow_unused=True)
        for x, g in zip(leaves, got):
            x.grad = g
        for p, g in zip(now, got[len(leaves):]):
            if g is not None:
                _accumulate(p, g)
        for (o, ps), g in zip(deferred, got[len(leaves) + len(now):]):
            if g is not None:
                act.records.append((o, ps, g))

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


class ScheduleZeroBubble(_PipelineSchedule):
    """Zero-bubble H1: the backward split into I (the input gradient, which
    the previous stage waits for) and W (the weight gradient, which fills
    the bubbles): a third of 1F1B's idle time when F, I and W cost the same,
    holding at most min(p, n_microbatches) activations on every rank.

    W needs no second pass through the stage: I keeps, for each submodule
    that owns parameters and runs once per forward, the gradient at its
    output; W turns those into the parameters' gradients. Parameters that
    are used outside their module (or shared, or under a module returning a
    tuple) get their gradients in I. Adds a forward hook to each such
    submodule (a no-op outside this schedule's forwards)."""

    _kind = "zb-h1"

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
