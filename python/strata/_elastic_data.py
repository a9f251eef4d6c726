"""The values of strata.elastic: its Options, the ElasticSampler, the State a
recovery keeps, the StepContext of one step and the Result of a run
(re-exported by :mod:`strata.elastic`, documented there)."""

import dataclasses
import random

from .errors import InvalidArgument

_BATCH = ("keep", "scale")
_LEAVE = ("exit", "return")
_RESTORE = ("auto", "memory", "checkpoint")


@dataclasses.dataclass
class Options:
    """Settings of :func:`run` and :class:`Controller` (times in seconds).

    Detection: each rank's monitor waits for the alarm (a TCPStore, as
    under torchrun) or looks at it every ``heartbeat_interval`` (a file
    store), and bumps its heartbeat and looks at one other
    rank's every ``heartbeat_timeout / 10`` (at least every interval); a
    heartbeat unchanged for ``heartbeat_timeout`` means a hung rank; ``probe_processes`` also finds a
    rank of the same host whose process is gone. Agreement: the leader waits
    up to ``settle_timeout`` for every rank to check in or be shown failed
    (one whose heartbeat still changes: up to ``decision_timeout / 2``);
    the others wait ``decision_timeout`` for it before taking over (at most
    ``max_leader_takeovers`` times). ``rebuild_timeout`` bounds the shrink
    and the rebuild of the world; ``commit_timeout`` a wait for the other
    ranks' votes (a hung rank is caught sooner by its heartbeat). A failure
    during a recovery starts it again, at most ``max_attempts`` times.
    ``fence_unresponsive``: a rank taken as failed whose process still exists
    on the leader's host (stopped, hung) is killed.

    ``batch``: "keep" (the global batch stays; the remaining replicas take
    more samples each) or "scale" (each replica keeps its share; the global
    batch shrinks with dp: rescale the learning rate in ``on_world_changed``).
    ``leave``: what the live ranks of a dropped replica do: "exit" (print why
    and exit the process with status 0) or "return" (run returns a Result
    with ``left=True``). ``restore``: "auto" (memory, unless a State part
    says its state was lost), "memory", or "checkpoint" (always load the last
    checkpoint of ``checkpoint_dir``). ``checkpoint_every``: save the State
    asynchronously to ``checkpoint_dir`` every so many committed steps (0:
    never); ``checkpoint_options``: keyword arguments of the
    :class:`strata.checkpoint.AsyncCheckpointer` it saves with (``keep_last``
    is 2 unless given). ``log``: print one JSON line per completed step and per recovery
    on rank 0 (``{"event": "step", ...}``, ``{"event": "recovery", ...}``).
    ``store``: the store to agree through (a :mod:`strata.store` store; a
    ``torch.distributed`` store is used through a Python adapter whose every
    operation takes the GIL, so for a TCPStore prefer
    ``strata.store.tcp_store(host, port)``); None: the world's bootstrap
    store (torchrun's TCPStore, through strata's own client), else
    $STRATA_STORE, else a file store in /dev/shm (or the temporary
    directory) when every rank is on this host. ``job``: names this job's keys in a shared store.
    ``straggler``: a :class:`StragglerPolicy` (None: no policy): ranks whose
    compute time stays well above the others' are evicted or reported.

    Growing back: ``config`` is what a joining process must match (a digest
    of the model's configuration, the code's version: a joiner with another
    is refused, naming both); ``grow``: spares and joiners form new replicas
    while dp is below the job's first dp (else they stand by);
    ``join_timeout``: how long a joiner waits to be admitted.
    """

    heartbeat_interval: float = 0.1
    heartbeat_timeout: float = 3.0
    settle_timeout: float = 2.0
    decision_timeout: float = 10.0
    max_leader_takeovers: int = 3
    rebuild_timeout: float = 60.0
    commit_timeout: float = 600.0
    max_attempts: int = 5
    probe_processes: bool = True
    fence_unresponsive: bool = True
    batch: str = "keep"
    leave: str = "exit"
    restore: str = "auto"
    checkpoint_dir: str = None
    checkpoint_every: int = 0
    checkpoint_options: dict = None
    log: bool = True
    store: object = None
    job: str = "default"
    straggler: object = None
    config: str = ""
    grow: bool = True
    join_timeout: float = 300.0

    def _validate(self):
        if not isinstance(self.config, str):
            raise InvalidArgument(f"strata.elastic.Options.config must be a str, got "
                                  f"{type(self.config).__name__}")
        if not isinstance(self.grow, bool):
            raise InvalidArgument(f"strata.elastic.Options.grow must be True or False, got "
                                  f"{self.grow!r}")
        for name in ("heartbeat_interval", "heartbeat_timeout", "settle_timeout",
                     "decision_timeout", "rebuild_timeout", "commit_timeout", "join_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidArgument(f"strata.elastic.Options.{name} must be a positive number "
                                      f"of seconds, got {v!r}")
        for name, allowed in (("batch", _BATCH), ("leave", _LEAVE), ("restore", _RESTORE)):
            if getattr(self, name) not in allowed:
                raise InvalidArgument(f"strata.elastic.Options.{name} must be one of "
                                      f"{', '.join(map(repr, allowed))}, got "
                                      f"{getattr(self, name)!r}")
        for name in ("max_attempts", "max_leader_takeovers", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgument(f"strata.elastic.Options.{name} must be an int >= 0, got "
                                      f"{v!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise InvalidArgument("strata.elastic.Options.checkpoint_every is "
                                  f"{self.checkpoint_every} but checkpoint_dir is not set")
        if self.checkpoint_options is not None and not isinstance(self.checkpoint_options, dict):
            raise InvalidArgument("strata.elastic.Options.checkpoint_options must be a dict of "
                                  "strata.checkpoint.AsyncCheckpointer arguments, got "
                                  f"{type(self.checkpoint_options).__name__}")
        if self.straggler is not None:
            from ._elastic_stragglers import StragglerPolicy
            if not isinstance(self.straggler, StragglerPolicy):
                raise InvalidArgument("strata.elastic.Options.straggler must be a "
                                      "strata.elastic.StragglerPolicy or None, got "
                                      f"{type(self.straggler).__name__}")
            self.straggler._validate()
        if self.restore == "checkpoint" and not self.checkpoint_dir:
            raise InvalidArgument("strata.elastic.Options.restore is 'checkpoint' but "
                                  "checkpoint_dir is not set")

    def _native(self):
        keys = ("heartbeat_interval", "heartbeat_timeout", "settle_timeout", "decision_timeout",
                "max_leader_takeovers", "rebuild_timeout", "commit_timeout", "max_attempts",
                "probe_processes", "fence_unresponsive", "job", "config", "grow", "join_timeout")
        return {k: getattr(self, k) for k in keys}


# ---- data -------------------------------------------------------------------------


class ElasticSampler:
    """The samples of each global step, split over however many data-parallel
    replicas there are now, so that every sample of an epoch is used exactly
    once across changes of dp.

    The samples form one stream: epoch e is a permutation of
    ``range(num_samples)`` (seeded by ``seed + e``; the identity without
    ``shuffle``), the epochs one after another. A step takes the next
    ``global_batch`` samples of the stream; replica d of D takes the d-th of D
    contiguous, near-equal slices of them (uneven splits allowed: scale the
    loss by ``len(mine) / global_batch``, which :class:`StepContext` gives as
    ``loss_scale``). ``position`` counts the samples of committed steps; a
    failed step's samples are handed out again, split for the new dp.

    ``record=True`` keeps every hand-out in ``records`` as (position, replica,
    replicas, indices), for tests."""

    def __init__(self, num_samples, global_batch, *, shuffle=True, seed=0, record=False):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise InvalidArgument(f"ElasticSampler: num_samples must be an int >= 1, got "
                                  f"{num_samples!r}")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise InvalidArgument(f"ElasticSampler: global_batch must be an int >= 1, got "
                                  f"{global_batch!r}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.shuffle = shuffle
        self.seed = seed
        self.position = 0
        self.records = [] if record else None
        self._perm_epoch = None
        self._perm = None

    @property
    def epoch(self):
        """The epoch of the next sample."""
        return self.position // self.num_samples

    def _permutation(self, epoch):
        if self._perm_epoch != epoch:
            perm = list(range(self.num_samples))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    def _stream(self, start, count):
        out = []
        k = start
        while len(out) < count:
            epoch, offset = divmod(k, self.num_samples)
            take = min(count - len(out), self.num_samples - offset)
            out.extend(self._permutation(epoch)[offset:offset + take])
            k += take
        return out

    def batch(self, replica, replicas, global_batch=None):
        """This replica's sample indices of the next step (not consumed until
        :meth:`advance`)."""
        if not 0 <= replica < replicas:
            raise InvalidArgument(f"ElasticSampler.batch: replica {replica} is not in "
                                  f"[0, {replicas})")
        b = self.global_batch if global_batch is None else global_batch
        begin = b * replica // replicas
        end = b * (replica + 1) // replicas
        mine = self._stream(self.position + begin, end - begin)
        if self.records is not None:
            self.records.append((self.position, replica, replicas, list(mine)))
        return mine

    def advance(self, count):
        """Consumes ``count`` samples (a committed step's)."""
        self.position += count

    def state_dict(self):
        return {"position": self.position, "num_samples": self.num_samples,
                "global_batch": self.global_batch, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, sd):
        self.position = int(sd["position"])

    def __repr__(self):
        return (f"ElasticSampler({self.num_samples} samples, global batch {self.global_batch}, "
                f"position {self.position}, epoch {self.epoch})")


# ---- state ------------------------------------------------------------------------


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _rng_states():
    import torch
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy
        states["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return states


def _set_rng_states(states):
    import torch
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy
        numpy.random.set_state(states["numpy"])


class State:
    """What a recovery keeps: the model(s), optimizer(s), scheduler(s), the
    sampler, the step counter and any user values (``State(model=m,
    optimizer=o, epoch_loss=0.0)``; ``state.epoch_loss`` reads and writes
    them), as Horovod's ``TorchState``.

    :func:`run` commits the State after every committed step and restores it
    after a recovery. Parameters and optimizer states are not copied: the
    step commit guarantees that a failed step never applied them (change
    parameters only through the optimizer inside a step). What a failed step
    may have touched is copied at the commit and put back: model buffers
    (BatchNorm statistics), schedulers' states, RNG states (torch, Python,
    numpy) and user values (deep copies); gradients are zeroed.

    Schedulers given here are stepped by :func:`run` after each committed
    step (do not step them in the train step). Hooks for layers that hold
    data-parallel state (implemented by the part, found by name):
    ``part._strata_elastic_regroup(world, event)`` after the world was rebuilt,
    and ``part._strata_elastic_state_lost(event)`` returning True when the
    regroup lost state of the part (ZeRO shards of a dropped replica): the
    last checkpoint is then loaded."""

    _own = ("models", "optimizers", "schedulers", "sampler", "step", "_values", "_snapshot")

    def __init__(self, model=None, optimizer=None, scheduler=None, sampler=None, **values):
        object.__setattr__(self, "_values", {})
        self.models = _as_list(model)
        self.optimizers = _as_list(optimizer)
        self.schedulers = _as_list(scheduler)
        self.sampler = sampler
        self.step = 0
        self._snapshot = None
        for k, v in values.items():
            self._values[k] = v

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"strata.elastic.State has no value {name!r}")

    def __setattr__(self, name, value):
        if name in State._own:
            object.__setattr__(self, name, value)
        else:
            self._values[name] = value

    @property
    def values(self):
        """The user values (a dict)."""
        return self._values

    def commit(self):
        """Records what a later :meth:`restore` puts back (cheap: no
        parameters, no optimizer state)."""
        import copy
        buffers = [{n: b.detach().clone() for n, b in m.named_buffers()} for m in self.models]
        self._snapshot = {
            "step": self.step,
            "values": copy.deepcopy(self._values),
            "buffers": buffers,
            "schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers],
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "rng": _rng_states(),
        }

    def restore(self):
        """Puts the last :meth:`commit` back and zeroes the gradients."""
        import torch
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        for m in self.models:
            m.zero_grad(set_to_none=True)
        snap = self._snapshot
        if snap is None:
            return
        self.step = snap["step"]
        import copy
        object.__setattr__(self, "_values", copy.deepcopy(snap["values"]))
        with torch.no_grad():
            for m, saved in zip(self.models, snap["buffers"]):
                for n, b in m.named_buffers():
                    if n in saved:
                        b.copy_(saved[n])
        for s, sd in zip(self.schedulers, snap["schedulers"]):
            s.load_state_dict(copy.deepcopy(sd))
        if self.sampler is not None and snap["sampler"] is not None:
            self.sampler.load_state_dict(snap["sampler"])
        _set_rng_states(snap["rng"])

    def _parts(self):
        return self.models + self.optimizers + self.schedulers

    def _checkpoint_tree(self):
        tree = {"step": self.step, "values": dict(self._values)}
        for i, m in enumerate(self.models):
            tree[f"model{i}"] = m
        for i, o in enumerate(self.optimizers):
            tree[f"optimizer{i}"] = o
        for i, s in enumerate(self.schedulers):
            tree[f"scheduler{i}"] = s
        if self.sampler is not None:
            tree["sampler"] = self.sampler.state_dict()
        return tree

    def __repr__(self):
        return (f"<strata.elastic.State step {self.step}: {len(self.models)} model(s), "
                f"{len(self.optimizers)} optimizer(s), {len(self.schedulers)} scheduler(s), "
                f"values {sorted(self._values)}>")


# ---- the step -----------------------------------------------------------------------


class StepContext:
    """What a train step sees: ``step`` (committed steps before it), ``world``
    and ``group(axes)`` (the current world's groups), ``epoch`` (the
    membership epoch: +1 at every recovery), ``replica`` / ``replicas`` (this
    data-parallel replica and how many there are now), ``samples`` (this
    replica's sample indices of the step, from the State's sampler),
    ``global_batch``, ``loss_scale`` (``len(samples) / global_batch``:
    multiply a loss averaged over this replica's samples by it and sum the
    gradients over dp to get the mean over the global batch, whatever dp is)
    and ``microbatches(size)``."""

    def __init__(self, step, world, epoch, replica, replicas, samples, global_batch):
        self.step = step
        self.world = world
        self.epoch = epoch
        self.replica = replica
        self.replicas = replicas
        self.samples = samples
        self.global_batch = global_batch
        self.committed = False
        self._voted = False
        self._commit_wait = 0.0  # seconds this rank waited for the commit's votes

    @property
    def loss_scale(self):
        if not self.global_batch:
            return 1.0
        return len(self.samples) / self.global_batch

    def group(self, axes="world"):
        return self.world.group(axes)

    def request_change(self, evict=(), why="requested"):
        """A planned membership change from inside a step (see
        :meth:`Controller.request_change`): the step is then abandoned and run
        again after the regroup, as after a failure."""
        self._controller.request_change(evict, why)

    def microbatches(self, size):
        """This replica's samples in chunks of at most ``size`` (fewer
        replicas take more microbatches)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"microbatches: size must be an int >= 1, got {size!r}")
        for i in range(0, len(self.samples), size):
            yield self.samples[i:i + size]

    def __repr__(self):
        return (f"<strata.elastic.StepContext step {self.step}, epoch {self.epoch}, replica "
                f"{self.replica} of {self.replicas}, {len(self.samples)} samples>")


@dataclasses.dataclass
class Result:
    """What :func:`run` returns: ``steps`` (the committed step count),
    ``events`` (one dict per recovery, as printed), ``left`` (this rank's
    replica was dropped and ``leave="return"``), ``epoch``, ``stood_by``
    (a spare that the job never needed: it trained nothing)."""

    steps: int
    events: list
    left: bool = False
    epoch: int = 1
    stood_by: bool = False
