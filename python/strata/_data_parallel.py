"""strata.nn.DataParallel: gradients averaged (or summed) over the
data-parallel group, bucket by bucket, while backward still runs.

::

    import torch, strata
    import strata.nn as snn

    world = strata.init(strata.Mesh(8, tp=2))               # dp4 x tp2
    model = snn.DataParallel(build_model(world), world)     # reduces over "dp"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:                                    # this dp rank's batch
        loss = loss_fn(model(x), y)
        model.zero_grad()                                   # zeroes the flat buffers
        loss.backward()                                     # buckets reduce as grads appear
        opt.step()                                          # gradients are averaged here

What it does, as torch's DistributedDataParallel and Megatron-Core's
DistributedDataParallel do:

- Gradients live in one flat buffer per dtype; each parameter's ``.grad``
  is a view of it, so a bucket (a contiguous range of about
  ``bucket_bytes``) is reduced in place, without copies.
- A hook on each parameter (``register_post_accumulate_grad_hook``) marks
  it ready as autograd accumulates its gradient; a bucket whose gradients
  are all ready starts its all-reduce at once, while backward goes on.
  Buckets start in index order on every rank, so the collectives match.
  When backward ends, DataParallel starts what is left and waits for every
  bucket: after ``loss.backward()`` the gradients are reduced.
- The buckets follow the order gradients became ready in the first
  backward (before it: reverse registration order), checked to be the same
  on every rank of the group (else :class:`BucketMismatchError`).
- ``no_sync()`` accumulates without reducing (gradient accumulation over
  microbatches reduces once, in the last backward). strata's pipeline
  schedules do this by themselves for a stage module that is a
  DataParallel: one reduction per step, started in the last microbatch's
  backward (after the step for zero-bubble schedules, whose split backward
  accumulates some gradients outside autograd's hooks).
- The group is the World's "dp" group, or "dp-cp" when the mesh has cp > 1
  (as Megatron reduces over data and context parallelism); a strata.Group
  may be given instead. Tensor-parallel parameters are shards and are
  reduced over dp like any other; strata.nn's sequence-parallel layer norms
  already sum their gradients over tp in backward, and a parameter marked
  Megatron's way (``param.sequence_parallel = True``) is summed over tp by
  DataParallel before its dp reduction.
- With a :class:`strata.optim.DistributedOptimizer` over its parameters
  (ZeRO-1) the buckets are reduce-scattered instead: each rank receives its
  block of each bucket, steps it, and all-gathers the parameters.

Errors (all :class:`strata.InvalidArgument`): :class:`ParameterMismatchError`
when the ranks hold different parameters (at construction, collectively),
:class:`UnusedParametersError` naming parameters that got no gradient (pass
``find_unused_parameters=True``, or freeze them), :class:`BucketMismatchError`,
and :class:`ModuleChangedError` when parameters are added, removed,
replaced, reshaped or frozen after wrapping.

Failures: a failed collective is raised from ``backward()`` (a
:class:`strata.CommError` / :class:`strata.RankFailure`) only after every
bucket of the step was waited for; parameters and optimizer state are then
unchanged (as long as ``step()`` is not called) and the gradient buffers
hold a mix of reduced and local values. The step must be abandoned:
``zero_grad()`` (same group) or ``rebuild(new_group)`` (a shrunk one)
before the next forward, which otherwise raises ``GradientSyncFailed``.

See docs/data-parallel.md.
"""

import contextlib
import dataclasses
import weakref

import torch

from . import _dp_comm as C
from ._dp_reducer import (
    BucketMismatchError,
    GradientSyncFailed,
    ModuleChangedError,
    ParameterMismatchError,
    Reducer,
    UnusedParametersError,
    check_same_parameters,
)
from ._dp_layout import Layout
from .errors import InvalidArgument

__all__ = [
    "DataParallel",
    "DataParallelOptions",
    "BucketMismatchError",
    "GradientSyncFailed",
    "ModuleChangedError",
    "ParameterMismatchError",
    "UnusedParametersError",
]


@dataclasses.dataclass
class DataParallelOptions:
    """Options of :class:`DataParallel` (also accepted as keywords).

    ``bucket_bytes``: a bucket closes once it holds this many bytes of
    gradients (torch DDP's 25 MiB by default). ``reduce_op``: "avg" (the mean
    over the group, as DDP) or "sum". ``axes``: the group to reduce over
    (None: "dp", or "dp-cp" when the mesh has cp > 1). ``find_unused_parameters``:
    parameters without a gradient in a backward are reduced as their buffers
    hold them instead of raising :class:`UnusedParametersError`, and the
    bucket order is rank 0's. ``broadcast_parameters``: parameters and
    buffers start as dp rank 0's (as DDP). ``timeout``: seconds each
    collective may take (None: the group's). ``record_events``: keep
    ``DataParallel.events``, the order of what happened (for tests and
    debugging).
    """

    bucket_bytes: int = 25 * 2**20
    reduce_op: str = "avg"
    axes: str = None
    find_unused_parameters: bool = False
    broadcast_parameters: bool = True
    timeout: float = None
    record_events: bool = False

    def check(self):
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) \
                or self.bucket_bytes < 1:
            raise InvalidArgument(f"DataParallel: bucket_bytes must be an int >= 1, got "
                                  f"{self.bucket_bytes!r}")
        if self.reduce_op not in ("avg", "sum"):
            raise InvalidArgument(f"DataParallel: reduce_op must be 'avg' or 'sum', got "
                                  f"{self.reduce_op!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise InvalidArgument(f"DataParallel: timeout must be > 0 seconds or None, got "
                                  f"{self.timeout!r}")
        return self


def make_options(options, kwargs, cls=DataParallelOptions):
    if options is None:
        options = cls()
    elif isinstance(options, dict):
        options = cls(**options)
    elif not isinstance(options, cls):
        raise InvalidArgument(f"options must be a {cls.__name__} or a dict, got "
                              f"{type(options).__name__}")
    if kwargs:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise InvalidArgument(f"unknown {cls.__name__} option(s) {unknown}; known: "
                                  f"{sorted(fields)}")
        options = dataclasses.replace(options, **kwargs)
    return options.check()


def resolve_groups(world, axes, who):
    """(reduction group, tp group or None) of ``world`` (a strata.World or
    a strata.Group)."""
    if hasattr(world, "group") and hasattr(world, "mesh"):  # strata.World
        if axes is None:
            axes = "dp-cp" if world.mesh.cp > 1 else "dp"
        return world.group(axes), world.group("tp")
    if hasattr(world, "all_reduce"):  # strata.Group
        if axes is not None:
            raise InvalidArgument(f"{who}: axes={axes!r} needs a strata.World, not a Group")
        return world, None
    raise InvalidArgument(f"{who}: world must be a strata.World or a strata.Group, got "
                          f"{type(world).__module__}.{type(world).__qualname__}")


# Set by strata.elastic while a hot spare builds its model for the place it
# was given: the layers are made without their collectives (the check of the
# parameters and the broadcast of dp rank 0's), since the members of its dp
# group are not constructing anything; the spare then receives the state and
# the bucket layout of its position from a member (_adopt_layout).
_deferred_sync = [False]


@contextlib.contextmanager
def deferred_sync():
    before = _deferred_sync[0]
    _deferred_sync[0] = True
    try:
        yield
    finally:
        _deferred_sync[0] = before


def _broadcast_state(module, group, timeout):
    """Parameters and buffers of dp rank 0, one broadcast per dtype."""
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, device), ts in by_dtype.items():
            if dtype == torch.bool:
                flat = torch.cat([t.reshape(-1).to(torch.uint8) for t in ts])
            else:
                flat = torch.cat([t.reshape(-1) for t in ts])
            C.broadcast(group, flat, 0, timeout)
            off = 0
            for t in ts:
                n = t.numel()
                t.copy_(flat[off:off + n].view(t.shape).to(t.dtype))
                off += n


class DataParallel(torch.nn.Module):
    """``module`` with its gradients reduced over ``world``'s data-parallel
    group (see the module docstring). ``options``: a
    :class:`DataParallelOptions` (or dict), keywords override it.

    Collective: every rank of the group constructs it with the same model.
    Parameters that do not require grad at construction are left alone.
    ``state_dict()`` keys carry the ``module.`` prefix, as DDP's.
    """

    def __init__(self, module, world, options=None, **kwargs):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgument(f"DataParallel wraps a torch.nn.Module, got "
                                  f"{type(module).__name__}")
        opts = make_options(options, kwargs)
        group, tp = resolve_groups(world, opts.axes, "DataParallel")
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        owned = [n for n, p in named if getattr(p, "_strata_reducer", lambda: None)() is not None]
        if owned:
            raise InvalidArgument(f"DataParallel: parameters {owned[:4]} already belong to "
                                  "another DataParallel (wrap each module once)")
        reducer = Reducer(named, group, opts, tp, hooks=True)
        if not _deferred_sync[0]:
            check_same_parameters(reducer.entries, group, opts.timeout)
            if opts.broadcast_parameters and group.size > 1:
                _broadcast_state(module, group, opts.timeout)
        self._reducer = reducer
        for _, p in named:
            p._strata_reducer = weakref.ref(reducer)
        self._signature = self._current()

    # ---- what users call ---------------------------------------------------
    def forward(self, *args, **kwargs):
        self._check_unchanged()
        self._reducer.begin_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """The backward passes of forwards run in this context accumulate
        gradients without reducing them (as DDP's, the forward decides); the
        first one after it reduces the sum."""
        r = self._reducer
        before = r.user_sync
        r.user_sync = False
        try:
            yield
        finally:
            r.user_sync = before

    def zero_grad(self, set_to_none=True):
        """Zeroes the gradient buffers in place (``set_to_none`` is accepted
        for torch's signature: the ``.grad`` views stay, since buckets reduce
        them in place). Also abandons a step whose reduction failed."""
        self._reducer.zero_grad()

    def finish_grad_sync(self):
        """Starts every bucket not started yet and waits for all of them
        (what the end of a backward pass does by itself; for code that
        accumulates gradients outside autograd's hooks)."""
        self._reducer.finish()

    def rebuild(self, world, keep_state=True):
        """Re-buckets for a new data-parallel group (in-process recovery:
        ``world`` is the rebuilt strata.World, its new dp Group, or None on
        a rank that leaves). Abandons the step under way (gradients are
        zeroed). The bucket order of the first backward is kept.

        With a DistributedOptimizer attached its state is re-partitioned
        too: ``keep_state=True`` moves it from the old owners to the new
        ones (collective over the *old* group, which must still work: a
        planned resize, every old rank taking part); ``keep_state=False``
        drops it (the old group is broken; load a checkpoint next)."""
        r = self._reducer
        group = None
        if world is not None:
            group, tp = resolve_groups(world, r.opts.axes if hasattr(world, "mesh") else None,
                                       "DataParallel.rebuild")
            r.tp = tp if tp is not None else r.tp
        opt = r.zero() if r.zero is not None else None
        moves = opt._layout_changed if opt is not None else (lambda *a: None)
        r.zero_grad()
        r.relayout_for(group, keep_state, moves)

    def _layout_state(self):
        """(the bucket order, whether the first backward decided it): what a
        spare placed in this layer's group adopts (_adopt_layout)."""
        r = self._reducer
        return list(r.layout.order), bool(r.final)

    def _adopt_layout(self, state):
        """Takes a member's bucket order (from _layout_state), as if this
        rank had run the same first backward; no collective. Gradients held
        are discarded (a newcomer has none): its buffers are reused."""
        order, final = state
        r = self._reducer
        r.set_layout(Layout(r.entries, list(order), r.opts.bucket_bytes, r.layout.pad),
                     discard_grads=True)
        r.final = final

    # ---- inspection ----------------------------------------------------------
    @property
    def group(self):
        """The strata.Group gradients are reduced over."""
        return self._reducer.group

    @property
    def options(self):
        return self._reducer.opts

    @property
    def buckets(self):
        """The buckets, in the order they are reduced (final after the first
        backward)."""
        return list(self._reducer.layout.buckets)

    @property
    def events(self):
        """With ``record_events``: what happened, in order: ("ready", name)
        when a gradient was accumulated, ("launch", bucket, bytes) when a
        bucket's collective started, ("backward_end",), ("done", bucket)
        when it was waited for, ("layout", buckets) when the first
        backward's layout was set."""
        return self._reducer.events

    def grad_buffers(self):
        """{dtype: flat gradient buffer} (the ``.grad`` of every parameter
        is a view of one of them)."""
        return dict(self._reducer.grad)

    # ---- checks --------------------------------------------------------------
    def _current(self):
        return [(n, p, tuple(p.shape), p.dtype, p.requires_grad)
                for n, p in self.module.named_parameters()]

    def _check_unchanged(self):
        now = self._current()
        before = self._signature
        same = len(now) == len(before) and all(
            a[0] == b[0] and a[1] is b[1] and a[2] == b[2] and a[3] == b[3] and a[4] == b[4]
            for a, b in zip(now, before))
        moved = self._reducer.params_in_place()
        if same and not moved:
            return
        was = {n: s for n, *s in before}
        is_ = {n: s for n, *s in now}
        what = []
        what += [f"'{n}' added" for n in is_ if n not in was]
        what += [f"'{n}' removed" for n in was if n not in is_]
        for n in is_:
            if n in was:
                (p0, s0, d0, r0), (p1, s1, d1, r1) = was[n], is_[n]
                if p0 is not p1:
                    what.append(f"'{n}' replaced by another Parameter")
                elif s0 != s1 or d0 != d1:
                    what.append(f"'{n}' changed from {s0} {d0} to {s1} {d1}")
                elif r0 != r1:
                    what.append(f"'{n}' requires_grad changed to {r1}")
        what += [f"'{e.name}' .data replaced (no longer a view of the ZeRO-1 parameter buffer)"
                 for e in moved]
        raise ModuleChangedError(
            f"DataParallel: the wrapped module's parameters changed after wrapping: "
            f"{'; '.join(what[:8])}{' ...' if len(what) > 8 else ''}. Buckets, hooks and "
            "gradient views are made at construction: change the model first, then wrap it")

    def extra_repr(self):
        r = self._reducer
        return (f"group={r.group.name if r.group is not None else None} "
                f"(size {r.group.size if r.group is not None else 0}), "
                f"reduce_op={r.opts.reduce_op}, buckets={len(r.layout.buckets)}, "
                f"zero1={r.zero is not None}")

    # ---- strata.pipeline's schedules ------------------------------------------
    def _pipeline_begin(self):
        r = self._reducer
        r.check_failed()
        r.pipeline = True
        r.backward_sync = False

    def _pipeline_backward(self, last):
        """Before a backward of the schedule: only the last microbatch's
        reduces (and only outside no_sync())."""
        r = self._reducer
        r.backward_sync = bool(last) and r.user_sync

    def _pipeline_end(self, ok):
        r = self._reducer
        r.pipeline = False
        r.backward_sync = r.user_sync
        if not ok:
            r.drain()
            r.ready = [False] * len(r.entries)
            return
        if r.user_sync:
            r.finish()
