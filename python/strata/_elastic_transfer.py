"""Moving a member's state to a newcomer (a placed spare or a joiner) over
their data-parallel group, point to point, from one member or shared
among several.

The state (step, user values, bucket layouts, model, optimizer and
scheduler state_dicts, sampler) goes as a small pickled skeleton in which
every tensor of at least ``RAW_BYTES`` is replaced by a :class:`_Ref`
(shape, dtype, device); those tensors then follow one by one as raw bytes,
in the skeleton's order, straight from their storage. The newcomer
receives a model's tensors directly into its own parameters and buffers
when their names, shapes and dtypes match (no copy, no allocation), the
others into new tensors. Pickling the whole state instead cost about as
much as sending it twice (0.08 s to save and 0.11 s to load the 103 MB
state of the rejoin benchmark's model, besides the transfer).

Members of a data-parallel group hold equal parameters and optimizer
states, so they share the sending of those: the first (part 0) sends the
skeleton, in which each such tensor names the member it comes from (in
turn), and everything else; each other member first sends a fingerprint of
the tensors it sends (their places in the state, shapes and dtypes), which
the newcomer checks against the skeleton, so that a member whose state is
laid out otherwise stops the transfer instead of filling the wrong tensor.
With the rejoin benchmark's three members the newcomer's state took 55-60
ms instead of 70-90 (a newcomer's fresh memory is touched for the first
time by these copies; spread over the members, the page faults are too)."""

import io
import math

from .errors import ElasticError

RAW_BYTES = 64 * 1024  # smaller tensors travel inside the skeleton
# Raw transfers posted ahead of the one waited for. Posted on both sides,
# a message is copied by whichever side gets to it first: the member,
# which waits for its sends at once, copies the newcomer's while the
# newcomer builds its model; one transfer at a time, each waited for, the
# 103 MB of the rejoin benchmark took 75-90 ms, every copy on the
# newcomer. (Gloo's host channels hold 256 messages in flight.)
IN_FLIGHT = 64


class _Ref:
    """Stands for a tensor sent raw after the skeleton, by sending part
    ``part``."""
    __slots__ = ("index", "shape", "dtype", "device", "part")

    def __init__(self, index, shape, dtype, device, part=0):
        self.index, self.shape, self.dtype, self.device = index, shape, dtype, device
        self.part = part

    def __getstate__(self):
        return (self.index, self.shape, self.dtype, self.device, self.part)

    def __setstate__(self, s):
        self.index, self.shape, self.dtype, self.device, self.part = s


def _split(obj, raw, path=()):
    """``obj`` with its large tensors replaced by _Refs; (tensor, path,
    ref) appended to ``raw`` for each."""
    import torch
    if isinstance(obj, torch.Tensor):
        if obj.numel() * obj.element_size() < RAW_BYTES:
            return obj
        ref = _Ref(len(raw), tuple(obj.shape), obj.dtype, obj.device.type)
        raw.append((obj.detach(), path, ref))
        return ref
    if isinstance(obj, dict):
        return _same_dict(obj, {k: _split(v, raw, path + (k,)) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(_split(v, raw, path + (i,)) for i, v in enumerate(obj))
    return obj


def _fingerprint(entries):
    """An int64 tensor summing up [(index, path, shape, dtype)] of the tensors
    one part sends."""
    import hashlib
    import torch
    digest = hashlib.sha256(repr([(i, p, tuple(s), str(d)) for i, p, s, d in entries]).encode())
    return torch.tensor([int.from_bytes(digest.digest()[:8], "little", signed=True)])


def _same_dict(like, items):
    """``items`` as a dict of ``like``'s kind, with its ``_metadata`` (the
    versions load_state_dict reads from a module's state_dict)."""
    import collections
    out = collections.OrderedDict(items) if isinstance(like, collections.OrderedDict) else items
    meta = getattr(like, "_metadata", None)
    if meta is not None:
        out._metadata = meta
    return out


def unsaved_buffers(module):
    """{name: buffer} of ``module``'s buffers left out of its state_dict
    (registered with persistent=False): they travel beside it."""
    saved = module.state_dict(keep_vars=True).keys()
    return {n: b for n, b in module.named_buffers() if n not in saved}


def _bytes(t):
    """A flat uint8 view of contiguous tensor ``t`` (any dtype, 0-dim too)."""
    import torch
    return t.reshape(-1).view(torch.uint8)


def send_state(group, dst_ranks, state, part=0, parts=1, shared=()):
    """Sends ``state`` (a picklable tree of tensors and values) to each of
    ``dst_ranks`` (ranks of ``group``).

    Several ranks may share the sending: each calls this with the same
    ``parts``, its own ``part`` (0 .. parts - 1, its place in the ``src``
    list the receivers pass to :func:`recv_state`) and a state laid out
    alike. ``shared``: the tensors whose values are equal on every part
    (the replicas' parameters and optimizer states; matched by storage
    address); those are sent by the parts in turn, everything else by part
    0, which also sends the skeleton."""
    import torch
    raw = []
    skeleton = _split(state, raw)
    ours = {t.data_ptr() for t in shared if t.numel()} if parts > 1 else set()
    turn = 0
    for t, _, ref in raw:
        if t.numel() and t.data_ptr() in ours:
            ref.part, turn = turn % parts, turn + 1
    mine = [(t.contiguous(), path, ref) for t, path, ref in raw
            if ref.part == part and t.numel()]
    if part == 0:
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        head = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        first = [torch.tensor([head.numel(), parts], dtype=torch.int64), head]
    else:
        first = [_fingerprint([(r.index, p, r.shape, r.dtype) for _, p, r in mine])]
    for dst in dst_ranks:
        for t in first:
            group.send(t, dst)
        flight = _InFlight()
        for t, _, _ in mine:
            flight.add(group.send(_bytes(t), dst, async_op=True))
        flight.drain()


class _InFlight:
    """Works posted and not yet waited for, at most IN_FLIGHT of them,
    waited for in the order posted."""

    def __init__(self):
        import collections
        self._works = collections.deque()

    def add(self, work):
        self._works.append(work)
        while len(self._works) > IN_FLIGHT:
            self._works.popleft().wait()

    def drain(self):
        while self._works:
            self._works.popleft().wait()


def _walk_refs(obj, found, path=()):
    """(path, ref) of every _Ref in ``obj``, appended to ``found``."""
    if isinstance(obj, _Ref):
        found.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk_refs(v, found, path + (k,))
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _walk_refs(v, found, path + (i,))


def _fill(obj, tensors):
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return _same_dict(obj, {k: _fill(v, tensors) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _device(kind):
    import torch
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def recv_state(group, src, models=None, skeleton_arrived=None):
    """Receives what :func:`send_state` sent from group rank ``src`` (or
    from the ranks of list ``src``, who share the sending in that order).

    ``models``: the newcomer's own model state_dicts (which share their
    parameters' storage), for a state whose ``"models"`` entry is a list of
    state_dicts; or a function returning them, called when the first of
    those tensors is due (it may wait for the models to be built: what
    comes before them is received meanwhile). A tensor whose name, shape
    and dtype match its own arrives in place; the others in new tensors.
    ``skeleton_arrived(skeleton)``: called once the skeleton is in (its
    tensors of RAW_BYTES or more still _Refs). Returns the state with every
    tensor in place."""
    import torch
    sources = list(src) if isinstance(src, (list, tuple)) else [src]
    size = torch.empty(2, dtype=torch.int64)  # the skeleton's bytes, the senders
    group.recv(size, sources[0])
    head = torch.empty(int(size[0]), dtype=torch.uint8)
    group.recv(head, sources[0])
    parts = int(size[1])
    skeleton = torch.load(io.BytesIO(head.numpy()), weights_only=False)
    if skeleton_arrived is not None:
        skeleton_arrived(skeleton)
    wanted = {}  # raw index -> (model, name)
    sent_models = skeleton.get("models") if isinstance(skeleton, dict) else None
    if models is not None and isinstance(sent_models, list):
        for i, sd in enumerate(sent_models):
            for name, ref in (sd.items() if isinstance(sd, dict) else ()):
                if isinstance(ref, _Ref):
                    wanted[ref.index] = (i, name)
    refs = []
    _walk_refs(skeleton, refs)
    refs.sort(key=lambda pr: pr[1].index)
    if parts != len(sources):
        raise ElasticError(f"the state from group rank {sources[0]} is shared among {parts} "
                           f"senders, this rank expects {len(sources)} ({sources})")
    for k in range(1, parts):
        theirs = torch.empty(1, dtype=torch.int64)
        group.recv(theirs, sources[k])
        expected = _fingerprint([(r.index, p, r.shape, r.dtype) for p, r in refs
                                 if r.part == k and math.prod(r.shape)])
        if int(theirs[0]) != int(expected[0]):
            raise ElasticError(
                f"the state's tensors from group rank {sources[k]} are not those group rank "
                f"{sources[0]} assigned it (their models or optimizer states are laid out "
                "differently); nothing of it was loaded")
    tensors = {}
    flight = _InFlight()  # the members copy them meanwhile
    for _, ref in refs:
        t = None
        if ref.index in wanted:
            if callable(models):
                models = models()
            i, name = wanted[ref.index]
            t = models[i].get(name) if i < len(models) else None
            if t is not None and (tuple(t.shape) != ref.shape or t.dtype != ref.dtype or
                                  t.device.type != ref.device or not t.is_contiguous()):
                t = None
        if t is None:
            t = torch.empty(ref.shape, dtype=ref.dtype, device=_device(ref.device))
        if t.numel():
            flight.add(group.recv(_bytes(t), sources[ref.part], async_op=True))
        tensors[ref.index] = t
    flight.drain()
    return _fill(skeleton, tensors)


class Prefetch:
    """:func:`recv_state` on a thread, started before the newcomer builds
    the models its state goes into: what precedes the models' tensors
    arrives meanwhile, the models' tensors once :meth:`built` gave their
    state_dicts. :meth:`skeleton` waits for the state's small values,
    :meth:`result` for the end; both raise what the thread raised."""

    def __init__(self, group, src):
        import threading
        self._got, self._error = None, None
        self._models, self._ready = None, threading.Event()
        self._skeleton, self._skeleton_in = None, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(group, src), daemon=True,
                                        name="strata-elastic-state")
        self._thread.start()

    def _own(self):
        self._ready.wait()
        return self._models

    def _run(self, group, src):
        try:
            self._got = recv_state(group, src, self._own, self._arrived)
        except BaseException as e:  # noqa: BLE001: raised again by result()
            self._error = e
        self._skeleton_in.set()  # wakes skeleton() after a failure too

    def _arrived(self, skeleton):
        self._skeleton = skeleton
        self._skeleton_in.set()

    def built(self, models):
        """The newcomer's models' state_dicts, to receive into."""
        self._models = models
        self._ready.set()

    def skeleton(self):
        """The state as sent, its large tensors not yet in (_Refs)."""
        self._skeleton_in.wait()
        if self._skeleton is None:
            self.result()  # raises the thread's error
        return self._skeleton

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._got


_receiving = [False]


def receiving_state():
    """True while ``build(world)`` runs on a rank whose State is then
    overwritten by a member's (a placed spare, a joiner): every parameter
    and buffer of its models arrives from that member, so the models may be
    made without initialising them. strata's layers (strata.nn's parallel
    linear layers and embedding) then leave their weights uninitialised
    themselves; for other modules, the way PyTorch loads a checkpoint into
    a big model::

        with torch.device("meta" if strata.elastic.receiving_state() else "cpu"):
            net = Net()
        if strata.elastic.receiving_state():
            net = net.to_empty(device="cpu")

    Buffers left out of ``state_dict()`` (persistent=False) arrive as well;
    tensors a module keeps as plain attributes do not: compute those in
    ``build`` as usual. The random number generator is not advanced by the
    draws left out."""
    return _receiving[0]


class Receiving:
    """The scope in which :func:`receiving_state` is true."""

    def __enter__(self):
        _receiving[0] = True

    def __exit__(self, *exc):
        _receiving[0] = False
