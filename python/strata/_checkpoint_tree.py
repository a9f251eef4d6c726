"""The state tree of strata.checkpoint and where this rank's tensors sit in
the global tensors (private to :mod:`strata.checkpoint`).

A state dict is flattened into JSON-able structure (stored in the manifest)
plus ``{key: tensor}``; keys are dotted paths. Each tensor is either whole
(the same on every rank of its tensor/data-parallel group: written once,
the writing spread over the replicas, after a check that the replicas are
equal) or a shard of a larger tensor: one that carries
``tensor_parallel_sharding = (dim, index, count)`` (``strata.nn``'s
ShardedParameters, and the tensors ``detach()``, ``clone()`` and
``*_like`` make of them: ``model.state_dict()``'s and Adam's ``exp_avg``),
a parameter so marked found through its module, or an optimizer state of
the same shape as such a parameter found through its optimizer.
"""

import base64
import math
import time

import torch

from . import _strata
from .axes import Axis
from .errors import CheckpointError

# strata::DataType values.
DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.uint8: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.int16: 8,
    torch.bool: 9,
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


class Box(tuple):
    """An explicit place for a tensor in a checkpoint, carried as the
    tensor's ``checkpoint_box`` attribute by objects that lay out their own
    shards (strata.optim.DistributedOptimizer): the tensor is the box at
    ``global_offset`` of a tensor of ``global_shape``; ``write`` says
    whether this rank writes it (exactly one rank writes each box; the
    others may still read it on load). Objects with such tensors provide
    ``strata_sharded_state_dict(names, for_load)`` and
    ``strata_load_sharded_state_dict(filled, saved)``; see
    :func:`sharded_tensors`."""

    def __new__(cls, global_shape, global_offset, write=True):
        return super().__new__(cls, (tuple(int(d) for d in global_shape),
                                     tuple(int(d) for d in global_offset), bool(write)))

    global_shape = property(lambda self: self[0])
    global_offset = property(lambda self: self[1])
    write = property(lambda self: self[2])


def sharded_tensors(node, path, out):
    """[(key, tensor, Box)] of the tensors of a state dict made by
    ``strata_sharded_state_dict`` (plain dicts and lists), keyed as
    Flattener keys them."""
    if isinstance(node, torch.Tensor):
        box = getattr(node, "checkpoint_box", None)
        if box is not None:
            out.append((".".join(path), node, box))
    elif isinstance(node, dict):
        for k, v in node.items():
            sharded_tensors(v, path + [str(k)], out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            sharded_tensors(v, path + [str(i)], out)
    return out


def error(message, code="INVALID_ARGUMENT"):
    e = CheckpointError(message)
    e.code = code
    return e


def state_dict_of(obj):
    """The state dict of a module, optimizer, scheduler, ...; None for plain values."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if hasattr(obj, "state_dict") and callable(obj.state_dict) and not isinstance(obj, type):
        return obj.state_dict()
    return None


def _sharding(t):
    return getattr(t, "tensor_parallel_sharding", None)


def checked_sharding(key, spec, shape):
    """``spec`` as (dim, index, count) ints, or a CheckpointError naming
    ``key`` when it cannot describe a shard of ``shape``."""
    try:
        dim, index, count = (int(v) for v in spec)
        ok = 0 <= dim < len(shape) and 0 <= index < count
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise error(f"tensor '{key}' has tensor_parallel_sharding {spec!r}, which is not "
                    f"(dim, index, count) with 0 <= dim < {len(shape)} (its shape is "
                    f"{tuple(shape)}) and 0 <= index < count")
    return dim, index, count


def module_hints(module, path):
    """{path of a state-dict entry: (dim, index, count)} for the sharded
    parameters of ``module`` saved at ``path``."""
    return {tuple(path + [name]): _sharding(p)
            for name, p in module.named_parameters(remove_duplicate=False)
            if _sharding(p) is not None}


def param_names(state):
    """{id(parameter): name} for the parameters of the modules among the
    entries of ``state`` (a dict), each named by its path in the saved tree
    (``model.layers.5.weight``); a parameter shared by several names keeps
    the first."""
    names = {}
    if isinstance(state, dict):
        for entry, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                for name, p in obj.named_parameters(remove_duplicate=False):
                    names.setdefault(id(p), f"{entry}.{name}")
    return names


def optimizer_params(opt):
    """The optimizer's parameters in the order its state dict numbers them."""
    return [p for g in opt.param_groups for p in g["params"]]


def named_optimizer_state(opt, names):
    """``opt``'s state dict with its parameters named instead of numbered
    (as torch.distributed.checkpoint does): ``state`` keyed by parameter
    name, ``param_groups[i]["params"]`` lists of names. None when a
    parameter has no name in ``names`` (or two share one): the numbered form
    is saved then."""
    fq = [names.get(id(p)) for p in optimizer_params(opt)]
    if not fq or any(n is None for n in fq) or len(set(fq)) != len(fq):
        return None
    sd = opt.state_dict()
    return {"state": {fq[i]: v for i, v in sd["state"].items()},
            "param_groups": [dict(g, params=[fq[i] for i in g["params"]])
                             for g in sd["param_groups"]]}


def numbered_optimizer_state(opt, names, saved_groups, states):
    """The state dict for ``opt.load_state_dict`` from a named one: this
    optimizer's own groups (their parameters numbered as it numbers them)
    with the hyperparameters of the saved group that held the same
    parameters (else the saved group of the same index), and ``states``
    ({parameter name: {field: value}}) for the parameters it has."""
    params = optimizer_params(opt)
    index = {}
    for i, p in enumerate(params):
        name = names.get(id(p))
        if name is None:
            raise error("cannot load a checkpoint that keys optimizer states by parameter "
                        f"name: the optimizer's parameter {i} (shape {tuple(p.shape)}) belongs "
                        "to no module of the state being loaded, so it has no name; load the "
                        "optimizer together with its model")
        index[name] = i
    own = opt.state_dict()["param_groups"]
    groups = []
    for gi, g in enumerate(own):
        mine = {names[id(params[i])] for i in g["params"]}
        match = next((sg for sg in saved_groups if mine & set(sg.get("params", []))), None)
        if match is None and gi < len(saved_groups):
            match = saved_groups[gi]
        merged = dict(g)
        if match is not None:
            merged.update({k: v for k, v in match.items() if k != "params"})
        merged["params"] = g["params"]
        groups.append(merged)
    return {"state": {index[n]: v for n, v in states.items() if n in index},
            "param_groups": groups}


def is_named_optimizer(node):
    """Whether a saved tree node is an optimizer saved in the named form."""
    return isinstance(node, dict) and len(node) == 1 and "__optimizer__" in node


def named_state_keys(entry, saved_keys, names=None):
    """{key: (parameter name, field)} of the saved tensors of the named
    optimizer at ``entry`` that belong to parameters in ``names`` (a set;
    None: every parameter)."""
    prefix = entry + ".state."
    out = {}
    for key in saved_keys:
        if key.startswith(prefix):
            name, _, field = key[len(prefix):].rpartition(".")
            if names is None or name in names:
                out[key] = (name, field)
    return out


class _Loaded(dict):
    def __missing__(self, key):  # a tensor another rank's structure names
        return None


def load_named_optimizer(opt, names, node, tensors, entry):
    """The state dict for ``opt.load_state_dict`` from the named form saved
    at ``entry`` (``node``, the saved tree's entry): the tensors this rank
    loaded (``tensors``) for its parameters, plain per-parameter values and
    group hyperparameters from the saved structure."""
    saved = node["__optimizer__"]
    own = set(names[id(p)] for p in optimizer_params(opt) if id(p) in names)
    states = {}
    for key, (name, field) in named_state_keys(entry, tensors, own).items():
        states.setdefault(name, {})[field] = tensors[key]
    for name, fields in (saved.get("state") or {}).items():
        if name in own and isinstance(fields, dict):
            for field, value in fields.items():
                if not (isinstance(value, dict) and "__tensor__" in value):
                    states.setdefault(name, {}).setdefault(field, decode(value, {}))
    groups = decode(saved.get("param_groups") or [], _Loaded(tensors))
    return numbered_optimizer_state(opt, names, groups, states)


class Hints:
    """Which saved paths are shards: module parameters by path, optimizer
    states by the parameter they belong to (a numbered state dict numbers
    parameters in the order of ``param_groups``, a named one names them as
    ``param_names`` does; only states of the parameter's shape, like Adam's
    ``exp_avg``, share its layout: the caller checks shapes)."""

    def __init__(self, names=None):
        self._paths = {}       # path tuple -> spec
        self._optimizers = []  # (path prefix + ("state",), [params], {name: param})
        self._names = names or {}

    def add(self, obj, path):
        if isinstance(obj, torch.nn.Module):
            self._paths.update(module_hints(obj, path))
        elif isinstance(obj, torch.optim.Optimizer):
            params = optimizer_params(obj)
            by_name = {self._names[id(p)]: p for p in params if id(p) in self._names}
            self._optimizers.append((tuple(path) + ("state",), params, by_name))

    def get(self, path):
        """(spec, parameter or None) for a tensor at ``path``, or None."""
        path = tuple(path)
        spec = self._paths.get(path)
        if spec is not None:
            return spec, None
        for prefix, params, by_name in self._optimizers:
            n = len(prefix)
            if len(path) != n + 2 or path[:n] != prefix:
                continue
            param = by_name.get(path[n])
            if param is None and path[n].isdigit() and int(path[n]) < len(params):
                param = params[int(path[n])]
            if param is not None and _sharding(param) is not None:
                return _sharding(param), param
        return None


def global_box(shape, spec):
    """(global shape, offset) of a local tensor of ``shape`` that is shard
    ``spec`` = (dim, index, count), or of a whole tensor (spec None)."""
    shape = list(shape)
    offset = [0] * len(shape)
    if spec is None:
        return shape, offset
    dim, index, count = spec
    glob = list(shape)
    glob[dim] = shape[dim] * count
    offset[dim] = shape[dim] * index
    return glob, offset


class Flattener:
    """Turns a state tree into JSON-able structure plus {key: tensor}, and
    records {key: (dim, index, count)} for the tensors that are shards."""

    def __init__(self, names=None):
        self.tensors = {}
        self.specs = {}
        self.paths = {}  # key -> path (tuple) it was found at
        self.names = names or {}  # param_names() of the state being saved
        self.hints = Hints(self.names)

    def _key(self, path):
        base = ".".join(path) if path else "tensor"
        key, n = base, 1
        while key in self.tensors:  # {"a.b": t, "a": {"b": u}} both map to "a.b"
            key = f"{base}~{n}"
            n += 1
        return key

    def encode(self, obj, path):
        if isinstance(obj, torch.Tensor):
            key = self._key(path)
            box = getattr(obj, "checkpoint_box", None)
            if isinstance(box, Box):  # laid out by its owner; another rank may write it
                if box.write:
                    self.tensors[key] = obj
                    self.specs[key] = box
                return {"__tensor__": key}
            self.tensors[key] = obj
            self.paths[key] = tuple(path)
            own = _sharding(obj)  # the tensor's own layout comes first
            hint = self.hints.get(path) if own is None else (own, None)
            if hint is not None:
                spec, param = hint
                if param is None or tuple(obj.shape) == tuple(param.shape):
                    self.specs[key] = checked_sharding(key, spec, obj.shape)
            return {"__tensor__": key}
        if callable(getattr(obj, "strata_sharded_state_dict", None)) and not isinstance(obj, type):
            return self.encode(obj.strata_sharded_state_dict(self.names), path)
        self.hints.add(obj, path)
        if isinstance(obj, torch.optim.Optimizer):
            named = named_optimizer_state(obj, self.names)
            if named is not None:
                return {"__optimizer__": self.encode(named, path)}
        sd = state_dict_of(obj)
        if sd is not None:
            return self.encode(sd, path)
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj if -(2**63) <= obj < 2**63 else {"__int__": str(obj)}
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.Size):
            return {"__tuple__": [int(d) for d in obj]}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, path + [str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: self.encode(v, path + [k]) for k, v in obj.items()}
            return {"__dict__": [[self.encode(k, path + ["key"]), self.encode(v, path + [str(k)])]
                                 for k, v in obj.items()]}
        raise error(f"cannot save {type(obj).__name__} at '{'.'.join(path) or '<root>'}': a "
                    "checkpoint holds tensors, objects with state_dict(), and None, bool, int, "
                    "float, str, bytes, list, tuple and dict")


def decode(node, tensors):
    """Rebuilds a tree; tensors[key] supplies each tensor."""
    if isinstance(node, list):
        return [decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if len(node) == 1:
            (k, v), = node.items()
            if k == "__tensor__":
                return tensors[v]
            if k == "__optimizer__":  # named: returned as saved
                return decode(v, tensors)
            if k == "__tuple__":
                return tuple(decode(x, tensors) for x in v)
            if k == "__dict__":
                return {decode(a, tensors): decode(b, tensors) for a, b in v}
            if k == "__int__":
                return int(v)
            if k == "__float__":
                return float(v)
            if k == "__bytes__":
                return base64.b64decode(v)
        return {k: decode(v, tensors) for k, v in node.items()}
    return node


class _Absent:
    def __repr__(self):
        return "<not loaded on this rank>"


ABSENT = _Absent()  # a saved tensor this rank did not load


class Loaded(dict):
    """{key: tensor} for :func:`decode` where keys not loaded give ABSENT."""

    def __missing__(self, key):
        return ABSENT


def _has_absent(value):
    if value is ABSENT:
        return True
    if isinstance(value, dict):
        return any(_has_absent(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_absent(v) for v in value)
    return False


def merge_into(given, value):
    """``given`` (a part of the state being loaded into) updated to the
    loaded ``value``, keeping its dicts and lists (the same objects, changed
    in place): entries of ``value`` replace or join those of ``given``,
    entries only ``given`` has stay, and what holds a tensor this rank did
    not load (ABSENT: another pipeline stage's, or skipped) is left out."""
    if isinstance(given, dict) and isinstance(value, dict):
        for k, v in value.items():
            if k in given:
                given[k] = merge_into(given[k], v)
            elif not _has_absent(v):
                given[k] = v
        return given
    if isinstance(given, list) and isinstance(value, list) and len(given) == len(value):
        for i, v in enumerate(value):
            given[i] = merge_into(given[i], v)
        return given
    if isinstance(given, tuple) and isinstance(value, tuple) and len(given) == len(value):
        return tuple(merge_into(g, v) for g, v in zip(given, value))
    return given if _has_absent(value) else value


def tensor_paths(node, path, out):
    """[(path, key)] of every tensor in a tree, with the paths encode gave."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            tensor_paths(v, path + [str(i)], out)
    elif isinstance(node, dict):
        if len(node) == 1:
            (k, v), = node.items()
            if k == "__tensor__":
                out.append((tuple(path), v))
                return out
            if k == "__optimizer__":
                return tensor_paths(v, path, out)
            if k == "__tuple__":
                for i, x in enumerate(v):
                    tensor_paths(x, path + [str(i)], out)
                return out
            if k == "__dict__":
                for a, b in v:
                    tensor_paths(b, path + [str(decode(a, {}))], out)
                return out
            if k in ("__int__", "__float__", "__bytes__"):
                return out
        for k, v in node.items():
            tensor_paths(v, path + [k], out)
    return out


def tensor_keys(node, out):
    """Every tensor key referenced in a tree."""
    out.extend(key for _, key in tensor_paths(node, [], []))
    return out


def _int64(v):
    return v - (1 << 64) if v >= 1 << 63 else v


# Odd 64-bit constants (splitmix64's), as the signed values torch takes.
_K_POS, _K_MIX1, _K_MIX2 = (_int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9),
                            _int64(0x94D049BB133111EB))


def device_digest(t, chunk_words=1 << 22):
    """A 64-bit digest of contiguous ``t``'s bytes computed with torch
    operators where ``t`` lives (so a CUDA tensor is not copied to the host
    to be compared): the wrapping sum over its 8-byte words w_i of
    mix(w_i xor (i * K)), mix being splitmix64's finalizer (a bijection, so
    two contents that differ in one word never collide), xor the byte count.
    The same on every device; returned as a 0-d int64 tensor on ``t``'s
    device (no synchronisation). Works through ``chunk_words`` words at a
    time, so its temporaries stay small."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel()
    if n % 8:
        b = torch.cat([b, b.new_zeros(8 - n % 8)])
    w = b.view(torch.int64)
    acc = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, w.numel(), chunk_words):
        x = w[start:start + chunk_words]
        h = x ^ (torch.arange(start, start + x.numel(), dtype=torch.int64, device=t.device)
                 * _K_POS)
        h = (h ^ _logical_shift(h, 30)) * _K_MIX1
        h = (h ^ _logical_shift(h, 27)) * _K_MIX2
        h = h ^ _logical_shift(h, 31)
        acc += h.sum()
    return acc ^ n


def _logical_shift(h, k):
    # torch's >> on int64 is arithmetic; mask the sign bits it copies in.
    return (h >> k) & ((1 << (64 - k)) - 1)


class Placement:
    """This rank in a multi-rank checkpoint: ``world`` (a strata.World) or
    None for one process. Sharded tensors are replicated over the dp-cp
    group (a replica index and count per box); whole tensors over the
    tp-dp-cp group (the ranks of one pipeline stage)."""

    def __init__(self, world):
        self.world = world
        if world is None:
            self.rank, self.size = 0, 1
            self.group = self.split_group = self.whole_group = None
            self.split_replica = self.whole_replica = (0, 1)
            return
        if not (hasattr(world, "group") and hasattr(world, "mesh")):
            raise error(f"world must be a strata.World (strata.init()) or None, got "
                        f"{type(world).__module__}.{type(world).__qualname__}")
        self.rank, self.size = world.rank, world.size
        self.group = world.group("world")
        self.split_group = world.group((Axis.DP, Axis.CP))
        self.whole_group = world.group((Axis.TP, Axis.DP, Axis.CP))
        self.split_replica = (self.split_group.rank, self.split_group.size)
        self.whole_replica = (self.whole_group.rank, self.whole_group.size)

    def shard(self, key, t, spec):
        """The binding's tuple for this rank's ``t`` saved as ``key``;
        returns (tuple, tensor kept alive)."""
        if t.dtype not in DTYPES:
            raise error(f"tensor '{key}' has dtype {t.dtype}, which a checkpoint does not hold "
                        f"(supported: {', '.join(str(d) for d in DTYPES)})")
        if t.layout != torch.strided or t.is_quantized:
            raise error(f"tensor '{key}' is not a dense tensor ({t.layout})")
        if t.device.type not in ("cpu", "cuda"):
            raise error(f"tensor '{key}' is on {t.device}; checkpoints take CPU and CUDA tensors")
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if isinstance(spec, Box):  # one writer, chosen by the tensor's owner
            return (key, DTYPES[t.dtype], list(spec.global_shape), list(t.shape),
                    list(spec.global_offset), 0, 1, t.data_ptr(), t.is_cuda), t
        glob, offset = global_box(t.shape, spec)
        index, count = self.split_replica if spec is not None else self.whole_replica
        return (key, DTYPES[t.dtype], glob, list(t.shape), offset, index, count, t.data_ptr(),
                t.is_cuda), t

    def pipeline_split(self):
        """Whether the world has more than one pipeline stage (then rank 0's
        structure of the state is not every rank's)."""
        return self.world is not None and self.world.mesh.pp > 1

    def check_replicas(self, step, tensors, timeout, threads):
        """Collective over the world (no-op alone): raises a CheckpointError
        on every rank, before anything is written, when the ranks that hold
        replicas of a tensor hold different ones. ``tensors``: [(key, spec,
        tensor)] as given to :meth:`shard` (contiguous). Returns the seconds
        it took. Whole tensors are compared over the tp-dp-cp group, shards
        over dp-cp: dtypes, shapes and a 64-bit digest of the bytes, in two
        small all-reduces per group (see strata::CheckReplicasMatch). Boxes
        laid out by their owner (:class:`Box`: ZeRO-1's optimizer state) have
        one writer each and are not compared. A
        tensor's digest depends on where it lives (xxh3-64 on the host,
        :func:`device_digest` on a GPU): replicas of one tensor on the host on
        some ranks and on a GPU on others are reported as differing."""
        if self.group is None:
            return 0.0
        start = time.perf_counter()
        # Boxes laid out by their owner have one writer each: no replicas.
        tensors = [(k, spec, t) for k, spec, t in tensors if not isinstance(spec, Box)]
        # Host tensors: xxh3 on the staging threads. Others: a digest
        # computed where they live, read back once (one synchronisation).
        host = [(i, t) for i, (_, _, t) in enumerate(tensors) if t.device.type == "cpu"]
        digests = [0] * len(tensors)
        got = _strata._content_digests([(t.data_ptr(), t.numel() * t.element_size())
                                        for _, t in host], threads)
        for (i, _), d in zip(host, got):
            digests[i] = d
        by_device = {}
        for i, (_, _, t) in enumerate(tensors):
            if t.device.type != "cpu":
                by_device.setdefault(t.device, []).append((i, device_digest(t)))
        for items in by_device.values():
            values = torch.stack([d for _, d in items]).cpu().tolist()
            for (i, _), v in zip(items, values):
                digests[i] = v & ((1 << 64) - 1)
        whole, split = [], []
        for (key, spec, t), d in zip(tensors, digests):
            (whole if spec is None else split).append((key, DTYPES[t.dtype], list(t.shape), d))
        try:
            _strata._check_replicas(self.group, [(self.whole_group, whole),
                                                 (self.split_group, split)],
                                    int(step), float(timeout))
        except CheckpointError as e:
            if e.code != "INVALID_ARGUMENT":
                raise
            raise error(f"{e}. Nothing was saved. A tensor is saved as replicated unless it "
                        "carries its shard layout (tensor_parallel_sharding: the parameters of "
                        "strata.nn layers, their state_dict() tensors and the optimizer states "
                        "made from them with *_like); make such tensors identical on the ranks "
                        "named, give a tensor-parallel shard of your own a layout "
                        "(strata.nn.ShardedParameter), or record per-rank positions with "
                        "data_loader=") from None
        return time.perf_counter() - start

    def agree(self, failure, doing="load its part of the checkpoint"):
        """Collective over the world (no-op alone): raises on every rank when
        ``failure`` (an exception or None) is set on any, so a rank that
        cannot take part in a collective load or save does not leave the
        others waiting. The lowest failing rank's error is raised there; the
        others raise a CheckpointError naming it."""
        if self.group is None:
            if failure is not None:
                raise failure
            return
        first = torch.tensor([self.rank if failure is not None else self.size], dtype=torch.int64)
        self.group.all_reduce(first, op="min")
        bad = int(first.item())
        if failure is not None:
            raise failure
        if bad < self.size:
            raise error(f"rank {bad} of {self.size} could not {doing} (its error says why)",
                        code="ABORTED")
