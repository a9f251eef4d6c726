"""In-process recovery: when a rank dies, the survivors agree on who failed,
shrink their communicators, rebuild the world on a smaller mesh, restore the
state of the last committed step and train on, in the same processes.

::

    import strata, strata.elastic as elastic, torch

    elastic.supervise()                              # first: under torchrun, see below
    world = strata.init(strata.Mesh(8, tp=2))        # dp4 x tp2
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = elastic.ElasticSampler(len(dataset), global_batch=64)
    state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler)

    def train_step(ctx):                             # one step of the global batch
        opt.zero_grad()
        x, y = dataset[ctx.samples]                  # this replica's share
        loss = loss_fn(model(x), y) * ctx.loss_scale # mean over the *global* batch
        loss.backward()
        for p in model.parameters():                 # sum over the replicas
            ctx.group("dp").all_reduce(p.grad)
        opt.step()                                   # the commit happens here
        return loss

    result = elastic.run(train_step, state, world, steps=1000)

What happens on a failure (docs/elastic.md has the phases, deadlines and costs):

- **Detection.** A failed collective in the step (strata.RankFailure,
  Aborted, TimeoutError), a rank's heartbeat that stops (a hung or stopped
  rank), or its process gone (probed through /proc on its host). The first
  rank to know raises the epoch's alarm in the store; every other rank's
  monitor thread sees it within ``heartbeat_interval`` and aborts its
  communicators, so a step blocked in a collective returns at once.
- **The commit.** ``optimizer.step()`` (a pre-step hook on each optimizer of
  the State) first asks every rank whether every rank's step completed; if
  not, it raises :class:`StepAborted` and no optimizer and no scheduler
  steps: no replica applies a partial update.
- **Agreement and regroup.** The survivors agree on the failed set and a new
  epoch (a majority of the last epoch must be there, else every rank raises
  :class:`strata.ElasticError`); the data-parallel replicas that lost a rank
  are dropped whole (model-parallel groups must stay whole), their live ranks
  leave (exit 0 with a message), and the world is rebuilt on a mesh with a
  smaller dp. Groups taken from the world (``world.group("tp")``) follow.
- **Restore.** The survivors hold the state of the last committed step; the
  State restores what a failed step may have touched (gradients, model
  buffers, RNG states, user values) and the step is run again, with the same
  global batch split over fewer replicas (``batch="keep"``, the default) or a
  smaller batch (``batch="scale"``). Only when state was lost (or
  ``restore="checkpoint"``) is the last committed checkpoint loaded.

Launchers: ``mpirun --with-ft ulfm`` keeps the survivors running; under
torchrun, call :func:`supervise` first thing in the script, so that a rank
that is killed does not make torchrun stop every other worker.
"""

import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import time

from . import _strata
from ._settings import settings as _settings
from .errors import Aborted, CommError, ElasticError, InvalidArgument, PipelineError

__all__ = [
    "run",
    "recover",
    "supervise",
    "Controller",
    "Options",
    "State",
    "StepContext",
    "StepAborted",
    "ElasticSampler",
    "Result",
    "shutdown",
]


class StepAborted(Aborted):
    """The step was abandoned: some rank's step did not complete (raised by
    ``optimizer.step()`` inside :func:`run`, before anything is applied)."""


_BATCH = ("keep", "scale")
_LEAVE = ("exit", "return")
_RESTORE = ("auto", "memory", "checkpoint")


@dataclasses.dataclass
class Options:
    """Settings of :func:`run` and :class:`Controller` (times in seconds).

    Detection: each rank's monitor thread bumps its heartbeat and looks at one
    other rank's every ``heartbeat_interval``; a heartbeat unchanged for
    ``heartbeat_timeout`` means a hung rank; ``probe_processes`` also finds a
    rank of the same host whose process is gone. Agreement: the leader waits
    up to ``settle_timeout`` for every rank to check in or be shown failed;
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
    never). ``log``: print one JSON line per completed step and per recovery
    on rank 0 (``{"event": "step", ...}``, ``{"event": "recovery", ...}``).
    ``store``: the store to agree through (a :mod:`strata.store` store);
    None: the world's bootstrap store (torchrun's TCPStore), else
    $STRATA_STORE, else a file store in the temporary directory when every
    rank is on this host. ``job``: names this job's keys in a shared store.
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
    log: bool = True
    store: object = None
    job: str = "default"

    def _validate(self):
        for name in ("heartbeat_interval", "heartbeat_timeout", "settle_timeout",
                     "decision_timeout", "rebuild_timeout", "commit_timeout"):
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
        if self.restore == "checkpoint" and not self.checkpoint_dir:
            raise InvalidArgument("strata.elastic.Options.restore is 'checkpoint' but "
                                  "checkpoint_dir is not set")

    def _native(self):
        keys = ("heartbeat_interval", "heartbeat_timeout", "settle_timeout", "decision_timeout",
                "max_leader_takeovers", "rebuild_timeout", "commit_timeout", "max_attempts",
                "probe_processes", "fence_unresponsive", "job")
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
    replica was dropped and ``leave="return"``), ``epoch``."""

    steps: int
    events: list
    left: bool = False
    epoch: int = 1


# ---- the store --------------------------------------------------------------------


def _job_id():
    env = os.environ
    for key in ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "SLURM_JOB_ID"):
        if env.get(key):
            suffix = env.get("SLURM_STEP_ID", "") if key == "SLURM_JOB_ID" else ""
            return "".join(c if c.isalnum() or c in "-_." else "_" for c in env[key] + suffix)
    return None


def _tcp_client(launch, timeout):
    """A new client of the TCPStore the world bootstrapped through (served by
    torchrun's agent, or by rank 0 of an srun job)."""
    import datetime
    import torch.distributed as dist
    from . import store as _store
    host, port = launch.master_addr, launch.master_port
    try:
        t = dist.TCPStore(host, port, launch.world_size, False,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise ElasticError(f"rank {launch.rank}: cannot reach the rendezvous store (torch "
                           f"TCPStore {host}:{port}) for the elastic layer within {timeout:g}s: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return _store.from_torch(t, describe=f"torch TCPStore {host}:{port}")


def _store_for(world, options):
    """(the store the main thread agrees through, the store the monitor
    thread uses or None for the same one)."""
    from . import store as _store
    if options.store is not None:
        s = options.store
        return (s if isinstance(s, _store.Store) else _store.from_torch(s)), None
    boot = getattr(world, "_store", (None, None))[0]
    if boot is not None:
        # Two connections of our own: torch's TCPStore client holds a lock
        # across a blocking wait, so the monitor's heartbeats must not share
        # one with the main thread's waits for commits and decisions (nor
        # with Gloo's rebuild, which goes through the bootstrap connection).
        launch = _strata.launch_env(None)
        return (_tcp_client(launch, options.rebuild_timeout),
                _tcp_client(launch, options.rebuild_timeout))
    url = _settings()["STRATA_STORE"].value
    if url:
        if not url.startswith("file:"):
            raise ElasticError(f"STRATA_STORE={url!r}: strata.elastic takes a file: store URL")
        return _store.file_store(url[len("file:"):].replace("//", "/", 1) + "/elastic"), None
    launch = _strata.launch_env(None)
    job = _job_id()
    if launch.world_size == 1 or (launch.num_nodes == 1 and launch.local_world_size ==
                                  launch.world_size and job):
        path = os.path.join(tempfile.gettempdir(),
                            f"strata-elastic-{job or os.getpid()}-{os.getuid()}")
        return _store.file_store(path), None
    raise ElasticError(
        f"strata.elastic needs a store every rank reaches (rank {launch.rank} of "
        f"{launch.world_size} on {launch.num_nodes} node(s), launcher {launch.launcher}): "
        "under torchrun it uses torchrun's; across nodes under mpirun or srun set "
        "STRATA_STORE=file:/shared/dir or pass Options(store=...)")


def _launcher_warning(launcher, env):
    """What to tell a user whose launcher will undo a recovery, or None."""
    if launcher == "mpirun" and env.get("OMPI_MCA_mpi_ft_enable", "") not in ("1", "true"):
        return ("strata.elastic: mpirun was started without --with-ft ulfm: when a rank dies, "
                "prterun ends the whole job before the survivors can go on; launch with "
                "`mpirun --with-ft ulfm ...` to recover in process")
    return None


# ---- the controller ---------------------------------------------------------------


def _now():
    return time.time()


def _emit(line):
    print(json.dumps(line), flush=True)


class Controller:
    """The steps of :func:`run`, for a training loop written by hand::

        c = elastic.Controller(world, state, options)
        while state.step < steps:
            ctx = c.begin_step()                     # raises strata.CommError when alarmed
            try:
                loss = train_step(ctx)              # optimizer.step() commits
                c.finish_step(ctx)                  # commits if the step did not
            except strata.CommError as e:
                c.fail_step(ctx, e)                 # votes to abandon (if it did not commit)
            if not ctx.committed:
                event = elastic.recover(c)          # agree, regroup, restore; None: left
        c.close()
    """

    def __init__(self, world, state=None, options=None, on_world_changed=None):
        if options is None:
            options = Options()
        if not isinstance(options, Options):
            raise InvalidArgument(f"options must be a strata.elastic.Options, got "
                                  f"{type(options).__name__}")
        options._validate()
        self.world = world
        self.state = state if state is not None else State()
        self.options = options
        self.on_world_changed = on_world_changed
        self._store, self._monitor_store = _store_for(world, options)
        self._loop = _strata._ElasticLoop(world, self._store, self._monitor_store,
                                          options._native())
        self._ctx = None
        self._hooks = [o.register_step_pre_hook(self._pre_step) for o in self.state.optimizers]
        self._saver = None
        self._pending = None  # a recovery event printed once its step completes
        self._start = _now()
        self._last_rank0 = None
        self.events = []
        self._replicas0 = self.world.group("dp").size
        warning = _launcher_warning(_strata.launch_env(None).launcher, os.environ)
        if warning and self.world.rank == 0:
            print(warning, file=sys.stderr, flush=True)
        self.state.commit()

    # -- state of the membership
    @property
    def epoch(self):
        return self._loop.membership["epoch"]

    @property
    def membership(self):
        """{"epoch", "members" (job ranks of the current world), "mesh"}."""
        return self._loop.membership

    def _dp(self):
        g = self.world.group("dp")
        return g.rank, g.size

    # -- one step
    def begin_step(self):
        """The context of the next step (``state.step``). Raises
        :class:`strata.Aborted` when this rank knows of a failure: recover."""
        step = self.state.step
        replica, replicas = self._dp()
        samples, batch = [], 0
        sampler = self.state.sampler
        if sampler is not None:
            batch = sampler.global_batch
            if self.options.batch == "scale":
                batch = -(-sampler.global_batch * replicas // self._replicas0)
            samples = sampler.batch(replica, replicas, batch)
        ctx = StepContext(step, self.world, self.epoch, replica, replicas, samples, batch)
        ctx._controller = self
        self._ctx = ctx
        self._loop.begin_step(step)
        return ctx

    def _vote(self, ctx, ok):
        if ctx._voted:
            return ctx.committed
        ctx._voted = True
        ctx.committed = self._loop.commit(ctx.step, ok)
        return ctx.committed

    def _pre_step(self, optimizer, args, kwargs):
        ctx = self._ctx
        if ctx is None or ctx.committed:
            return None
        if ctx._voted or not self._vote(ctx, True):
            raise StepAborted(f"step {ctx.step} (epoch {ctx.epoch}) was abandoned: a rank's step "
                              "did not complete; nothing was applied")
        return None

    def finish_step(self, ctx, loss=None):
        """Commits ``ctx``'s step if the train step did not (no optimizer
        step in it) and, when committed, advances the State. Returns whether
        the step was committed."""
        if not ctx._voted:
            self._vote(ctx, True)
        if ctx.committed:
            self._advance(ctx, loss)
        return ctx.committed

    def fail_step(self, ctx, error):
        """A step raised ``error`` (a strata.CommError): raise the alarm and
        vote to abandon it; when it had committed already, it counts."""
        self._loop.report_failure(f"{type(error).__name__}: {error}")
        if ctx.committed:
            self._advance(ctx, None)
        else:
            self._vote(ctx, False)

    def _advance(self, ctx, loss):
        st = self.state
        for s in st.schedulers:
            s.step()
        if st.sampler is not None:
            st.sampler.advance(ctx.global_batch)
        st.step = ctx.step + 1
        st.commit()
        self._ctx = None
        now = _now()
        if self._pending is not None:
            self._pending["first_step_s"] = round(now - self._pending["cause"]["failed_at"], 6)
            if self.options.log and self.world.rank == 0:
                _emit(self._pending)
            self._pending = None
        if self.options.log and self.world.rank == 0:
            _emit({"event": "step", "step": st.step, "loss": _scalar(loss),
                   "world": self.world.size, "dp": ctx.replicas,
                   "time": round(now - self._start, 6)})
        if self.options.checkpoint_every and st.step % self.options.checkpoint_every == 0:
            self._save()

    # -- checkpoints
    def _checkpointer(self):
        if self._saver is None:
            from . import checkpoint
            self._saver = checkpoint.AsyncCheckpointer(
                self.options.checkpoint_dir, world=self.world, keep_last=2,
                commit_timeout=self.options.rebuild_timeout)
        return self._saver

    def _save(self):
        self._checkpointer().save(self.state._checkpoint_tree(), step=self.state.step)

    def _load_checkpoint(self):
        from . import checkpoint
        directory = self.options.checkpoint_dir
        if not directory or checkpoint.latest_step(directory) is None:
            raise ElasticError(
                f"rank {self.world.rank}: the state must be loaded from a checkpoint (restore="
                f"{self.options.restore!r} or a part lost its state) but "
                f"{'no checkpoint_dir is set' if not directory else repr(directory) + ' has none'}")
        tree = self.state._checkpoint_tree()
        loaded = checkpoint.load(directory, tree, world=self.world)
        self.state.step = int(loaded["step"])
        self.state._values.update(loaded.get("values", {}))
        if self.state.sampler is not None and isinstance(loaded.get("sampler"), dict):
            self.state.sampler.load_state_dict(loaded["sampler"])
        for o in self.state.optimizers:
            o.zero_grad(set_to_none=True)
        self.state.commit()

    # -- recovery
    def request_change(self, evict=(), why="requested"):
        """A planned membership change: the job ranks ``evict`` leave with
        their replicas (as if they had failed), or, with none, the world is
        rebuilt on the same members. Every rank then recovers."""
        self._loop.request_change([int(r) for r in evict], str(why))

    def recover(self):
        """Agrees with the other survivors, rebuilds the world and restores
        the State. Returns the event (a dict), or None when this rank left
        (its replica was dropped; with ``leave="exit"`` the process exits
        with status 0 instead). Raises :class:`strata.ElasticError` when the
        job cannot go on (a minority, no complete replica, this rank taken
        as failed)."""
        if self._saver is not None:
            # Its communicator belongs to the old world; a save in flight
            # fails with it (it never commits half a checkpoint).
            saver, self._saver = self._saver, None
            try:
                saver.close()
            except Exception:  # noqa: BLE001: the old world's save is abandoned
                pass
        kind, text = self._loop.recover()
        event = json.loads(text)
        if kind == "leave":
            return self._leave(event)
        lost = self._regroup_parts(event)
        how = self.options.restore
        if how == "memory" and lost:
            raise ElasticError(f"rank {self.world.rank}: {len(lost)} part(s) of the State lost "
                               "their state in the regroup and restore='memory'")
        if how == "checkpoint" or lost:
            self._load_checkpoint()
            restored_from = "checkpoint"
        else:
            self.state.restore()
            restored_from = "memory"
        self._loop.record_restore(restored_from)
        event = json.loads(self._loop.events()[-1])
        event["step"] = self.state.step
        self.events.append(event)
        self._pending = event
        if self.on_world_changed is not None:
            self.on_world_changed(event, self.world)
        return event

    def _regroup_parts(self, event):
        """Moves the State's layers onto the rebuilt world; returns the parts
        that lost state in the regroup (a checkpoint must then be loaded).

        strata.nn.DataParallel layers (the State's models, or modules inside
        them, as pipeline stages hold them) are rebuilt on the new dp group
        with ``keep_state=False``: the old group is broken, so nothing moves
        over it. A strata.optim.DistributedOptimizer (ZeRO-1) lost the
        shards of the dropped replica's ranks with them. Other parts may
        implement ``_strata_elastic_regroup(world, event)`` and
        ``_strata_elastic_state_lost(event)``."""
        from ._data_parallel import DataParallel
        from .optim import DistributedOptimizer
        layers = []
        for m in self.state.models:
            for sub in m.modules():
                if isinstance(sub, DataParallel) and not any(sub is x for x in layers):
                    layers.append(sub)
        for layer in layers:
            layer.rebuild(self.world, keep_state=False)
        lost = [o for o in self.state.optimizers if isinstance(o, DistributedOptimizer)]
        for part in self.state._parts():
            hook = getattr(part, "_strata_elastic_regroup", None)
            if hook is not None:
                hook(self.world, event)
            if getattr(part, "_strata_elastic_state_lost", lambda e: False)(event):
                lost.append(part)
        return lost

    def _leave(self, event):
        failed = event["failed"]
        msg = (f"strata.elastic: rank {event['rank']} leaves the job: its data-parallel replica "
               f"lost rank(s) {failed} and was dropped (epoch {event['epoch']}, the others go on "
               f"as {event['mesh_after']['describe']}); exiting with status 0")
        self.events.append(event)
        if self.options.leave == "exit":
            print(msg, file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Not sys.exit: MPI's finalize would wait for the ranks that
            # go on (and for the dead one).
            os._exit(0)
        print(msg.replace("; exiting with status 0", ""), file=sys.stderr, flush=True)
        return None

    def close(self):
        """Stops the monitor thread and removes the optimizer hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        self._loop.stop()


def _scalar(loss):
    if loss is None:
        return None
    try:
        return float(loss.detach()) if hasattr(loss, "detach") else float(loss)
    except (TypeError, ValueError):
        return None


def recover(controller):
    """Agree, regroup and restore after a failure (what :func:`run` does when
    a step is abandoned): ``controller`` is a :class:`Controller`. Returns the
    recovery event, or None when this rank left."""
    return controller.recover()


def run(train_step, state, world, options=None, *, steps, on_world_changed=None):
    """Runs ``train_step(ctx)`` until ``state.step == steps``, recovering from
    failed ranks in the same processes (see the module's documentation).

    ``train_step`` gets a :class:`StepContext`, runs forward, backward and
    the gradient reductions, calls ``optimizer.step()`` (where every rank
    agrees the step completed; if not, :class:`StepAborted` is raised there
    and the step is run again after the recovery) and returns the loss
    (printed by rank 0). ``on_world_changed(event, world)`` runs after every
    recovery (rescale the learning rate, rebuild a pipeline schedule).
    Collective: every rank calls it. Returns a :class:`Result`."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InvalidArgument(f"run: steps must be an int >= 0, got {steps!r}")
    if not isinstance(state, State):
        raise InvalidArgument(f"run: state must be a strata.elastic.State, got "
                              f"{type(state).__name__}")
    c = Controller(world, state, options, on_world_changed)
    try:
        while state.step < steps:
            try:
                ctx = c.begin_step()
            except CommError as e:
                ctx = c._ctx
                c.fail_step(ctx, e)
            else:
                try:
                    loss = train_step(ctx)
                except StepAborted:
                    pass
                except (CommError, PipelineError) as e:  # a pipeline step's peer failed
                    c.fail_step(ctx, e)
                else:
                    c.finish_step(ctx, loss)
            if not ctx.committed:
                if c.recover() is None:
                    return Result(state.step, c.events, left=True, epoch=c.epoch)
        return Result(state.step, c.events, left=False, epoch=c.epoch)
    finally:
        c.close()


def shutdown(world, result=None, code=0):
    """Ends an elastic job's process: destroys ``world`` and exits with
    ``code``. On the MPI backend after ranks were lost (``result`` has
    events, or no ``result`` is given), the process leaves with ``os._exit``
    once its output is flushed: Open MPI 5's MPI_Finalize can wait forever
    for the dead rank (docs/mpi.md). Otherwise it returns after destroying
    the world (the interpreter exits normally)."""
    backend = None
    try:
        backend = world.group().backend
    except Exception:  # noqa: BLE001: a destroyed world
        pass
    world.destroy()
    lost = result is None or bool(getattr(result, "events", None))
    if backend == "mpi" and lost:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


# ---- launchers --------------------------------------------------------------------


def supervise():
    """Makes a rank's death survivable under torchrun: call it first thing in
    the script (before importing torch). Under torchrun the process forks;
    the child returns from this call and trains; the parent (the process
    torchrun watches) waits for it. When the child is killed by a signal
    (SIGKILL, a crash), the parent prints why and exits with status 0, so
    torchrun's agent does not stop every other worker (it does on a non-zero
    exit); a child that exits returns its status through the parent.
    Signals sent to the parent (torchrun stopping the job) are passed on to
    the child. Does nothing outside torchrun or when already supervised."""
    env = os.environ
    if not env.get("TORCHELASTIC_RUN_ID") or _settings()["STRATA_ELASTIC_SUPERVISED"].value:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        env["STRATA_ELASTIC_SUPERVISED"] = str(os.getppid())
        _die_with_parent()
        return
    forwarded = []

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in forwarded:
            os._exit(128 + sig)
        name = signal.Signals(sig).name
        print(f"strata.elastic.supervise: rank {env.get('RANK', '?')}'s training process (pid "
              f"{pid}) was killed by {name}; exiting with status 0 so that torchrun lets the "
              "other ranks go on without it", file=sys.stderr, flush=True)
        os._exit(0)
    os._exit(os.WEXITSTATUS(status))


def _die_with_parent():
    """The child gets SIGKILL when the supervising parent dies (Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(1)
    except (OSError, AttributeError):
        pass
