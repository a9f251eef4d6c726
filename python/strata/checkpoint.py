"""Async sharded checkpoints of PyTorch training state.

A checkpoint is a directory per step of safetensors files plus a versioned,
checksummed ``manifest.json``; ``latest`` names the newest committed one (see
docs/checkpoint.md). Saving copies the tensors into staging memory and
returns; a background thread writes, verifies and commits. A checkpoint is
committed whole or not at all.

The state-dict idiom of torch.distributed.checkpoint works as it does there,
on one process or, with ``world=``, on every rank (collectively)::

    import strata.checkpoint as ckpt

    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()},
              "/ckpt/run1", step=1000, world=world)          # blocking save

    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ckpt.load("/ckpt/run1", sd, world=world)  # in place: model's parameters change
    opt.load_state_dict(sd["optim"])

``load`` fills the tensors of the state it is given in their own memory
(``model.state_dict()``'s share the parameters' storage, so the model is
loaded) and returns that same dict. The modules and optimizers themselves
may be given instead of their state dicts, with schedulers and plain values
beside them::

    saver = ckpt.AsyncCheckpointer("/ckpt/run1", keep_last=3, world=world)
    for step in range(...):
        train_step()
        if step % 100 == 0:
            saver.save({"model": model, "optimizer": opt, "sched": sched, "epoch": 3},
                       step=step)                    # returns after staging
    saver.wait()

    state = {"model": model, "optimizer": opt, "sched": sched, "epoch": 0}
    ckpt.load("/ckpt/run1", state, world=world)  # in place: model, optimizer, scheduler, epoch
    everything = ckpt.load("/ckpt/run1")         # or: a new nested dict of CPU tensors

``state`` is a dict whose values may be tensors, ``nn.Module``\\ s, optimizers
(Adam's ``exp_avg``/``exp_avg_sq``/``step`` included), LR schedulers or
anything else with ``state_dict()``/``load_state_dict()``, and plain Python
values (None, bool, int, float, str, bytes, lists, tuples, dicts). Tensor keys
in the checkpoint are the dotted paths (``model.layer.weight``); an
optimizer object's states are keyed by the name of their parameter in
``state`` (``optimizer.state.model.layer.weight.exp_avg``) when its
parameters belong to modules saved beside it, else by index
(``optimizer.state.0.exp_avg``, as in ``opt.state_dict()``). The structure
around them is stored in the manifest and rebuilt exactly on load.

``world=None`` means a single process. With a ``strata.World`` each rank
writes its shards and a load reshards to the current layout, each rank
reading only the byte ranges it needs. A tensor is a shard when it carries
its layout, ``tensor_parallel_sharding = (dim, index, count)``: the
parameters of ``strata.nn``'s tensor-parallel layers
(``strata.nn.ShardedParameter``), the tensors ``model.state_dict()`` and
torch's optimizers (``torch.zeros_like(param)``) make of them, and the
parameters and optimizer states of modules and optimizers given as objects.
Every other tensor is replicated, written once; before anything is written,
``save`` checks that its replicas are equal (dtype, shape and a digest of the
bytes, two small all-reduces per replica group) and raises on every rank,
naming the tensor and the ranks, when they are not::

    world = strata.init(strata.Mesh(8, tp=4))
    ckpt.save(model.state_dict(), "/ckpt/run1", step=100, world=world)
    # later, on a dp4 x tp2 mesh:
    ckpt.load("/ckpt/run1", model.state_dict(), world=world)

Errors raise :class:`strata.CheckpointError` (``code`` holds the canonical
status: ``NOT_FOUND``, ``DATA_LOSS``, ``INVALID_ARGUMENT``, ...).
"""

import json
import os
import random
import time
import warnings

import torch

from . import _checkpoint_tree as T
from . import _strata

__all__ = [
    "AsyncCheckpointer",
    "CheckpointWarning",
    "save",
    "load",
    "info",
    "verify",
    "latest_step",
    "list_steps",
    "load_safetensors",
]

# Version of the Python structure stored in the manifest's state.extra.
_TREE_VERSION = 1
_TREE_KEY = "strata.python"


class CheckpointWarning(UserWarning):
    """A background save failed (with ``on_failure="warn"``), or retention
    could not remove an old checkpoint."""


_error = T.error
_DTYPES, _TORCH_DTYPES = T.DTYPES, T.TORCH_DTYPES
_Flattener, _decode, _tensor_keys, _state_dict_of = T.Flattener, T.decode, T.tensor_keys, \
    T.state_dict_of


# ---- RNG ------------------------------------------------------------------------


def _capture_rng():
    states = {"torch.cpu": bytes(torch.get_rng_state().numpy().tobytes()),
              "python": json.dumps(random.getstate()).encode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            states[f"torch.cuda:{i}"] = bytes(torch.cuda.get_rng_state(i).numpy().tobytes())
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        states["numpy"] = json.dumps([name, keys.tolist(), pos, has_gauss, gauss]).encode()
    return states


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _restore_rng(states):
    if "torch.cpu" in states:
        torch.set_rng_state(torch.frombuffer(bytearray(states["torch.cpu"]), dtype=torch.uint8))
    if "python" in states:
        v = json.loads(states["python"].decode())
        random.setstate((v[0], tuple(v[1]), v[2]))
    np = _numpy()
    if "numpy" in states and np is not None:
        name, keys, pos, has_gauss, gauss = json.loads(states["numpy"].decode())
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    for name, b in states.items():
        if name.startswith("torch.cuda:") and torch.cuda.is_available():
            i = int(name.split(":", 1)[1])
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(torch.frombuffer(bytearray(b), dtype=torch.uint8), i)


# ---- saving -----------------------------------------------------------------------


class AsyncCheckpointer:
    """Saves asynchronously: :meth:`save` returns once the tensors are copied
    into staging memory (reused across saves); a background thread writes and
    commits. One save is in flight at a time: another :meth:`save` waits for it
    (``on_busy="wait"``, up to ``busy_timeout`` seconds) or raises
    (``on_busy="refuse"``). A failed background save never stops training: the
    next :meth:`save` raises it (``on_failure="raise"``) or warns with a
    :class:`CheckpointWarning` and goes on (``on_failure="warn"``); :meth:`wait`
    raises it too.

    Options: ``keep_last`` (keep the newest K checkpoints; the one ``latest``
    names is never removed), ``checksum`` ("xxh3-128" or "sha256"),
    ``chunk_bytes`` (checksum granularity), ``max_file_bytes`` (split a rank's
    data into files of about this size), ``commit_timeout`` (seconds),
    ``staging_threads``, ``io_priority`` ("low" or "normal"), ``rng`` (save the
    torch, numpy and Python RNG states, each rank its own).

    ``world``: a ``strata.World`` for a multi-rank save (every rank creates
    the checkpointer, collectively, and calls :meth:`save` with the same
    step); the checkpointer splits a communicator of its own off the world,
    so its agreements never interleave with training's collectives. It
    follows the world when it is rebuilt in place: the first :meth:`save`
    after a rebuild splits a new communicator off the new generation. Each
    rank saves its shards: tensors that carry ``tensor_parallel_sharding``
    (``strata.nn`` parameters, their ``state_dict()`` tensors and optimizer
    states) and the tensor-parallel parameters and optimizer states of
    modules and optimizers given as objects, as boxes of the global tensor;
    every other tensor as replicated over the ranks of its pipeline stage
    (written once, the writing spread across the replicas). Before staging,
    :meth:`save` checks that replicas are equal across the ranks that hold
    them (on the caller's thread, with the world's groups, within
    ``commit_timeout``) and raises on every rank, naming the tensor and the
    ranks, when they are not: nothing is written then. The structure of
    ``state`` and its plain values are taken from rank 0.

    Thread-safe; use as a context manager or call :meth:`close`.
    """

    def __init__(self, directory, *, world=None, keep_last=None, on_busy="wait",
                 busy_timeout=1800.0, on_failure="raise", checksum="xxh3-128",
                 chunk_bytes=16 << 20, max_file_bytes=None, commit_timeout=600.0,
                 staging_threads=None, io_priority="low", rng=True, _fail_at=None,
                 _test_hook=None):
        self._placement = T.Placement(world)
        # The placement (this rank, its replica indices) is the world's at one
        # generation: save() takes it again after a rebuild.
        self._generation = world.generation if world is not None else None
        self.directory = str(directory)
        self._rng = rng
        self._check_timeout = commit_timeout
        self._check_threads = staging_threads or max(1, min(4, os.cpu_count() or 1))
        self._check_seconds = 0.0
        # strata.metrics of the world: time save() blocks, bytes of saves
        # seen committed (checked at each save, wait, close).
        self._metrics = getattr(world, "metrics", None)
        self._accounted_step = None
        self._impl = _strata._Checkpointer(
            self.directory, keep_last=keep_last or 0, checksum=checksum, chunk_bytes=chunk_bytes,
            max_file_bytes=max_file_bytes or 0, on_busy=on_busy, busy_timeout=busy_timeout,
            on_failure=on_failure, commit_timeout=commit_timeout,
            staging_threads=staging_threads or 0, io_priority=io_priority, fail_at=_fail_at,
            split_from=self._placement.group, test_hook=_test_hook)

    def _warn(self):
        for message in self._impl.take_warnings():
            warnings.warn(message, CheckpointWarning, stacklevel=3)

    def save(self, state, *, step, optimizer_step=None, data_loader=None, mesh=None):
        """Stages ``state`` as checkpoint ``step`` and starts writing it.

        Returns once every tensor is copied: training may then change them.
        ``optimizer_step`` (int) and ``data_loader`` (JSON-able position) are
        recorded in the manifest's training state (``data_loader`` per
        rank); ``mesh`` is a ``strata.Mesh`` to record (default: the world's).
        """
        self._account()  # the previous save, while its figures are the last ones
        t0, t0_ns = time.perf_counter(), time.time_ns()
        try:
            self._save(state, step, optimizer_step, data_loader, mesh)
        finally:
            timeline = getattr(self._placement.world, "timeline", None)
            if timeline is not None:
                timeline._checkpoint_staged(step, t0_ns, time.time_ns())
            if self._metrics is not None:
                self._metrics.record_checkpoint_blocked(time.perf_counter() - t0)
            self._account()

    def _account(self):
        """Adds the bytes of a save committed since the last look to
        strata_checkpoint_write_bytes_total, and its write and commit to
        the world's timeline."""
        timeline = getattr(self._placement.world, "timeline", None)
        if self._metrics is None and timeline is None:
            return
        st = self._impl.status()
        last = st.get("last_committed_step")
        if last is not None and last >= 0 and last != self._accounted_step:
            self._accounted_step = last
            if self._metrics is not None:
                self._metrics.record_checkpoint_write(st.get("bytes_written") or 0)
            if timeline is not None and st.get("last_step") == last:
                timeline._checkpoint_written(last, st.get("write_seconds") or 0.0,
                                             st.get("commit_seconds") or 0.0)

    def _save(self, state, step, optimizer_step, data_loader, mesh):
        world = self._placement.world
        if world is not None and world.generation != self._generation:
            self._placement = T.Placement(world)  # collective, as save() is
            self._generation = world.generation
        shards, keep_alive = [], []
        cuda, failure = False, None
        try:
            if not isinstance(state, dict):
                raise _error(f"state must be a dict, not {type(state).__name__}")
            flat = _Flattener(T.param_names(state))
            tree = flat.encode(state, [])
            for key, t in flat.tensors.items():
                s, t = self._placement.shard(key, t, flat.specs.get(key))
                shards.append(s)
                keep_alive.append((key, flat.specs.get(key), t))
                cuda = cuda or t.is_cuda
        except Exception as e:  # noqa: BLE001: raised on every rank by agree()
            failure = e
        # A rank that cannot save makes every rank fail here, rather than
        # leaving them waiting in the collectives below.
        self._placement.agree(failure, doing=f"prepare its part of checkpoint step {step}")
        # Before anything is staged: replicas that differ fail the save on
        # every rank, naming the tensor and the ranks.
        self._check_seconds = self._placement.check_replicas(
            step, keep_alive, self._check_timeout, self._check_threads)
        extra = {_TREE_KEY: _TREE_VERSION, "tree": tree}
        plain = {"extra": json.dumps(extra, allow_nan=False)}
        if optimizer_step is not None:
            plain["optimizer_step"] = int(optimizer_step)
        if data_loader is not None:
            plain["data_loader"] = json.dumps(data_loader)
        if self._rng:
            plain["rng_states"] = _capture_rng()
        if mesh is None and self._placement.world is not None:
            mesh = self._placement.world.mesh
        if mesh is not None:
            plain["mesh"] = mesh.spec()
        stream = torch.cuda.current_stream().cuda_stream if cuda else 0
        try:
            self._impl.save(int(step), shards, plain, stream)
        finally:
            self._warn()
        del keep_alive  # staged: the tensors may change from here on

    def wait(self, timeout=None):
        """Blocks until no save is in flight (``timeout`` seconds at most, None:
        no limit); raises the failure of the last save, once."""
        try:
            self._impl.wait(timeout)
        finally:
            self._warn()
            self._account()

    def status(self):
        """A dict: ``state`` ("idle", "staging", "writing"), ``step_in_flight``,
        ``last_committed_step``, ``pending_error``, and the last save's
        ``staging_seconds`` (time save() blocked), ``write_seconds``,
        ``commit_seconds``, ``bytes_written``, ``files_written``, and
        ``replica_check_seconds`` (the part of save() spent checking that
        replicated tensors are equal across their ranks; 0 alone)."""
        self._warn()
        st = self._impl.status()
        st["replica_check_seconds"] = self._check_seconds
        return st

    def close(self, timeout=None):
        """Waits for a save in flight and stops the writer thread."""
        try:
            self._impl.close(timeout)
        finally:
            self._warn()
            self._account()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def save(state, directory, *, step, world=None, **options):
    """Saves ``state`` as checkpoint ``step`` in ``directory`` and waits until
    it is committed. ``options`` are those of :class:`AsyncCheckpointer` and
    ``optimizer_step``, ``data_loader``, ``mesh`` of its ``save``."""
    save_kw = {k: options.pop(k) for k in ("optimizer_step", "data_loader", "mesh") if k in options}
    with AsyncCheckpointer(directory, world=world, **options) as saver:
        saver.save(state, step=step, **save_kw)
        saver.wait()


# ---- loading ----------------------------------------------------------------------


def _open(directory, step, verify, read_buffer_bytes=64 << 20, group=None, timeout=600.0,
          merge_gap_bytes=256 << 10):
    return _strata._CheckpointReader(str(directory), step=-1 if step is None else int(step),
                                     verify=verify, read_buffer_bytes=read_buffer_bytes,
                                     comm=group, timeout=timeout, merge_gap_bytes=merge_gap_bytes)


def _tree(reader):
    extra = reader.state(0)["extra"]
    doc = json.loads(extra) if extra else {}
    if isinstance(doc, dict) and doc.get(_TREE_KEY) == _TREE_VERSION:
        return doc["tree"]
    if isinstance(doc, dict) and _TREE_KEY in doc:
        raise _error(f"the checkpoint's Python structure has version {doc[_TREE_KEY]}; this "
                     f"strata reads version {_TREE_VERSION}", code="UNIMPLEMENTED")
    # Saved by the C++ API: a flat dict of the tensors.
    return {key: {"__tensor__": key} for key, _, _ in reader.tensors()}


def _names(keys, limit=8):
    keys = sorted(keys)
    s = ", ".join(f"'{k}'" for k in keys[:limit])
    return s + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load(directory, state=None, *, step=None, world=None, verify=True, strict=True,
         restore_rng=False, training_state=None, timeout=600.0, merge_gap_bytes=256 << 10):
    """Loads checkpoint ``step`` (default: the one ``latest`` names).

    With ``state=None``, returns the saved state as a new nested dict (tensors
    on the CPU; modules and optimizers as their state dicts). With a ``state``
    dict, loads into it, in place, and returns it (the same object), as
    torch.distributed.checkpoint.load does: every tensor in it, at any depth
    (``model.state_dict()``, ``{"model": model.state_dict(), "optim":
    opt.state_dict()}``), and the parameters and buffers of modules, are
    filled in their own memory (no extra copy for CPU tensors), so loading
    into ``model.state_dict()`` changes the model; dicts and lists keep their
    identity and get the saved plain values (and tensors they lack, which
    are new); optimizers and schedulers get ``load_state_dict``.

    ``strict`` (default) requires every tensor of the given state to be in
    the checkpoint and no other tensor under its names (under a dict or list
    entry, saved tensors it lacks are added instead), and every entry of
    ``state`` to be in the checkpoint. ``verify`` checks the checksums of
    what is read. ``restore_rng`` restores the torch, numpy and Python RNG
    states saved with the checkpoint (this rank's).

    ``world``: a ``strata.World`` for a collective load (every rank calls
    it; each waits at most ``timeout`` seconds for the others). Rank 0
    resolves the step, so all ranks load the same one; each rank reads only
    the byte ranges its own tensors need, resharded to its current layout:
    a tensor that carries its shard layout (``model.state_dict()`` of
    ``strata.nn`` layers, the optimizer states made from their parameters),
    the tensor-parallel parameters of modules and the states of optimizers
    passed as objects get this rank's box of the global tensor whatever tp
    the checkpoint was saved with; other tensors are loaded whole. A tensor
    saved in shards under a dict entry that has no tensor for it cannot be
    loaded (nothing says which box this rank holds): an error names it (an
    optimizer's ``state_dict()`` has no states before its first step; pass
    the optimizer itself then). An error on any rank raises on every rank.

    ``training_state``: a dict to fill with what was recorded beside the
    tensors: ``step``, ``optimizer_step``, ``data_loader`` (this rank's),
    ``mesh``, ``library_version``, and ``bytes_read``/``bytes_verified`` of
    this rank's load. ``merge_gap_bytes``: needed byte ranges of a file
    closer than this are read with one call (0: read exactly what is needed).
    """
    placement = T.Placement(world)
    reader = _open(directory, step, verify, group=placement.group, timeout=timeout,
                   merge_gap_bytes=merge_gap_bytes)
    failure = plan = targets = None
    try:
        plan = _LoadPlan(reader, state, strict, placement)
        targets = plan.targets()
    except Exception as e:  # noqa: BLE001: raised on every rank by agree()
        failure = e
    placement.agree(failure)
    if placement.group is not None and strict:  # on every rank: it is collective
        _check_unexpected_globally(reader, placement, targets, plan.unasked)
    report = reader.load(targets)
    own = reader.state(placement.rank)  # per-rank fields empty for a rank the save had not
    if restore_rng:
        _restore_rng(own["rng_states"])
    if training_state is not None:
        training_state.update({
            "step": reader.step,
            "optimizer_step": None if own["optimizer_step"] < 0 else own["optimizer_step"],
            "data_loader": json.loads(own["data_loader"]) if own["data_loader"] else None,
            "mesh": reader.state(0)["mesh"],
            "library_version": own["library_version"] or reader.info()["library_version"],
            "bytes_read": report["bytes_read"],
            "bytes_verified": report["bytes_verified"],
        })
    tree, tensors = plan.tree, plan.tensors
    if state is None:
        return _decode(tree, tensors)
    with torch.no_grad():
        for dst, tmp in plan.after:
            dst.copy_(tmp)
    for name, obj in list(state.items()):
        if name not in tree or isinstance(obj, (torch.nn.Module, torch.Tensor)):
            continue
        if name in plan.templates:
            obj.strata_load_sharded_state_dict(plan.templates[name],
                                               _decode(tree[name], plan.loaded()))
            continue
        if isinstance(obj, torch.optim.Optimizer) and T.is_named_optimizer(tree[name]):
            obj.load_state_dict(T.load_named_optimizer(obj, T.param_names(state), tree[name],
                                                       tensors, name))
            continue
        if isinstance(obj, (dict, list, tuple)):
            # Filled in place; the structure keeps its dicts and lists.
            state[name] = T.merge_into(obj, _decode(tree[name], plan.loaded()))
            continue
        value = _decode(tree[name], tensors)
        if _state_dict_of(obj) is not None and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(value)
        else:
            state[name] = value
    return state


def _check_unexpected_globally(reader, placement, targets, unasked):
    """Strictness across ranks: a saved tensor under a module entry is
    unexpected only when no rank asked for it (under a pipeline split each
    stage asks for its own layers). Collective; every rank raises alike."""
    keys = sorted(key for key, _, _ in reader.tensors())
    asked = {t[0] for t in targets}
    mark = torch.tensor([1 if k in asked else 0 for k in keys], dtype=torch.int32)
    if mark.numel():
        placement.group.all_reduce(mark, op="max")
    unexpected = [k for k, m in zip(keys, mark.tolist()) if not m and k in unasked]
    if unexpected:
        raise _error(f"checkpoint step {reader.step} has {len(unexpected)} tensor(s) that no rank "
                     f"asked for: {_names(unexpected)} (strict=False ignores them)")


class _LoadPlan:
    """What this rank reads, and into what, to load ``state`` (None: the
    whole checkpoint, as new tensors): ``tensors`` {key: tensor the reader
    fills}, ``after`` [(destination, tmp)] copies for destinations the
    reader cannot fill directly (not CPU, not contiguous), ``tree`` the
    saved structure, ``unasked`` saved keys to check for unexpectedness
    across ranks (under ``world=``, a saved tensor under an entry that this
    rank does not hold may be another stage's). Raises what is wrong with
    ``state`` for this checkpoint."""

    def __init__(self, reader, state, strict, placement):
        self.reader, self.strict = reader, strict
        self.collective = placement.group is not None
        self.pipeline_split = placement.pipeline_split()
        self.unasked = set()
        self.tree = _tree(reader)
        self.saved = {key: (dtype, shape) for key, dtype, shape in reader.tensors()}
        self.tensors = {}  # key -> CPU tensor filled by the load
        self.boxes = {}    # key -> (global shape, offset) of a shard; absent: whole
        self.after = []    # (destination, cpu tensor) copies after the load
        self.given = {}    # key -> the tensor of `state` it loads into
        # entry -> what its strata_sharded_state_dict gave, filled by the load
        self.templates = {}
        self._shard_counts = None
        if state is None:
            for key in _tensor_keys(self.tree, []):
                self._fresh(key)
            return
        if not isinstance(state, dict):
            raise _error(f"state must be a dict or None, not {type(state).__name__}")
        if not isinstance(self.tree, dict):
            raise _error("the checkpoint does not hold a dict at its root; load it with state=None")
        self._check_entries(state)
        names = T.param_names(state)
        for name, obj in state.items():
            if isinstance(obj, (torch.nn.Module, torch.Tensor)):
                self._module_or_tensor(name, obj)
            elif name not in self.tree:
                continue
            elif callable(getattr(obj, "strata_sharded_state_dict", None)):
                self._self_sharded(name, obj, names)
            elif isinstance(obj, torch.optim.Optimizer) and T.is_named_optimizer(self.tree[name]):
                self._named_optimizer(name, obj, names)
            elif isinstance(obj, (dict, list, tuple)):
                self._container(name, obj)
            else:
                # Optimizers and the like: the saved structure says what there
                # is; the object's parameters say which states are shards.
                hints = T.Hints(names)
                hints.add(obj, [name])
                for path, key in T.tensor_paths(self.tree[name], [name], []):
                    self._fresh(key, hints.get(path))

    def targets(self):
        """The reader's targets: (key, dtype, global shape, local shape,
        offset, data pointer)."""
        out = []
        for key, t in self.tensors.items():
            if t.dtype not in _DTYPES:
                raise _error(f"tensor '{key}' has dtype {t.dtype}, which a checkpoint does not "
                             "hold")
            shape = list(t.shape)
            glob, offset = self.boxes.get(key, (shape, [0] * len(shape)))
            out.append((key, _DTYPES[t.dtype], glob, shape, offset, t.data_ptr()))
        return out

    def loaded(self):
        """{key: tensor} for rebuilding the state: the given tensors where
        the load filled them, new ones elsewhere; T.ABSENT for keys this
        rank did not load."""
        return T.Loaded({**self.tensors, **self.given})

    def _in_entry(self, name):
        return {k for k in self.saved if k == name or k.startswith(name + ".")}

    def _check_entries(self, state):
        step = self.reader.step
        # A tensor entry (a flat state dict's) is found by its key: under a
        # pipeline split rank 0's structure holds only its stage's.
        missing = [k for k, v in state.items() if k not in self.tree
                   and not (isinstance(v, torch.Tensor) and self._in_entry(k))]
        if self.strict and missing:
            raise _error(f"entries {_names(missing)} of state are not in checkpoint step {step} "
                         "(strict=False skips them)", code="NOT_FOUND")
        unexpected = []
        for k, node in self.tree.items():
            if k in state:
                continue
            if self.collective and isinstance(node, dict) and set(node) == {"__tensor__"}:
                self.unasked.add(node["__tensor__"])  # another stage's, or no rank's
            else:
                unexpected.append(k)
        if self.collective:
            # Saved tensors under no entry of rank 0's structure: other
            # stages' entries of a flat state dict. Unexpected when no rank
            # asks for them.
            for key in self.saved:
                parts = key.split(".")
                if not any(".".join(parts[:i]) in self.tree for i in range(1, len(parts) + 1)):
                    self.unasked.add(key)
        if self.strict and unexpected:
            raise _error(f"checkpoint step {step} has entries {_names(unexpected)} that state "
                         "does not (strict=False ignores them)")

    def _fresh(self, key, hint=None):
        """A new tensor for ``key``: this rank's box when ``hint`` (spec,
        parameter) says the saved tensor has that parameter's layout, else
        the whole tensor."""
        dtype, shape = self.saved[key]
        local, box = list(shape), None
        if hint is not None:
            spec, param = hint
            glob, offset = T.global_box(param.shape, spec)
            if glob == list(shape):  # a state of the parameter's layout
                local, box = list(param.shape), (glob, offset)
        t = torch.empty(local, dtype=_TORCH_DTYPES[dtype])
        self.tensors[key] = t
        if box is not None:
            self.boxes[key] = box
        return t

    def _into(self, key, dst, spec):
        """Loads ``key`` into ``dst`` (a tensor of the state), in place;
        ``spec``: the box of the global tensor it holds, or None (whole)."""
        if spec is not None:
            self.boxes[key] = T.global_box(dst.shape, spec)
        if dst.device.type == "cpu" and dst.is_contiguous():
            self.tensors[key] = dst.detach()  # filled in place
        else:
            tmp = torch.empty(dst.shape, dtype=dst.dtype)
            self.tensors[key] = tmp
            self.after.append((dst, tmp))
        self.given[key] = dst

    def _missing(self, keys):
        if self.strict and keys:
            raise _error(f"{len(keys)} tensor(s) missing from checkpoint step {self.reader.step}: "
                         f"{_names(keys)} (strict=False skips them)", code="NOT_FOUND")

    def _module_or_tensor(self, name, obj):
        # From the manifest, not rank 0's tree: under a pipeline split rank 0
        # saved only its stage's layers.
        saved_keys = self._in_entry(name)
        flat = _Flattener()
        want = flat.encode(obj, [name])
        want_keys = _tensor_keys(want, [])
        self._missing([k for k in want_keys if k not in self.saved])
        unexpected = saved_keys - set(want_keys)
        if self.strict and unexpected and self.collective:
            self.unasked |= unexpected
        elif self.strict and unexpected:
            raise _error(f"checkpoint step {self.reader.step} has {len(unexpected)} tensor(s) "
                         f"under '{name}' that the state does not: {_names(unexpected)} "
                         "(strict=False ignores them)")
        for key in want_keys:
            if key in self.saved:
                self._into(key, flat.tensors[key], flat.specs.get(key))

    def _self_sharded(self, name, obj, names):
        """An object that lays out its own shards
        (strata.optim.DistributedOptimizer): its current layout says which
        box of each tensor to read."""
        template = obj.strata_sharded_state_dict(names, for_load=True)
        self.templates[name] = template
        mine = T.sharded_tensors(template, [name], [])
        missing = [key for key, _, _ in mine if key not in self.saved]
        if self.strict and missing:
            raise _error(f"{len(missing)} tensor(s) of '{name}' missing from checkpoint "
                         f"step {self.reader.step}: {_names(missing)} (strict=False skips them)",
                         code="NOT_FOUND")
        for key, dst, box in mine:
            if key not in self.saved:
                continue
            dtype, shape = self.saved[key]
            if tuple(shape) != box.global_shape:
                raise _error(f"tensor '{key}' was saved with global shape {tuple(shape)}; "
                             f"'{name}' now needs {box.global_shape} (its layout reshards "
                             "across data-parallel sizes, not tensor-parallel ones)")
            self.boxes[key] = (list(box.global_shape), list(box.global_offset))
            if (dst.device.type == "cpu" and dst.is_contiguous()
                    and _TORCH_DTYPES[dtype] == dst.dtype):
                self.tensors[key] = dst.detach()  # filled in place
            else:
                tmp = torch.empty(dst.shape, dtype=_TORCH_DTYPES[dtype])
                self.tensors[key] = tmp
                self.after.append((dst, tmp))
        others = {k for k in self.saved if k.startswith(name + ".")} - {k for k, _, _ in mine}
        if self.strict and others and self.collective:
            self.unasked |= others  # other ranks' pieces, other stages' parameters

    def _named_optimizer(self, name, obj, names):
        # Keyed by parameter name: this rank's parameters say what to read,
        # from the manifest (rank 0's structure holds only the parameters of
        # its pipeline stage).
        hints = T.Hints(names)
        hints.add(obj, [name])
        own = {names[id(p)] for p in T.optimizer_params(obj) if id(p) in names}
        mine = T.named_state_keys(name, self.saved, own)
        for key, (param, field) in mine.items():
            self._fresh(key, hints.get([name, "state", param, field]))
        # States of parameters this optimizer does not hold: under a pipeline
        # split, another stage's; unexpected only when no rank asks for them.
        others = set(T.named_state_keys(name, self.saved)) - set(mine)
        if self.strict and others and self.collective:
            self.unasked |= others
        elif self.strict and others:
            raise _error(f"checkpoint step {self.reader.step} has {len(others)} state "
                         f"tensor(s) of '{name}' for parameters it does not hold: "
                         f"{_names(others)} (strict=False ignores them)")

    def _container(self, name, obj):
        """A dict, list or tuple of the state (``model.state_dict()``,
        ``opt.state_dict()``): its tensors are loaded in place, each as the
        box its own layout says; saved tensors it lacks are loaded new."""
        flat = _Flattener()
        flat.encode(obj, [name])
        saved_at = dict(T.tensor_paths(self.tree[name], [name], []))  # path -> key
        keys = {}  # key of each given tensor
        for k, path in flat.paths.items():
            keys[saved_at.get(path, k)] = flat.tensors[k], flat.specs.get(k)
        self._missing([k for k in keys if k not in self.saved])
        for key, (dst, spec) in keys.items():
            if key in self.saved:
                self._into(key, dst, spec)
        lacking = []
        for key in saved_at.values():
            if key in keys or key not in self.saved:
                continue
            if self.pipeline_split:
                # Rank 0's structure is its stage's: whether another rank
                # holds the tensor is for the check across ranks.
                self.unasked.add(key)
            elif self.collective and self._shards(key) > 1:
                lacking.append(key)
            else:
                self._fresh(key)
        if self.pipeline_split:
            self.unasked |= self._in_entry(name) - set(keys)
        if self.strict and lacking:
            raise _error(
                f"checkpoint step {self.reader.step} has {len(lacking)} tensor(s) under '{name}' "
                f"saved in shards that the state has no tensor for: {_names(lacking)}. A tensor "
                "to load into says which box of the global tensor this rank holds; without one "
                "there is no telling (an optimizer's state_dict() has no states before its first "
                "step: put the optimizer object in the state instead of its state_dict(), as "
                "{'optim': optimizer}; it knows its parameters) (strict=False skips them)",
                code="NOT_FOUND")

    def _shards(self, key):
        if self._shard_counts is None:
            self._shard_counts = self.reader.shard_counts()
        return self._shard_counts.get(key, 1)


def info(directory, *, step=None):
    """What a checkpoint holds, without reading its data: a dict with
    ``step``, ``created``, ``library_version``, ``world_size``, ``checksum``,
    ``directory``, ``bytes``, ``files``, ``tensors`` ({key: (dtype, shape)}),
    and the training state (``optimizer_step``, ``data_loader``, ``mesh``)."""
    reader = _open(directory, step, verify=False)
    d = reader.info()
    d["tensors"] = {k: (_TORCH_DTYPES[t], tuple(s)) for k, t, s in reader.tensors()}
    st = reader.state(0)
    d["optimizer_step"] = None if st["optimizer_step"] < 0 else st["optimizer_step"]
    d["data_loader"] = json.loads(st["data_loader"]) if st["data_loader"] else None
    d["mesh"] = st["mesh"]
    return d


def verify(directory, *, step=None):
    """Checks every file of a checkpoint (sizes, checksums, headers); returns
    the list of problems found (empty when it is intact)."""
    return _open(directory, step, verify=True).verify()


def latest_step(directory):
    """The step ``latest`` names, or None when there is no committed checkpoint."""
    return _strata._latest_checkpoint_step(str(directory))


def list_steps(directory):
    """Steps with a complete checkpoint in ``directory``, ascending."""
    return _strata._checkpoint_steps(str(directory))


def load_safetensors(path):
    """Reads a safetensors file (any writer's) with strata's hardened parser;
    returns {name: CPU tensor}."""
    f = _strata._SafetensorsFile(str(path))
    out = {}
    for name, dtype, shape in f.tensors():
        t = torch.empty(shape, dtype=_TORCH_DTYPES[dtype])
        f.read(name, t.data_ptr(), t.numel() * t.element_size())
        out[name] = t
    return out
