"""Collectives on torch tensors and numpy arrays: ``strata.init`` and the
``World`` and ``Group`` objects.

Under ``mpirun -np 8 python train.py``::

    import torch, strata

    world = strata.init(strata.Mesh(8, tp=2, pp=2))   # or strata.init() for pure DP
    tp = world.group("tp")                             # this rank's tensor-parallel group
    x = torch.ones(1024)
    tp.all_reduce(x)                                   # in place, op=strata.ReduceOp.SUM
    work = world.group("dp").all_reduce(x, op=strata.ReduceOp.AVG, async_op=True)
    ...                                                # compute while it runs
    work.wait(timeout=30)
    world.destroy()                                    # or use `with strata.init() as world:`

``world.group(axes)`` returns a handle on this rank's group of any
combination of the mesh's axes ('tp', 'dp-cp', 'tp-dp', 'etp-ep', ...,
'world'): the standard groups exist from ``strata.init`` on, any other is
created on first request, collectively over the whole world, as
``torch.distributed.new_group`` creates one (every rank must request it at
the same point). A group follows the world when it is rebuilt after ranks
left (``World.generation`` counts the rebuilds): every call resolves the
group's communicator of the current generation. Groups made by
``Group.split`` and ``Group.shrink`` are standalone and own their
communicator.

Group methods follow ``torch.distributed``'s names and conventions
(``all_reduce``, ``broadcast(tensor, src=)``, ``send(tensor, dst=)``,
``op=`` a :class:`ReduceOp` or ``torch.distributed.ReduceOp``, ``timeout=``
a ``datetime.timedelta`` or seconds, ``async_op=True`` returning a
:class:`Work`). Ranks given to them (``src``, ``dst``) are ranks within
the group. Tensors must be CPU torch
tensors or numpy arrays (backends mpi, gloo) or CUDA tensors (backend
nccl, on the tensor's current torch stream), contiguous; they are used in place, without
copies, and must not be changed or freed while an asynchronous operation
runs (the work object keeps them referenced until it completes). Errors
raise :class:`strata.CommError`, or :class:`strata.RankFailure` when a peer
rank failed. The GIL is released while operations start and while waiting.

Without a launcher, ``strata.init()`` gives a world of one rank.
"""

import atexit
import datetime
import os
import weakref

from . import _strata
from ._settings import settings
from .axes import group_name
from .errors import CommError, InvalidArgument, MeshError

__all__ = ["init", "World", "Group", "Work", "ReduceOp"]

def _describe(obj):
    return type(obj).__module__ + "." + type(obj).__qualname__


def _cuda_buffer(obj, what, writable):
    """(address, element count, dtype name, stream) of a CUDA tensor: the
    operation is ordered on the tensor's current torch stream, as
    torch.distributed orders its NCCL work. The group checks that its
    backend works on CUDA memory (nccl)."""
    if not obj.is_contiguous():
        raise InvalidArgument(
            f"{what}: tensor must be contiguous (call .contiguous()); got shape "
            f"{tuple(obj.shape)} with strides {tuple(obj.stride())}")
    if writable and obj.requires_grad and obj.is_leaf:
        raise InvalidArgument(
            f"{what}: a leaf tensor that requires grad cannot be written in place; use "
            "tensor.detach() or torch.no_grad()")
    import torch
    stream = torch.cuda.current_stream(obj.device).cuda_stream
    return (obj.data_ptr(), obj.numel(), str(obj.dtype), stream)


def _buffer(obj, what, writable):
    """(address, element count, dtype name) of a tensor or array, zero-copy."""
    if getattr(getattr(obj, "device", None), "type", None) == "cuda":
        return _cuda_buffer(obj, what, writable)

    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        if obj.device.type != "cpu":
            raise InvalidArgument(
                f"{what}: the mpi and gloo backends work on CPU tensors; got a tensor on "
                f"{obj.device}")
        if not obj.is_contiguous():
            raise InvalidArgument(
                f"{what}: tensor must be contiguous (call .contiguous()); got shape "
                f"{tuple(obj.shape)} with strides {tuple(obj.stride())}")
        if writable and obj.requires_grad and obj.is_leaf:
            raise InvalidArgument(
                f"{what}: a leaf tensor that requires grad cannot be written in place; use "
                "tensor.detach() or torch.no_grad()")
        return (obj.data_ptr(), obj.numel(), str(obj.dtype))
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:  # numpy.ndarray and friends
        if not obj.flags["C_CONTIGUOUS"]:
            raise InvalidArgument(
                f"{what}: array must be C-contiguous (use numpy.ascontiguousarray); got shape "
                f"{obj.shape} with strides {obj.strides}")
        if writable and not obj.flags["WRITEABLE"]:
            raise InvalidArgument(f"{what}: array is read-only")
        return (interface["data"][0], obj.size, obj.dtype.name)
    raise InvalidArgument(
        f"{what}: expected a torch CPU tensor or a numpy array, got {_describe(obj)}")


def _numel(obj):
    n = 1
    for d in tuple(obj.shape):
        n *= d
    return n


def _concat(tensors):
    """One contiguous 1-D copy of ``tensors`` (torch tensors or numpy arrays)."""
    first = tensors[0]
    if hasattr(first, "new_empty"):
        import torch
        return torch.cat([t.reshape(-1) for t in tensors])
    import numpy
    return numpy.concatenate([numpy.asarray(t).reshape(-1) for t in tensors])


def _rows(obj):
    """Length of the first dimension and elements per row (torch's split unit)."""
    shape = tuple(obj.shape)
    if not shape:
        raise InvalidArgument("all_to_all_single splits need tensors with at least one dimension")
    rows = shape[0]
    per_row = 1
    for n in shape[1:]:
        per_row *= n
    return rows, per_row


class ReduceOp:
    """Reduce operations, with torch.distributed.ReduceOp's names. Every
    ``op=`` also takes ``torch.distributed.ReduceOp.SUM`` (and its other
    supported members) and the strings "sum", "prod", "min", "max", "avg"."""

    SUM = "sum"
    PRODUCT = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


# torch.distributed.ReduceOp members by name (without importing torch).
_TORCH_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg"}


def _op(op, what):
    """The name the bindings take for ``op``: a strata.ReduceOp or string, or
    a torch.distributed.ReduceOp member (torch is not imported for it)."""
    if isinstance(op, str):
        return op
    if type(op).__module__.startswith("torch"):
        inner = getattr(op, "op", op)  # a ReduceOp object wraps a RedOpType member
        name = getattr(inner, "name", None)
        if name in _TORCH_OPS:
            return _TORCH_OPS[name]
        raise InvalidArgument(
            f"{what}: torch.distributed.ReduceOp.{name or repr(op)} is not supported (supported: "
            f"{', '.join(_TORCH_OPS)})")
    raise InvalidArgument(f"{what}: op must be a strata.ReduceOp, a "
                          f"torch.distributed.ReduceOp or one of 'sum', 'prod', 'min', 'max', "
                          f"'avg'; got {_describe(op)}")


def _seconds(timeout, what):
    """Seconds from a timeout given as a datetime.timedelta or a number;
    None stays None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise InvalidArgument(f"{what} must be a datetime.timedelta or a number of seconds, got "
                              f"{_describe(timeout)}")
    if not value > 0:
        raise InvalidArgument(f"{what} must be positive, got {timeout!r}")
    return value


class Work:
    """An operation in flight (``async_op=True``), as torch.distributed's Work."""

    def __init__(self, raw, done=None):
        self._raw = raw
        self._done = done  # runs once after a successful wait (copies out of a staging buffer)

    def wait(self, timeout=None):
        """Blocks until the operation completes (True), or raises
        :class:`strata.CommError` (:class:`strata.RankFailure` if a peer
        failed). ``timeout`` (a datetime.timedelta or seconds): past it,
        :class:`strata.TimeoutError`, and the operation stays in flight
        (wait again)."""
        result = self._raw.wait(_seconds(timeout, "wait: timeout"))
        self._finish()
        return result

    def is_completed(self):
        """True once done; raises the operation's error if it failed."""
        done = self._raw.is_completed()
        if done:
            self._finish()
        return done

    def _finish(self):
        if self._done is not None:
            done, self._done = self._done, None
            done()

    def __repr__(self):
        return repr(self._raw)


def _new_flat(like, count):
    """A new contiguous 1-D buffer of ``count`` elements of ``like``'s dtype
    and device (a torch tensor or a numpy array)."""
    if hasattr(like, "new_empty"):
        return like.new_empty((count,))
    import numpy
    return numpy.empty((count,), dtype=like.dtype)


class Group:
    """A process group: ``World.group(axes)``, a handle on this rank's group
    of ``axes`` that follows world rebuilds, or a group made by
    :meth:`split` / :meth:`shrink`, which owns its communicator.

    Its operations have torch.distributed's names and conventions
    (``all_reduce``, ``broadcast(tensor, src=)``, ``send(tensor, dst=)``,
    ``op=``, ``async_op=``, ``timeout=``); ranks given to them are ranks
    within this group (torch's ``group_src``/``group_dst``).

    ``name`` is the name the group was asked by, in canonical spelling
    (``world.group("cp-dp").name == "dp-cp"``), also where several names
    share one communicator (``"dp"`` and ``"dp-cp"`` when cp = 1); the
    errors of its operations name it the same way."""

    def __init__(self, raw, world=None):
        self._raw = raw
        self._world = world  # keeps the World alive while the group is used

    rank = property(lambda self: self._raw.rank, doc="This rank's index in the group.")
    size = property(lambda self: self._raw.size, doc="Number of ranks in the group.")
    name = property(lambda self: self._raw.name, doc="The group's name ('tp', 'dp-cp', ...).")
    backend = property(lambda self: self._raw.backend, doc="'mpi', 'gloo' or 'nccl'.")
    transport = property(
        lambda self: self._raw.transport,
        doc="How collectives and send/recv move data: the backend, or for gloo 'gloo, host "
        "copies' (ranks of one host copy between each other's buffers) or 'gloo, tcp'.")
    memory = property(lambda self: self._raw.memory,
                      doc="'host' (CPU tensors) or 'cuda' (CUDA tensors, backend nccl).")

    def _run(self, work, async_op, done=None):
        w = Work(work, done)
        if async_op:
            return w
        w.wait()
        return None

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False, timeout=None):
        """Reduces ``tensor`` over the group, in place."""
        b = _buffer(tensor, "all_reduce", True)
        return self._run(self._raw.allreduce(b, b, _op(op, "all_reduce"),
                                             _seconds(timeout, "all_reduce: timeout"), tensor),
                         async_op)

    def broadcast(self, tensor, src=0, async_op=False, timeout=None):
        """Copies ``tensor`` of group rank ``src`` to every rank."""
        b = _buffer(tensor, "broadcast", True)
        return self._run(self._raw.broadcast(b, src, _seconds(timeout, "broadcast: timeout"),
                                             tensor), async_op)

    def reduce(self, tensor, dst=0, op=ReduceOp.SUM, async_op=False, timeout=None):
        """Reduces ``tensor`` onto group rank ``dst``, in place there."""
        b = _buffer(tensor, "reduce", True)
        return self._run(self._raw.reduce(b, b, _op(op, "reduce"), dst,
                                          _seconds(timeout, "reduce: timeout"), tensor),
                         async_op)

    def all_gather(self, output, input, async_op=False, timeout=None):
        """Every rank's ``input`` in rank order: into ``output``, a list of
        ``size`` tensors shaped like ``input`` (torch's ``all_gather``), or
        one tensor of ``size`` x ``input`` elements (torch's
        ``all_gather_into_tensor``, without a copy)."""
        t = _seconds(timeout, "all_gather: timeout")
        if isinstance(output, (list, tuple)):
            if len(output) != self.size:
                raise InvalidArgument(f"all_gather: output has {len(output)} tensors, the group "
                                      f"{self.name} has {self.size} ranks")
            flat = _new_flat(input, self.size * _numel(input))
            i = _buffer(input, "all_gather input", False)
            o = _buffer(flat, "all_gather output", True)

            n = _numel(input)
            for r, out in enumerate(output):
                if _numel(out) != n:
                    raise InvalidArgument(
                        f"all_gather: output[{r}] has {_numel(out)} elements, input has {n}")

            def scatter_out():
                for r, out in enumerate(output):
                    chunk = flat[r * n:(r + 1) * n].reshape(tuple(out.shape))
                    if hasattr(out, "copy_"):
                        out.copy_(chunk)
                    else:
                        out[...] = chunk
            return self._run(self._raw.allgather(i, o, t, (flat, input)), async_op, scatter_out)
        o = _buffer(output, "all_gather output", True)
        i = _buffer(input, "all_gather input", False)
        return self._run(self._raw.allgather(i, o, t, (output, input)), async_op)

    def reduce_scatter(self, output, input, op=ReduceOp.SUM, async_op=False, timeout=None):
        """Reduces ``input`` over the group and leaves block ``rank`` of it in
        ``output``: ``input`` is a list of ``size`` tensors shaped like
        ``output`` (torch's ``reduce_scatter``) or one tensor of ``size`` x
        ``output`` elements (torch's ``reduce_scatter_tensor``, without a
        copy)."""
        t = _seconds(timeout, "reduce_scatter: timeout")
        o = _buffer(output, "reduce_scatter output", True)
        if isinstance(input, (list, tuple)):
            if len(input) != self.size:
                raise InvalidArgument(f"reduce_scatter: input has {len(input)} tensors, the "
                                      f"group {self.name} has {self.size} ranks")
            flat = _concat(input)
            i = _buffer(flat, "reduce_scatter input", False)
            return self._run(self._raw.reduce_scatter(i, o, _op(op, "reduce_scatter"), t,
                                                      (output, flat)), async_op)
        i = _buffer(input, "reduce_scatter input", False)
        return self._run(self._raw.reduce_scatter(i, o, _op(op, "reduce_scatter"), t,
                                                  (output, input)), async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False, timeout=None):
        """As torch's all_to_all_single: block i of ``input`` goes to rank i;
        split sizes (lists of first-dimension lengths, one per rank) make
        the blocks unequal; without them the first dimension splits evenly."""
        t = _seconds(timeout, "all_to_all_single: timeout")
        o = _buffer(output, "all_to_all_single output", True)
        i = _buffer(input, "all_to_all_single input", False)
        keep = (output, input)
        if output_split_sizes is None and input_split_sizes is None:
            return self._run(self._raw.all_to_all(i, o, t, keep), async_op)
        in_rows, in_row = _rows(input)
        out_rows, out_row = _rows(output)
        if input_split_sizes is None:
            input_split_sizes = self._even(in_rows, "input")
        if output_split_sizes is None:
            output_split_sizes = self._even(out_rows, "output")
        send = [int(s) * in_row for s in input_split_sizes]
        recv = [int(s) * out_row for s in output_split_sizes]
        return self._run(self._raw.all_to_all_v(i, o, send, recv, t, keep), async_op)

    def _even(self, rows, which):
        if rows % self.size:
            raise InvalidArgument(
                f"all_to_all_single: {which} has {rows} rows, not divisible by the group size "
                f"{self.size}; pass {which}_split_sizes")
        return [rows // self.size] * self.size

    def send(self, tensor, dst, async_op=False, timeout=None):
        """Sends ``tensor`` to group rank ``dst``."""
        b = _buffer(tensor, "send", False)
        return self._run(self._raw.send(b, dst, _seconds(timeout, "send: timeout"), tensor),
                         async_op)

    def recv(self, tensor, src, async_op=False, timeout=None):
        """Receives into ``tensor`` from group rank ``src``."""
        b = _buffer(tensor, "recv", True)
        return self._run(self._raw.recv(b, src, _seconds(timeout, "recv: timeout"), tensor),
                         async_op)

    def barrier(self, async_op=False, timeout=None):
        """Waits until every rank of the group has entered the barrier."""
        return self._run(self._raw.barrier(_seconds(timeout, "barrier: timeout")), async_op)

    # ---- fault handling (for the elastic layer) ---------------------------
    def abort(self):
        """Fails this rank's pending operations on the group, at once."""
        self._raw.abort()

    def revoke(self):
        """Makes every rank's operations on the group fail (ULFM)."""
        self._raw.revoke()

    def check(self):
        """Raises the error that broke the group, if any."""
        self._raw.async_error()

    def shrink(self, excluded, name=None, timeout=None):
        """A new group without the ``excluded`` group ranks (failed or
        evicted); called by the survivors. None on an excluded rank."""
        raw = self._raw.shrink(list(excluded), name or self.name + "-shrunk",
                               _seconds(timeout, "shrink: timeout"))
        return None if raw is None else Group(raw)

    def split(self, color, key=None, name=None, timeout=None):
        """Ranks with equal ``color`` form a new group, ordered by ``key``;
        a negative color takes no part (None)."""
        raw = self._raw.split(color, self.rank if key is None else key,
                              name or f"{self.name}-split{color}",
                              _seconds(timeout, "split: timeout"))
        return None if raw is None else Group(raw)

    def _pinned(self, holder):
        """This group, for a holder built for its current layout (shards of
        one tp size, a schedule of one pp size): once a world rebuild changes
        this rank's rank or the group's size, every call raises
        :class:`strata.CommError` naming both generations and layouts and
        ``holder``."""
        return Group(self._raw.pinned(holder), self._world)

    def __repr__(self):
        try:
            where = f"rank {self.rank} of {self.size} ({self.backend})"
        except Exception as e:  # a destroyed world's group still prints
            where = f"unusable: {e}"
        return f"<strata.Group {self.name}: {where}>"


_live_worlds = weakref.WeakSet()


@atexit.register
def _destroy_worlds_at_exit():
    # Before the interpreter (and then MPI) shuts down, so that no progress
    # thread is running when MPI_Finalize is called.
    for w in list(_live_worlds):
        w.destroy()


class _Joining:
    """The raw world of a process that joins a running job (STRATA_ELASTIC_JOIN)
    until strata.elastic admits it: nothing but its state can be used."""

    alive = False

    def __init__(self, mesh):
        self.mesh = mesh

    def destroy(self):
        pass

    def __getattr__(self, name):
        raise CommError(f"World.{name}: this process joins a running job (STRATA_ELASTIC_JOIN): "
                        "its world exists once strata.elastic.run() (or Controller) had it "
                        "admitted")


class World:
    """The root communicator and one communicator per mesh group of this
    rank. Made by :func:`strata.init`."""

    def __init__(self, raw):
        self._raw = raw
        self._groups = {}
        self.metrics = None  # the strata.metrics.Metrics of strata.init
        self._own_metrics = False  # made by strata.init (closed with the world)
        self.timeline = None  # a strata.timeline.Timeline made with world=this world
        _live_worlds.add(self)

    rank = property(lambda self: self._raw.rank, doc="This rank in the job.")
    size = property(lambda self: self._raw.size,
                    doc="Number of ranks in the job's mesh (spares not counted).")
    is_spare = property(
        lambda self: self._raw.is_spare,
        doc="True on a hot spare standing by outside the mesh (strata.init(spares=)): it "
        "has no group until strata.elastic gives it a failed rank's place.")
    spares = property(lambda self: self._raw.spares, doc="How many hot spares stand by.")
    joining = property(
        lambda self: isinstance(self._raw, _Joining),
        doc="True in a process that joins a running job (STRATA_ELASTIC_JOIN) until "
        "strata.elastic admitted it: it has no rank, group or mesh position before.")
    mesh = property(lambda self: self._raw.mesh, doc="The strata.Mesh of the groups.")
    generation = property(
        lambda self: self._raw.generation,
        doc="1 from strata.init; +1 at every rebuild of the world in place (after ranks "
        "left), whether it succeeded or not.")

    def group(self, axes="world"):
        """This rank's group of ``axes`` (a name, a :class:`strata.Axis` or a
        sequence of them), any combination of the mesh's axes in any order: dense 'tp', 'dp', 'cp', 'pp' ('dp-cp', 'tp-dp', ...),
        expert 'etp', 'ep', 'edp' with 'pp' ('etp-ep', ...), or 'world'.

        The standard groups (tp, cp, dp, pp, dp-cp, tp-pp, tp-dp-cp, ep, etp,
        edp, etp-ep) exist from strata.init on; any other is created on its
        first request, collectively over the world: every rank must request
        it at the same point, as torch.distributed.new_group. Ranks asking
        for different groups raise :class:`strata.InvalidArgument` saying
        who asked for what; a rank that never asks makes the others raise
        :class:`strata.CommError` (DEADLINE_EXCEEDED) after the group
        creation timeout (``strata.init(group_timeout=)``).

        The group follows rebuilds of the world (see :attr:`generation`)."""
        name = group_name(axes)
        g = self._groups.get(name)
        if g is None:
            g = Group(self._raw.group(name), self)
            self._groups[name] = g
        return g

    def group_names(self):
        """'world' and the groups that exist now, in creation order."""
        return ["world"] + list(self._raw.group_names())

    @staticmethod
    def all_group_names():
        """Every name :meth:`group` accepts, in canonical spelling."""
        return list(_strata._all_group_names())

    # ---- for the elastic layer (strata.elastic) ---------------------------
    def _rebuild(self, root, mesh):
        """Rebuilds the world in place over ``root`` (a group made by
        ``shrink`` or ``split`` of the old root, taken over by the world; its
        Group object becomes unusable) and ``mesh`` (a strata.Mesh of
        ``root.size`` ranks): every communicator of the old generation is
        aborted (work in flight fails with ABORTED) and destroyed, the
        standard groups of ``mesh`` are created and :attr:`generation`
        increases. Collective over ``root``. Groups taken before follow;
        those pinned to a layout that changed raise. On failure the world is
        left unusable (CommError from every group) until a rebuild succeeds."""
        if not isinstance(mesh, _strata.Mesh):
            raise InvalidArgument(f"mesh must be a strata.Mesh, got {_describe(mesh)}")
        if not isinstance(root, Group):
            raise InvalidArgument(f"root must be a strata.Group made by shrink or split, got "
                                  f"{_describe(root)}")
        self._raw.rebuild(root, mesh)

    def _abort_all(self):
        """Aborts the root and every group communicator, from any thread, at
        once: every pending and later operation fails. Rebuild or destroy
        the world afterwards."""
        self._raw.abort_all()

    # ---- flight recorder (docs/observability.md) ----------------------------
    @property
    def trace_dir(self):
        """Where this rank writes its flight-recorder dump (None when the
        recorder is off: ``strata.init(trace=False)`` or STRATA_TRACE=0)."""
        return self._raw.trace_dir or None

    def dump_trace(self, reason="called"):
        """Writes this rank's flight recorder (its last operations, in
        PyTorch's flight-recorder JSON) into :attr:`trace_dir` now and
        returns the file's path. Not collective."""
        return self._raw.dump_trace(str(reason))

    def request_trace_dump(self, reason="asked"):
        """Asks every rank of the job to dump its flight recorder (each sees
        the request within a second, through a file store in
        :attr:`trace_dir`), dumps this rank, and returns this rank's path.
        Not collective: rank 0 may call it when it sees a step hang; then
        ``strata-trace DIR`` names the operation a rank never entered."""
        return self._raw.request_trace_dump(str(reason))

    def destroy(self):
        """Tears down every communicator (joining the backend's threads).
        Idempotent; strata.init may be called again afterwards."""
        if self._raw.alive:
            self._raw.destroy()
            if self._own_metrics:
                self.metrics.close()  # the final figures; the port is free again
            elif self.metrics is not None and self.metrics.file:
                self.metrics.write()
        self._groups.clear()
        _live_worlds.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
        return False

    def __repr__(self):
        if isinstance(self._raw, _Joining):
            return f"<strata.World (joining a running job), {self.mesh!r}>"
        if not self._raw.alive:
            return f"<strata.World (destroyed), {self.mesh!r}>"
        return (f"<strata.World rank {self.rank} of {self.size}, generation {self.generation}, "
                f"{self.mesh!r}>")


def init(mesh=None, backend="auto", timeout=None, env=None, store=None, store_timeout=None,
         group_timeout=None, trace=None, trace_dir=None, trace_buffer=None, metrics=None,
         spares=0):
    """Connects this rank to the job and builds every group of ``mesh``.

    ``mesh``: a :class:`strata.Mesh` for the job's world size, or None for
    a mesh of pure data parallelism. ``backend``: "auto" (NCCL where a GPU
    is visible and NCCL is built; otherwise MPI under mpirun, Slurm or no
    launcher, and Gloo under torchrun), "mpi", "gloo" or "nccl".
    ``timeout``: how long each operation may take before it fails with
    :class:`strata.TimeoutError` (a datetime.timedelta or seconds; default
    10 minutes: a collective that some rank never calls fails then, naming
    the rank, the group and the operation). ``group_timeout``: how long the
    ranks wait for each other when a group is created on first request
    (default: ``timeout``). ``env``
    replaces os.environ for launcher detection.

    The flight recorder (docs/observability.md) keeps this rank's last
    ``trace_buffer`` operations (default 2000) and writes them to
    ``trace_dir`` (default $STRATA_TRACE_DIR, else strata-trace-<job> under
    the temp directory) when an operation fails, on SIGUSR1, or when asked
    (:meth:`World.dump_trace`, :meth:`World.request_trace_dump`).
    ``trace``: True or False; None follows $STRATA_TRACE (default on).

    ``spares``: hot spares for :mod:`strata.elastic`: the job has the
    mesh's ranks plus this many, the last ones, which stand by outside the
    mesh (``world.is_spare``; they have no group) until a failed rank's
    place is given to one (docs/elastic-membership.md "Spares").

    ``metrics``: the :class:`strata.metrics.Metrics` every communicator of
    the world records its operations into (``world.metrics``); by default
    a new one, served and written as STRATA_METRICS_PORT and
    STRATA_METRICS_FILE say; False for none.

    Store-bootstrapped backends (gloo, nccl) rendezvous through ``store``
    (a :mod:`strata.store` store, or a ``torch.distributed.Store``); by
    default, $STRATA_STORE when set, else the TCPStore torchrun serves at
    MASTER_ADDR:MASTER_PORT, reached within ``store_timeout`` seconds
    (default: ``timeout``, else 300) or :class:`strata.CommError`.
    Collective: every rank must call it.
    """
    from . import store as _store
    timeout = _seconds(timeout, "timeout")
    store_timeout = _seconds(store_timeout, "store_timeout")
    group_timeout = _seconds(group_timeout, "group_timeout")
    launch = _strata.launch_env(env)
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise InvalidArgument(f"spares must be an int >= 0, got {_describe(spares)}")
    if mesh is None:
        mesh = _strata.Mesh(launch.world_size - spares)
    elif not isinstance(mesh, _strata.Mesh):
        raise InvalidArgument(f"mesh must be a strata.Mesh, got {_describe(mesh)}")
    joining = settings(env)["STRATA_ELASTIC_JOIN"].value.lower() in ("1", "true")
    if mesh.world_size + spares != launch.world_size and not joining:
        with_spares = f" and {spares} spares" if spares else ""
        raise MeshError(f"the mesh is for {mesh.world_size} ranks{with_spares} but the job has "
                        f"{launch.world_size} ({launch!r})")
    if store_timeout is None:
        store_timeout = 300.0 if timeout is None else timeout
    keep = None  # a TCPStore this rank serves must outlive the world
    if store is not None and not isinstance(store, _store.Store):
        store = _store.from_torch(store)
    if (store is None and launch.world_size > 1
            and _strata.resolve_backend(launch, backend) in ("gloo", "nccl")
            and not settings(env)["STRATA_STORE"].value):
        keep, store = _store.connect_torchrun(launch, store_timeout, env)
    if trace is not None and not isinstance(trace, bool):
        raise InvalidArgument(f"trace must be True, False or None, got {_describe(trace)}")
    if trace_buffer is not None and (isinstance(trace_buffer, bool)
                                     or not isinstance(trace_buffer, int) or trace_buffer < 1):
        raise InvalidArgument(f"trace_buffer must be a positive int, got {_describe(trace_buffer)}")
    if trace_dir is not None:
        trace_dir = os.fspath(trace_dir)
    from . import metrics as _metrics
    own = metrics is None
    if own:
        metrics = _metrics.Metrics(rank=launch.rank, env=env)
    elif metrics is False:
        metrics = None
    elif not isinstance(metrics, _metrics.Metrics):
        raise InvalidArgument(f"metrics must be a strata.metrics.Metrics, None or False, got "
                              f"{_describe(metrics)}")
    sink = metrics._raw.sink() if metrics is not None else None
    if joining:
        # Nothing collective here: strata.elastic asks the running job to
        # admit this process and builds its world then (docs/elastic.md
        # "Growing back").
        world = World(_Joining(mesh))
        world._join = {"timeout": timeout, "group_timeout": group_timeout, "env": env,
                       "trace": trace, "trace_dir": trace_dir, "trace_buffer": trace_buffer,
                       "sink": sink}
    else:
        world = World(_strata._init_world(mesh, backend, timeout, group_timeout, env, store,
                                          trace, trace_dir, trace_buffer, sink, spares))
    world._store = (store, keep)
    world.metrics = metrics
    world._own_metrics = own
    if metrics is not None:
        metrics._world = weakref.ref(world)
    return world
