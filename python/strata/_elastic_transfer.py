"""Moving a member's state to a newcomer (a placed spare or a joiner) over
their data-parallel group, point to point.

The state (step, user values, bucket layouts, model, optimizer and
scheduler state_dicts, sampler) goes as a small pickled skeleton in which
every tensor of at least ``RAW_BYTES`` is replaced by a :class:`_Ref`
(shape, dtype, device); those tensors then follow one by one as raw bytes,
in the skeleton's order, straight from their storage. The newcomer
receives a model's tensors directly into its own parameters and buffers
when their names, shapes and dtypes match (no copy, no allocation), the
others into new tensors. Pickling the whole state instead cost about as
much as sending it twice (0.08 s to save and 0.11 s to load the 103 MB
state of the rejoin benchmark's model, besides the transfer)."""

import io

RAW_BYTES = 64 * 1024  # smaller tensors travel inside the skeleton


class _Ref:
    """Stands for a tensor sent raw after the skeleton."""
    __slots__ = ("index", "shape", "dtype", "device")

    def __init__(self, index, shape, dtype, device):
        self.index, self.shape, self.dtype, self.device = index, shape, dtype, device

    def __getstate__(self):
        return (self.index, self.shape, self.dtype, self.device)

    def __setstate__(self, s):
        self.index, self.shape, self.dtype, self.device = s


def _split(obj, raw):
    """``obj`` with its large tensors replaced by _Refs, appended to ``raw``."""
    import torch
    if isinstance(obj, torch.Tensor):
        if obj.numel() * obj.element_size() < RAW_BYTES:
            return obj
        raw.append(obj.detach())
        return _Ref(len(raw) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return _same_dict(obj, {k: _split(v, raw) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(_split(v, raw) for v in obj)
    return obj


def _same_dict(like, items):
    """``items`` as a dict of ``like``'s kind, with its ``_metadata`` (the
    versions load_state_dict reads from a module's state_dict)."""
    import collections
    out = collections.OrderedDict(items) if isinstance(like, collections.OrderedDict) else items
    meta = getattr(like, "_metadata", None)
    if meta is not None:
        out._metadata = meta
    return out


def _bytes(t):
    """A flat uint8 view of contiguous tensor ``t`` (any dtype, 0-dim too)."""
    import torch
    return t.reshape(-1).view(torch.uint8)


def send_state(group, dst_ranks, state):
    """Sends ``state`` (a picklable tree of tensors and values) to each of
    ``dst_ranks`` (ranks of ``group``)."""
    import torch
    raw = []
    skeleton = _split(state, raw)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    head = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
    size = torch.tensor([head.numel()], dtype=torch.int64)
    raw = [t.contiguous() for t in raw]
    for dst in dst_ranks:
        group.send(size, dst)
        group.send(head, dst)
        for t in raw:
            if t.numel():
                group.send(_bytes(t), dst)


def _walk_refs(obj, found):
    if isinstance(obj, _Ref):
        found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk_refs(v, found)
    elif type(obj) in (list, tuple):
        for v in obj:
            _walk_refs(v, found)


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


def recv_state(group, src, models=None):
    """Receives what :func:`send_state` sent from group rank ``src``.

    ``models``: the newcomer's own model state_dicts (which share their
    parameters' storage), for a state whose ``"models"`` entry is a list of
    state_dicts; or a function returning them, called when the first of
    those tensors is due (it may wait for the models to be built: what
    comes before them is received meanwhile). A tensor whose name, shape
    and dtype match its own arrives in place; the others in new tensors.
    Returns the state with every tensor in place."""
    import torch
    size = torch.empty(1, dtype=torch.int64)
    group.recv(size, src)
    head = torch.empty(int(size[0]), dtype=torch.uint8)
    group.recv(head, src)
    skeleton = torch.load(io.BytesIO(head.numpy()), weights_only=False)
    wanted = {}  # raw index -> (model, name)
    sent_models = skeleton.get("models") if isinstance(skeleton, dict) else None
    if models is not None and isinstance(sent_models, list):
        for i, sd in enumerate(sent_models):
            for name, ref in (sd.items() if isinstance(sd, dict) else ()):
                if isinstance(ref, _Ref):
                    wanted[ref.index] = (i, name)
    refs = []
    _walk_refs(skeleton, refs)
    tensors = {}
    for ref in sorted(refs, key=lambda r: r.index):
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
            group.recv(_bytes(t), src)
        tensors[ref.index] = t
    return _fill(skeleton, tensors)


class Prefetch:
    """:func:`recv_state` on a thread, started before the newcomer builds
    the models its state goes into: what precedes the models' tensors
    arrives meanwhile, the models' tensors once :meth:`built` gave their
    state_dicts. :meth:`result` waits for the end and raises what the
    thread raised."""

    def __init__(self, group, src):
        import threading
        self._got, self._error = None, None
        self._models, self._ready = None, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(group, src), daemon=True,
                                        name="strata-elastic-state")
        self._thread.start()

    def _own(self):
        self._ready.wait()
        return self._models

    def _run(self, group, src):
        try:
            self._got = recv_state(group, src, self._own)
        except BaseException as e:  # noqa: BLE001: raised again by result()
            self._error = e

    def built(self, models):
        """The newcomer's models' state_dicts, to receive into."""
        self._models = models
        self._ready.set()

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
