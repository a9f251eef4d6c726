"""strata.optim: ZeRO-1, optimizer state sharded over the data-parallel
group.

::

    import torch, strata
    import strata.nn as snn

    world = strata.init(strata.Mesh(8, tp=2))
    model = snn.DataParallel(build_model(world), world)
    opt = strata.optim.DistributedOptimizer(torch.optim.AdamW, model.parameters(), world,
                                            lr=1e-3, weight_decay=0.01)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()      # buckets reduce-scatter while backward runs
        opt.step()           # this rank's shard steps, then parameters all-gather

:class:`DistributedOptimizer` is Megatron-Core's distributed optimizer (and
DeepSpeed's ZeRO stage 1) over strata's groups. The parameters sit in the
flat buffers of :class:`strata.nn.DataParallel` (parameters are views of
them); dp rank r of n owns block r of every gradient bucket. Gradients are
reduce-scattered bucket by bucket during backward (instead of all-reduced),
so each rank receives only the averaged gradient of its blocks; ``step()``
runs the wrapped torch optimizer (any elementwise one: SGD, Adam, AdamW,
RMSprop, Adagrad, ...) on those blocks only, one tensor per piece of a
parameter, and all-gathers the parameters bucket by bucket. Each rank
holds 1/n of the optimizer state. Without a DataParallel around the
parameters it reduces them itself, in ``step()``.

Hyperparameters live in ``param_groups`` as for any torch optimizer (LR
schedulers work); the inner optimizer's groups take them at each step.

Checkpoints: through :mod:`strata.checkpoint` (``{"model": model,
"optimizer": opt}``) each rank saves its pieces of each parameter's states
as boxes of a global tensor ([tp shards, elements of one tp shard]), so a
checkpoint saved at one dp size loads at any other (a tp change is refused
with a message). ``state_dict()`` / ``load_state_dict()`` are this rank's
part, for the same layout.

Step atomicity (for in-process recovery): ``step()`` changes nothing until
every bucket's reduction has completed on this rank; a failed reduction
raises first. The parameter all-gather comes after the update: if it fails,
this rank's blocks are updated and others' may not have arrived, so
restore from a checkpoint. After a rank is lost, ``rebuild()`` (or
:meth:`strata.nn.DataParallel.rebuild`) re-partitions for the new group:
moving the state when every old rank takes part, else dropping it (then
load a checkpoint).

See docs/data-parallel.md.
"""

import math
import weakref

import torch

from . import _dp_comm as C
from ._checkpoint_tree import Box
from ._data_parallel import DataParallelOptions, make_options, resolve_groups
from ._dp_layout import Layout, intersect_pieces
from ._dp_reducer import ModuleChangedError, Reducer, check_same_parameters
from .errors import InvalidArgument

__all__ = ["DistributedOptimizer"]

# Optimizers whose update is not elementwise (they read whole tensors:
# norms, factored second moments, orthogonalisation, line searches): a
# piece of a flattened parameter would change what they compute.
_NOT_ELEMENTWISE = {"LBFGS", "Adafactor", "SparseAdam", "Muon"}
_FORMAT = "strata.zero1"


class _Piece:
    """Elements [lo, hi) of one parameter's flattened tensor, held by this
    rank: ``param`` is a view of the flat parameter buffer (the tensor the
    inner optimizer steps), its grad a view of this rank's shard of the
    reduced gradients."""

    __slots__ = ("reducer", "entry", "lo", "hi", "param")

    def __init__(self, reducer, entry, lo, hi, buf_off, shard_off):
        self.reducer, self.entry, self.lo, self.hi = reducer, entry, lo, hi
        n = hi - lo
        self.param = torch.nn.Parameter(reducer.param[entry.dtype][buf_off:buf_off + n])
        self.param.grad = reducer.shard[entry.dtype][shard_off:shard_off + n]


class DistributedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` (a torch optimizer class) over ``params``, with its
    state sharded over ``world``'s data-parallel group (ZeRO-1; see the
    module docstring). ``params``: parameters, (name, parameter) pairs or
    param-group dicts, as torch optimizers take them; ``optimizer_kwargs``
    are ``optimizer_cls``'s (lr, weight_decay, ...). ``options``: the
    :class:`strata.nn.DataParallelOptions` of the reduction when no
    DataParallel holds the parameters (else the DataParallel's apply).

    Collective: every rank of the data-parallel group constructs it.
    """

    def __init__(self, optimizer_cls, params, world, *, options=None, **optimizer_kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls,
                                                               torch.optim.Optimizer)):
            raise InvalidArgument(f"DistributedOptimizer: optimizer_cls must be a torch.optim."
                                  f"Optimizer subclass, got {optimizer_cls!r}")
        if optimizer_cls.__name__ in _NOT_ELEMENTWISE:
            raise InvalidArgument(
                f"DistributedOptimizer: {optimizer_cls.__name__} reads whole parameters (its "
                "update is not elementwise), so it cannot step pieces of them; use an "
                "elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...)")
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        super().__init__(params, dict(probe.defaults))
        self._cls, self._kwargs = optimizer_cls, dict(optimizer_kwargs)
        self._world = world
        params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise InvalidArgument("DistributedOptimizer: a parameter is given twice")
        frozen = [i for i, p in enumerate(params) if not p.requires_grad]
        if frozen:
            raise InvalidArgument(f"DistributedOptimizer: parameters {frozen[:8]} do not require "
                                  "grad; leave frozen parameters out")
        self._names = {}
        for g in self.param_groups:
            for p, n in zip(g["params"], g.get("param_names") or [None] * len(g["params"])):
                if n is not None:
                    self._names[id(p)] = n
        group, tp = resolve_groups(world, None, "DistributedOptimizer")
        self._tp_rank = tp.rank if tp is not None else 0
        self._pp = world.mesh.pp if hasattr(world, "mesh") else 1
        self._reducers = self._find_reducers(params, group, tp, options)
        for r in self._reducers:
            r.attach_zero(self)
        self._index = {id(p): i for i, p in enumerate(params)}  # numbered state-dict keys
        self._state_lost = False
        self._pieces = []
        self._inner = None
        self._build_pieces()

    # ---- setup ---------------------------------------------------------------
    def _find_reducers(self, params, group, tp, options):
        refs = [getattr(p, "_strata_reducer", None) for p in params]
        reducers = [r() if r is not None else None for r in refs]
        if all(r is None for r in reducers):
            opts = make_options(options, {}, DataParallelOptions)
            named = [(self._names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
            r = Reducer(named, group, opts, tp, hooks=False, who="DistributedOptimizer")
            check_same_parameters(r.entries, group, opts.timeout, "DistributedOptimizer")
            if opts.broadcast_parameters and group.size > 1:
                with torch.no_grad():
                    for p in params:
                        C.broadcast(group, p.data, 0, opts.timeout)
            return [r]
        if any(r is None for r in reducers):
            loose = [i for i, r in enumerate(reducers) if r is None]
            raise InvalidArgument(
                f"DistributedOptimizer: parameters {loose[:8]} belong to no DataParallel while "
                "the others do; give it the parameters of DataParallel modules only")
        if options is not None:
            raise InvalidArgument("DistributedOptimizer: options= applies only without a "
                                  "DataParallel; set them on the DataParallel")
        unique = []
        for r in reducers:
            if all(r is not u for u in unique):
                unique.append(r)
        mine = {id(p) for p in params}
        for r in unique:
            missing = [e for e in r.entries if id(e.param) not in mine]
            if missing:
                raise InvalidArgument(
                    f"DistributedOptimizer: the DataParallel holds parameters "
                    f"{[e.name for e in missing[:6]]} that are not given to this optimizer; "
                    "ZeRO-1 reduce-scatters every gradient of a DataParallel, so one "
                    "DistributedOptimizer takes all of its parameters (freeze the others "
                    "before wrapping)")
            if r.group.size != group.size or r.group.name != group.name:
                raise InvalidArgument(
                    f"DistributedOptimizer: its group '{group.name}' ({group.size} ranks) is "
                    f"not the DataParallel's '{r.group.name}' ({r.group.size} ranks)")
        return unique

    def _group_of(self):
        return {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}

    def _build_pieces(self):
        """This rank's pieces of every reducer's current layout, and a fresh
        inner optimizer over them (no state)."""
        group_of = self._group_of()
        self._pieces = []
        for r in self._reducers:
            if r.group is None:
                continue
            for e, lo, hi, buf_off, shard_off in r.layout.pieces(r.group.rank, r.group.size):
                self._pieces.append(_Piece(r, e, lo, hi, buf_off, shard_off))
        inner_groups = []
        for gi, g in enumerate(self.param_groups):
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            inner_groups.append(dict(hyper, params=[pc.param for pc in self._pieces
                                                     if group_of[id(pc.entry.param)] == gi]))
        self._inner = (self._cls(inner_groups, **self._kwargs)
                       if any(g["params"] for g in inner_groups) else None)

    # ---- torch.optim.Optimizer ------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Waits for the reduction (or, without a DataParallel, reduces),
        steps this rank's pieces, all-gathers the parameters. Returns the
        closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_unchanged()
        if self._state_lost:
            raise InvalidArgument(
                "DistributedOptimizer: the optimizer state was dropped by rebuild(keep_state="
                "False); load a checkpoint (strata.checkpoint.load) or call reset_state() to "
                "start it from zero")
        for r in self._reducers:
            r.finish()  # raises before anything changed
        if self._inner is not None:
            for inner, g in zip(self._inner.param_groups, self.param_groups):
                for k, v in g.items():
                    if k not in ("params", "param_names"):
                        inner[k] = v
            self._inner.step()
        for r in self._reducers:
            r.gather_params()
        return loss

    def zero_grad(self, set_to_none=True):
        """Zeroes the gradient buffers in place (the parameters' ``.grad``
        stay views of them)."""
        for r in self._reducers:
            r.zero_grad()

    def _check_unchanged(self):
        for r in self._reducers:
            moved = r.params_in_place()
            if moved:
                raise ModuleChangedError(
                    f"DistributedOptimizer: parameters {[e.name for e in moved[:6]]} no longer "
                    "live in the flat parameter buffer (their .data was replaced after "
                    "wrapping); change the model before wrapping it")

    def reset_state(self):
        """Starts the optimizer state from zero (after rebuild(keep_state=False)
        when no checkpoint is loaded)."""
        self._build_pieces()
        self._state_lost = False

    # ---- memory --------------------------------------------------------------
    def state_bytes(self):
        """Bytes of optimizer state this rank holds (the inner optimizer's
        tensors)."""
        if self._inner is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self._inner.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    # ---- layout changes ----------------------------------------------------------
    def _layout_changed(self, reducer, old_layout, old_group, keep):
        """``reducer`` moved to a new layout (the first backward's order, or a
        new group in rebuild): new pieces; the state of the old ones moved to
        them (``keep``, collective over ``old_group``) or dropped."""
        old_pieces = list(self._pieces)
        old_state = ({id(pc.param): self._inner.state.get(pc.param, {}) for pc in old_pieces}
                     if self._inner is not None else {})
        had = any(bool(s) for pc, s in zip(old_pieces, old_state.values())
                  if pc.reducer is reducer)
        self._build_pieces()
        # The other reducers' pieces are unchanged: their states carry over.
        same = {(id(pc.reducer), pc.entry.index, pc.lo, pc.hi): pc for pc in old_pieces
                if pc.reducer is not reducer}
        for pc in self._pieces:
            before = same.get((id(pc.reducer), pc.entry.index, pc.lo, pc.hi))
            if before is not None and old_state.get(id(before.param)):
                self._inner.state[pc.param] = old_state[id(before.param)]
        if old_group is None:
            return
        flag = torch.tensor([1 if had else 0], dtype=torch.int64)
        if keep:
            C.all_reduce_now(old_group, flag, "max", reducer.opts.timeout)
        if not int(flag[0]):
            return
        if not keep:
            self._state_lost = True
            return
        mine = [pc for pc in old_pieces if pc.reducer is reducer]
        self._move(reducer, old_layout, old_group, mine, old_state)

    def rebuild(self, world, keep_state=True):
        """Re-partitions for a new data-parallel group (``world``: the rebuilt
        World, its dp Group, or None on a rank that leaves). With a
        DataParallel, call its ``rebuild`` instead (it rebuilds this too).
        ``keep_state`` as there: move the state over the old group, or drop
        it (then load a checkpoint)."""
        if len(self._reducers) != 1 or self._reducers[0]._hooks:
            raise InvalidArgument("DistributedOptimizer.rebuild: this optimizer's parameters "
                                  "are held by DataParallel; call DataParallel.rebuild(), "
                                  "which rebuilds its optimizer")
        r = self._reducers[0]
        group = None
        if world is not None:
            group, tp = resolve_groups(world, None, "DistributedOptimizer.rebuild")
            self._tp_rank = tp.rank if tp is not None else 0
        r.zero_grad()
        r.relayout_for(group, keep_state, self._layout_changed)

    def _init_state(self):
        """Creates the inner optimizer's state for every piece with a step
        on zero gradients at lr = 0 (as torch.distributed.checkpoint does),
        leaving the parameters as they were."""
        if self._inner is None:
            return
        pieces = [pc.param for pc in self._pieces]
        saved = [p.detach().clone() for p in pieces]
        grads = [p.grad for p in pieces]
        lrs = [g["lr"] for g in self._inner.param_groups]
        for p in pieces:
            p.grad = torch.zeros_like(p)
        for g in self._inner.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        try:
            with torch.no_grad():
                self._inner.step()
        finally:
            for g, lr in zip(self._inner.param_groups, lrs):
                g["lr"] = lr
            with torch.no_grad():
                for p, s, g in zip(pieces, saved, grads):
                    p.copy_(s)
                    p.grad = g

    def _fields(self):
        """{field: "piece" | "scalar"} of the inner optimizer's per-parameter
        state, from a probe of the same class and options."""
        probe_p = torch.zeros(2, requires_grad=True)
        probe = self._cls([probe_p], **self._kwargs)
        probe_p.grad = torch.zeros(2)
        probe.step()
        out = {}
        for k, v in probe.state[probe_p].items():
            if isinstance(v, torch.Tensor) and v.shape == probe_p.shape:
                out[k] = "piece"
            elif not isinstance(v, torch.Tensor) or v.dim() == 0:
                out[k] = "scalar"
            else:
                raise InvalidArgument(f"DistributedOptimizer: {self._cls.__name__}'s state "
                                      f"'{k}' has shape {tuple(v.shape)} for a parameter of "
                                      "shape (2,): not elementwise, cannot be sharded")
        return out

    def _move(self, reducer, old_layout, old_group, mine, old_state):
        """The state of the old pieces (``mine``: this rank's, with
        ``old_state``) moved to the current ones, over ``old_group``."""
        new_group = reducer.group
        n_old = old_group.size
        new_of = torch.tensor([new_group.rank if new_group is not None else -1],
                              dtype=torch.int64)
        every = torch.empty(n_old, dtype=torch.int64)
        C.all_gather_now(old_group, every, new_of, reducer.opts.timeout)
        new_of = every.tolist()
        old_all = [{e.index: (lo, hi) for e, lo, hi, _, _ in old_layout.pieces(r, n_old)}
                   for r in range(n_old)]
        # The new layout as every old rank sees it (a leaving rank too: it
        # sends its pieces to their new owners).
        n_new = sum(1 for r in new_of if r >= 0)
        new_all = {}
        if n_new:
            lay = Layout(reducer.entries, old_layout.order, reducer.opts.bucket_bytes, n_new)
            new_all = {d: {e.index: (lo, hi) for e, lo, hi, _, _ in lay.pieces(d, n_new)}
                       for d in range(n_new)}
        self._init_state()
        fields = self._fields()
        my_old = {pc.entry.index: pc for pc in mine}
        my_new = {pc.entry.index: pc for pc in self._pieces if pc.reducer is reducer}
        me = old_group.rank
        my_old_ranges = old_all[me]
        my_new_ranges = new_all.get(new_of[me], {})
        timeout = reducer.opts.timeout
        for field, kind in sorted(fields.items()):
            if kind == "scalar":
                continue
            send_parts, send_splits = [], []
            for d in range(n_old):
                segs = (intersect_pieces(my_old_ranges, new_all[new_of[d]])
                        if new_of[d] >= 0 else [])
                count = 0
                for i, lo, hi in segs:
                    pc = my_old[i]
                    src = old_state[id(pc.param)][field]
                    send_parts.append(src[lo - pc.lo:hi - pc.lo].to(torch.float64))
                    count += hi - lo
                send_splits.append(count)
            recv_plan, recv_splits = [], []
            for s in range(n_old):
                segs = intersect_pieces(old_all[s], my_new_ranges) if my_new_ranges else []
                recv_plan.append(segs)
                recv_splits.append(sum(hi - lo for _, lo, hi in segs))
            send = (torch.cat(send_parts) if send_parts
                    else torch.zeros(0, dtype=torch.float64))
            recv = torch.empty(sum(recv_splits), dtype=torch.float64)
            C.all_to_all_now(old_group, recv, send, recv_splits, send_splits, timeout)
            at = 0
            with torch.no_grad():
                for segs in recv_plan:
                    for i, lo, hi in segs:
                        pc = my_new[i]
                        dst = self._inner.state[pc.param][field]
                        dst[lo - pc.lo:hi - pc.lo].copy_(recv[at:at + hi - lo])
                        at += hi - lo
        entries = reducer.entries
        for field, kind in sorted(fields.items()):
            if kind != "scalar":
                continue
            v = torch.full((len(entries),), -math.inf, dtype=torch.float64)
            for i, pc in my_old.items():
                if pc.lo == 0 and field in old_state[id(pc.param)]:
                    v[i] = float(old_state[id(pc.param)][field])
            C.all_reduce_now(old_group, v, "max", timeout)
            for i, pc in my_new.items():
                st = self._inner.state[pc.param]
                if math.isfinite(float(v[i])):
                    _set_scalar(st, field, float(v[i]))

    # ---- state dicts ---------------------------------------------------------------
    def _key(self, pc, names):
        p = pc.entry.param
        name = (names or {}).get(id(p)) or self._names.get(id(p))
        if name is None:
            if self._pp > 1:
                raise InvalidArgument(
                    "DistributedOptimizer: its parameters have no names, and under pipeline "
                    "parallelism numbered keys of different stages collide; save it beside "
                    "its model ({'model': model, 'optimizer': opt}) or build it from "
                    "model.named_parameters()")
            name = str(self._index[id(p)])
        return name

    def strata_sharded_state_dict(self, names=None, for_load=False):
        """This rank's state for strata.checkpoint: ``{"state": {parameter
        name: {field: tensor}}, "param_groups": [...], "format": ...}``
        whose tensors carry a ``checkpoint_box`` (their place in the global
        tensor ``[tp shards, elements of one shard]`` of each state, and
        whether this rank writes it). With ``for_load``, states are created
        first (so that a checkpoint can fill them in place)."""
        if for_load and self._inner is not None and not all(
                self._inner.state.get(pc.param) for pc in self._pieces):
            self._init_state()
        state, keys = {}, {}
        group_of = self._group_of()
        for pc in self._pieces:
            key = self._key(pc, names)
            keys[key] = pc
            st = self._inner.state.get(pc.param, {}) if self._inner is not None else {}
            if not st:
                continue
            spec = getattr(pc.entry.param, "tensor_parallel_sharding", None)
            count, index = (spec[2], spec[1]) if spec is not None else (1, 0)
            write = spec is not None or self._tp_rank == 0
            out = {}
            for field, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == pc.hi - pc.lo:
                    t = v.view(1, -1)
                    t.checkpoint_box = Box((count, pc.entry.numel), (index, pc.lo), write)
                else:
                    t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v),
                                                                         dtype=torch.float64)
                    if t.dim() != 0:
                        raise InvalidArgument(f"DistributedOptimizer: state '{field}' of shape "
                                              f"{tuple(t.shape)} is neither a piece nor a scalar")
                    t = t.detach()
                    # One writer: tp rank 0's piece holding the first element.
                    t.checkpoint_box = Box((), (), self._tp_rank == 0 and pc.lo == 0)
                out[field] = t
            state[key] = out
        self._keys = keys
        groups = []
        for gi, g in enumerate(self.param_groups):
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            members = [k for k, pc in keys.items() if group_of[id(pc.entry.param)] == gi]
            groups.append(dict(hyper, params=members))
        return {"format": _FORMAT, "state": state, "param_groups": groups}

    def strata_load_sharded_state_dict(self, filled, saved):
        """After strata.checkpoint filled ``filled`` (from
        :meth:`strata_sharded_state_dict` with ``for_load``): the saved
        hyperparameters (``saved``: the checkpoint's structure, group by
        group) and the states not filled in place."""
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        self.load_state_dict({"format": _FORMAT, "state": filled["state"],
                              "param_groups": groups or filled["param_groups"]})

    def state_dict(self):
        """This rank's part (see :meth:`strata_sharded_state_dict`), keyed by
        parameter name when the parameters were given with names, else by
        their index."""
        return self.strata_sharded_state_dict()

    def load_state_dict(self, state_dict):
        """Loads this rank's part as :meth:`state_dict` returned it, for the
        same layout and dp size (strata.checkpoint reshards across dp
        sizes)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise InvalidArgument(
                "DistributedOptimizer.load_state_dict: not a DistributedOptimizer state dict "
                "(a plain optimizer's state cannot be split into this rank's pieces here; "
                "load it through strata.checkpoint, which reshards)")
        if getattr(self, "_keys", None) is None:
            self.strata_sharded_state_dict()
        if self._inner is not None and not all(self._inner.state.get(pc.param)
                                               for pc in self._pieces):
            self._init_state()
        with torch.no_grad():
            for key, fields in state_dict["state"].items():
                pc = self._keys.get(key)
                if pc is None:
                    raise InvalidArgument(
                        f"DistributedOptimizer.load_state_dict: state for '{key}', which is no "
                        "parameter piece of this rank (another layout or dp size? load through "
                        "strata.checkpoint)")
                st = self._inner.state[pc.param]
                for field, v in fields.items():
                    cur = st.get(field)
                    if isinstance(cur, torch.Tensor) and cur.dim() == 1:
                        src = v.reshape(-1)
                        if src.numel() != cur.numel():
                            raise InvalidArgument(
                                f"DistributedOptimizer.load_state_dict: '{key}.{field}' has "
                                f"{src.numel()} elements, this rank's piece {cur.numel()}")
                        if src.data_ptr() != cur.data_ptr():
                            cur.copy_(src)
                    elif isinstance(v, torch.Tensor) and v.dim() == 0:
                        if cur is None or v.data_ptr() != getattr(cur, "data_ptr", lambda: 0)():
                            _set_scalar(st, field, float(v))
                    else:
                        _set_scalar(st, field, float(v))
        groups = state_dict.get("param_groups") or []
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k not in ("params", "param_names"):
                    g[k] = v
        self._state_lost = False

    def __repr__(self):
        r = self._reducers[0]
        n = r.group.size if r.group is not None else 0
        return (f"<strata.optim.DistributedOptimizer of {self._cls.__name__}: "
                f"{len(self._pieces)} pieces on rank {r.group.rank if r.group else '-'} of {n}>")


def _set_scalar(state, field, value):
    cur = state.get(field)
    if isinstance(cur, torch.Tensor):
        cur.fill_(value)
    elif isinstance(cur, int) and not isinstance(cur, bool):
        state[field] = int(value)
    else:
        state[field] = value
