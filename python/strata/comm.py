"""Collectives on torch tensors and numpy arrays: ``strata.init`` and the
``World`` and ``Group`` objects.

Under ``mpirun -np 8 python train.py``::

    import torch, strata

    world = strata.init(strata.Mesh(8, tp=2, pp=2))   # or strata.init() for pure DP
    tp = world.group("tp")                             # this rank's tensor-parallel group
    x = torch.ones(1024)
    tp.allreduce(x)                                    # in place, op="sum"
    work = world.group("dp").allreduce(x, op="avg", async_op=True)
    ...                                                # compute while it runs
    work.wait(timeout=30)
    world.destroy()                                    # or use `with strata.init() as world:`

Group methods follow ``torch.distributed``'s names. Ranks given to them
(``root``, ``peer``) are ranks within the group. Tensors must be CPU torch
tensors or numpy arrays (backends mpi, gloo) or CUDA tensors (backend
nccl, on the tensor's current torch stream), contiguous; they are used in place, without
copies, and must not be changed or freed while an asynchronous operation
runs (the work object keeps them referenced until it completes). Errors
raise :class:`strata.CommError`, or :class:`strata.RankFailure` when a peer
rank failed. The GIL is released while operations start and while waiting.

Without a launcher, ``strata.init()`` gives a world of one rank.
"""

import atexit
import weakref

from . import _strata
from ._settings import settings
from .errors import InvalidArgument, MeshError

__all__ = ["init", "World", "Group", "Work"]

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


def _rows(obj):
    """Length of the first dimension and elements per row (torch's split unit)."""
    shape = tuple(obj.shape)
    if not shape:
        raise InvalidArgument("all_to_all splits need tensors with at least one dimension")
    rows = shape[0]
    per_row = 1
    for n in shape[1:]:
        per_row *= n
    return rows, per_row


class Work:
    """An operation in flight (``async_op=True``)."""

    def __init__(self, raw):
        self._raw = raw

    def wait(self, timeout=None):
        """Blocks until the operation completes (True), or raises CommError
        (RankFailure if a peer failed). ``timeout`` in seconds: past it,
        CommError with code DEADLINE_EXCEEDED, and the operation stays in
        flight (wait again)."""
        return self._raw.wait(timeout)

    def is_completed(self):
        """True once done; raises the operation's error if it failed."""
        return self._raw.is_completed()

    def __repr__(self):
        return repr(self._raw)


class Group:
    """One process group's communicator (``World.group(axes)``)."""

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

    def _run(self, work, async_op):
        if async_op:
            return Work(work)
        work.wait(None)
        return None

    memory = property(lambda self: self._raw.memory,
                      doc="'host' (CPU tensors) or 'cuda' (CUDA tensors, backend nccl).")

    def allreduce(self, tensor, op="sum", async_op=False, timeout=None):
        """Reduces ``tensor`` over the group, in place."""
        b = _buffer(tensor, "allreduce", True)
        return self._run(self._raw.allreduce(b, b, op, timeout, tensor), async_op)

    def broadcast(self, tensor, root=0, async_op=False, timeout=None):
        """Copies ``tensor`` of group rank ``root`` to every rank."""
        b = _buffer(tensor, "broadcast", True)
        return self._run(self._raw.broadcast(b, root, timeout, tensor), async_op)

    def reduce(self, tensor, root=0, op="sum", async_op=False, timeout=None):
        """Reduces ``tensor`` onto group rank ``root``, in place there."""
        b = _buffer(tensor, "reduce", True)
        return self._run(self._raw.reduce(b, b, op, root, timeout, tensor), async_op)

    def allgather(self, output, input, async_op=False, timeout=None):
        """``output`` (size x input elements) = every rank's ``input`` in
        rank order, as torch's all_gather_into_tensor."""
        o = _buffer(output, "allgather output", True)
        i = _buffer(input, "allgather input", False)
        return self._run(self._raw.allgather(i, o, timeout, (output, input)), async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False, timeout=None):
        """Reduces ``input`` (size x output elements) and leaves block
        ``rank`` in ``output``, as torch's reduce_scatter_tensor."""
        o = _buffer(output, "reduce_scatter output", True)
        i = _buffer(input, "reduce_scatter input", False)
        return self._run(
            self._raw.reduce_scatter(i, o, op, timeout, (output, input)), async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, async_op=False,
                   timeout=None):
        """As torch's all_to_all_single: block i of ``input`` goes to rank i;
        splits (lists of first-dimension lengths, one per rank) make the
        blocks unequal; without them the first dimension splits evenly."""
        o = _buffer(output, "all_to_all output", True)
        i = _buffer(input, "all_to_all input", False)
        keep = (output, input)
        if output_splits is None and input_splits is None:
            return self._run(self._raw.all_to_all(i, o, timeout, keep), async_op)
        in_rows, in_row = _rows(input)
        out_rows, out_row = _rows(output)
        if input_splits is None:
            input_splits = self._even(in_rows, "input")
        if output_splits is None:
            output_splits = self._even(out_rows, "output")
        send = [int(s) * in_row for s in input_splits]
        recv = [int(s) * out_row for s in output_splits]
        return self._run(self._raw.all_to_all_v(i, o, send, recv, timeout, keep), async_op)

    def _even(self, rows, which):
        if rows % self.size:
            raise InvalidArgument(
                f"all_to_all: {which} has {rows} rows, not divisible by the group size "
                f"{self.size}; pass {which}_splits")
        return [rows // self.size] * self.size

    def send(self, tensor, peer, async_op=False, timeout=None):
        """Sends ``tensor`` to group rank ``peer``."""
        b = _buffer(tensor, "send", False)
        return self._run(self._raw.send(b, peer, timeout, tensor), async_op)

    def recv(self, tensor, peer, async_op=False, timeout=None):
        """Receives into ``tensor`` from group rank ``peer``."""
        b = _buffer(tensor, "recv", True)
        return self._run(self._raw.recv(b, peer, timeout, tensor), async_op)

    def barrier(self, async_op=False, timeout=None):
        return self._run(self._raw.barrier(timeout), async_op)

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
        raw = self._raw.shrink(list(excluded), name or self.name + "-shrunk", timeout)
        return None if raw is None else Group(raw)

    def split(self, color, key=None, name=None, timeout=None):
        """Ranks with equal ``color`` form a new group, ordered by ``key``;
        a negative color takes no part (None)."""
        raw = self._raw.split(color, self.rank if key is None else key,
                              name or f"{self.name}-split{color}", timeout)
        return None if raw is None else Group(raw)

    def __repr__(self):
        return f"<strata.Group {self.name}: rank {self.rank} of {self.size} ({self.backend})>"


_live_worlds = weakref.WeakSet()


@atexit.register
def _destroy_worlds_at_exit():
    # Before the interpreter (and then MPI) shuts down, so that no progress
    # thread is running when MPI_Finalize is called.
    for w in list(_live_worlds):
        w.destroy()


class World:
    """The root communicator and one communicator per mesh group of this
    rank. Made by :func:`strata.init`."""

    def __init__(self, raw):
        self._raw = raw
        self._groups = {}
        _live_worlds.add(self)

    rank = property(lambda self: self._raw.rank, doc="This rank in the job.")
    size = property(lambda self: self._raw.size, doc="Number of ranks in the job.")
    mesh = property(lambda self: self._raw.mesh, doc="The strata.Mesh of the groups.")

    def group(self, axes="world"):
        """This rank's group of ``axes``: 'tp', 'dp', 'pp', 'cp', 'dp-cp',
        'tp-pp', 'tp-dp-cp', 'ep', 'etp', 'edp', 'etp-ep', or 'world'."""
        g = self._groups.get(axes)
        if g is None:
            g = Group(self._raw.group(axes), self)
            self._groups[axes] = g
        return g

    def group_names(self):
        return ["world"] + list(self._raw.group_names())

    def destroy(self):
        """Tears down every communicator (joining the backend's threads).
        Idempotent; strata.init may be called again afterwards."""
        if self._raw.alive:
            self._raw.destroy()
        self._groups.clear()
        _live_worlds.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
        return False

    def __repr__(self):
        return f"<strata.World rank {self.rank} of {self.size}, {self.mesh!r}>"


def init(mesh=None, backend="auto", timeout=None, env=None, store=None, store_timeout=None):
    """Connects this rank to the job and builds every group of ``mesh``.

    ``mesh``: a :class:`strata.Mesh` for the job's world size, or None for
    a mesh of pure data parallelism. ``backend``: "auto" (NCCL where a GPU
    is visible and NCCL is built; otherwise MPI under mpirun, Slurm or no
    launcher, and Gloo under torchrun), "mpi", "gloo" or "nccl".
    ``timeout``: seconds each operation may take before it fails (default
    600). ``env`` replaces os.environ for launcher detection.

    Store-bootstrapped backends (gloo, nccl) rendezvous through ``store``
    (a :mod:`strata.store` store, or a ``torch.distributed.Store``); by
    default, $STRATA_STORE when set, else the TCPStore torchrun serves at
    MASTER_ADDR:MASTER_PORT, reached within ``store_timeout`` seconds
    (default: ``timeout``, else 300) or :class:`strata.CommError`.
    Collective: every rank must call it.
    """
    from . import store as _store
    launch = _strata.launch_env(env)
    if mesh is None:
        mesh = _strata.Mesh(launch.world_size)
    elif not isinstance(mesh, _strata.Mesh):
        raise InvalidArgument(f"mesh must be a strata.Mesh, got {_describe(mesh)}")
    if mesh.world_size != launch.world_size:
        raise MeshError(f"the mesh is for {mesh.world_size} ranks but the job has "
                        f"{launch.world_size} ({launch!r})")
    if store_timeout is None:
        store_timeout = 300.0 if timeout is None else float(timeout)
    if store_timeout <= 0:
        raise InvalidArgument(f"store_timeout must be positive, got {store_timeout}")
    keep = None  # a TCPStore this rank serves must outlive the world
    if store is not None and not isinstance(store, _store.Store):
        store = _store.from_torch(store)
    if (store is None and launch.world_size > 1
            and _strata.resolve_backend(launch, backend) in ("gloo", "nccl")
            and not settings(env)["STRATA_STORE"].value):
        keep, store = _store.connect_torchrun(launch, store_timeout, env)
    world = World(_strata._init_world(mesh, backend, timeout, env, store))
    world._store = (store, keep)
    return world
