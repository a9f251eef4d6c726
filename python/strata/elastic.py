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
  monitor sees it (at once on a TCPStore, within ``heartbeat_interval`` on
  a file store) and aborts its communicators: a blocked step returns.
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

import contextlib
import json
import os
import sys
import time

from . import _strata
from .errors import Aborted, CommError, ElasticError, InvalidArgument, PipelineError
from ._elastic_data import ElasticSampler, Options, Result, State, StepContext
from ._elastic_stragglers import StragglerPolicy, Watch as _Watch, why as _straggler_why
from ._elastic_transfer import receiving_state, unsaved_buffers as _unsaved_buffers
from ._elastic_launch import (_LEFT, _before_exit, _finished_before_joining,  # noqa
                              _launcher_warning, _release_store, _served_store, _store_for,
                              _supervised, shutdown, supervise)

__all__ = [
    "run",
    "recover",
    "supervise",
    "Controller",
    "Options",
    "StragglerPolicy",
    "State",
    "StepContext",
    "StepAborted",
    "ElasticSampler",
    "Result",
    "shutdown",
    "receiving_state",
]


class StepAborted(Aborted):
    """The step was abandoned: some rank's step did not complete (raised by
    ``optimizer.step()`` inside :func:`run`, before anything is applied)."""


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
            if not ctx.committed or c.admitting:   # or joiners wait
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
        self.options = options
        self.on_world_changed = on_world_changed
        self._store, self._monitor_store, self._store_dir = _store_for(world, options)
        self._serving = _served_store(world, options)  # a rank serves the store: see close()
        self._arrived = None  # a joiner placed in the mesh: its state comes first
        if getattr(world, "_join", None) is not None:
            self._loop = self._join(world)
        else:
            self._loop = _strata._ElasticLoop(world, self._store, self._monitor_store,
                                              options._native())
        self._ctx = None
        self._closed = False
        self._hooks = []
        self._saver = None
        self._pending = None  # a recovery event printed once its step completes
        self._start = _now()
        self._last_rank0 = None
        self.events = []
        mesh = self._loop.membership["mesh"]
        self._replicas0 = (self._loop.membership["full_dp"] or mesh["dp"]
                           or mesh["world_size"] // (mesh["tp"] * mesh["cp"] * mesh["pp"]))
        self._watch = None
        if options.straggler is not None:
            self._watch = _Watch(options.straggler, getattr(world, "metrics", None))
        self._planned = None  # a straggler eviction requested, until its recovery
        self._job_ranks = list(self._loop.membership["members"])
        self._with_spares = self._loop.membership["spares"] > 0  # at the start of the job
        warning = _launcher_warning(_strata.launch_env(None).launcher, os.environ)
        if warning and self.world.rank == 0 and not world.is_spare:
            print(warning, file=sys.stderr, flush=True)
        self.state = None
        self._admitting = False  # joiners admitted after the last step: recover
        # A spare's (or joiner's) State is made once it has a place.
        if not world.is_spare and self._arrived is None:
            self.attach(state if state is not None else State())

    def _join(self, world):
        """A joiner (STRATA_ELASTIC_JOIN): warms up, asks to be admitted, takes
        the World it is given (a spare's, or a new replica's: its state comes
        from its dp group, :meth:`stand_by`); exits 0 if the job finished."""
        _warm_up()  # before asking: the members wait while a placed joiner builds
        args, world._join = world._join, None
        loop, world._raw = _strata._join_elastic(self._store, self._monitor_store,
                                                 self.options._native(), **args)
        if loop is None:
            _finished_before_joining(self.options.job)
        event = json.loads(loop.events()[-1])
        if event["placed"]:
            self._arrived = event
        return loop

    def attach(self, state):
        """Makes ``state`` the State this controller commits and restores
        (done by the constructor on members; on a spare once it was placed,
        :meth:`stand_by`)."""
        if not isinstance(state, State):
            raise InvalidArgument(f"state must be a strata.elastic.State, got "
                                  f"{type(state).__name__}")
        optim = sys.modules.get(__package__ + ".optim")
        if self._with_spares:
            if self.options.restore == "checkpoint":
                raise InvalidArgument(
                    "strata.elastic spares take the state of their place from a member; "
                    "restore='checkpoint' is not supported with spares (use 'auto' or 'memory')")
            for o in state.optimizers:
                if optim is not None and isinstance(o, optim.DistributedOptimizer):
                    raise InvalidArgument(
                        "strata.elastic spares and a strata.optim.DistributedOptimizer (ZeRO-1): "
                        "a placed spare would need the optimizer shard its position lost; use "
                        "spares=0 (a failure then reloads the checkpoint) or a replicated "
                        "optimizer")
        self.state = state
        self._hooks = [o.register_step_pre_hook(self._pre_step) for o in state.optimizers]
        state.commit()

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
        if self._watch is not None and self._watch.due():
            found = self._watch.exchange(self.world, self._loop.rank)
            if found:
                self._planned = {"reason": "straggler", "stragglers": found}
                # Every rank takes this decision here, from the same
                # numbers: nobody is inside an operation the others left,
                # so the communicators need no abort (one would fail the
                # all-gather on a rank still finishing it).
                self._loop.request_change([x["rank"] for x in found],
                                          _straggler_why(found, self.options.straggler), False)
                self._loop.begin_step(step)  # raises strata.Aborted: the alarm is raised
        return ctx

    def _vote(self, ctx, ok):
        if ctx._voted:
            return ctx.committed
        ctx._voted = True
        t0 = time.perf_counter()
        ctx.committed = self._loop.commit(ctx.step, ok)
        ctx._commit_wait = time.perf_counter() - t0
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
        if self._watch is not None:
            self._watch.record(ctx.step, ctx._commit_wait)
        now = _now()
        if self._pending is not None:
            pending = self._pending
            pending["first_step_s"] = round(now - pending["cause"]["failed_at"], 6)
            if self.options.log and self.world.rank == 0:
                if pending.get("joined"):
                    _emit({"event": "join", "epoch": pending["epoch"],
                           "joined": pending["joined"], "grown": pending.get("grown", []),
                           "spares": pending["spares"], "dp": ctx.replicas,
                           "world": self.world.size, "first_step_s": pending["first_step_s"]})
                if pending.get("replaced"):
                    _emit({"event": "spare", "epoch": pending["epoch"],
                           "placed": [{"failed": f, "spare": s} for f, s in pending["replaced"]],
                           "spares_left": pending["spares"], "dp": ctx.replicas,
                           "world": self.world.size, "first_step_s": pending["first_step_s"]})
                _emit(pending)
            self._pending = None
        if self.options.log and self.world.rank == 0:
            _emit({"event": "step", "step": st.step, "loss": _scalar(loss),
                   "world": self.world.size, "dp": ctx.replicas,
                   "time": round(now - self._start, 6)})
        if self.options.checkpoint_every and st.step % self.options.checkpoint_every == 0:
            self._save()
        if self._loop.joiners_waiting:
            # Every member learnt it with this step's commit: all admit the
            # joiners here, between steps, and recover (run() does).
            self._loop.admit(st.step)
            self._admitting = True

    @property
    def admitting(self):
        """True after a committed step that said processes wait to join: a
        loop written by hand calls :func:`recover` then (as after a step that
        did not commit)."""
        return self._admitting

    # -- checkpoints
    def _checkpointer(self):
        if self._saver is None:
            from . import checkpoint
            kwargs = {"keep_last": 2, "commit_timeout": self.options.rebuild_timeout}
            kwargs.update(self.options.checkpoint_options or {})
            self._saver = checkpoint.AsyncCheckpointer(self.options.checkpoint_dir,
                                                       world=self.world, **kwargs)
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
        self._admitting = False
        while True:
            event = self._recover_once()
            if event is not True:
                return event

    def _recover_once(self):
        """One recovery; True when the restore on the new world failed (a rank
        lost meanwhile, such as a joiner that died while it would receive its
        state: its alarm is raised, recover again)."""
        kind, text = self._loop.recover()
        event = json.loads(text)
        planned, self._planned = self._planned, None
        if planned is not None and event["cause"]["source"] == "request" and \
                sorted(event["cause"]["evict"]) == sorted(x["rank"] for x in planned["stragglers"]):
            event.update(planned)
        if self._watch is not None:
            self._watch.reset()
        if kind == "leave":
            return self._leave(event)
        try:
            restored_from = self._restore(event)
        except CommError as e:
            # A rank lost while the state moves or the layers regroup (a
            # joiner that died while it would receive its state): that is
            # the next epoch's failure; recover again.
            why = f"restoring after epoch {event['epoch']}'s regroup: {type(e).__name__}: {e}"
            self._loop.report_failure(why)
            event["restore_failed"] = why  # kept in events; the next recovery follows
            self.events.append(event)
            return True
        return self._restored(restored_from,
                              {k: event[k] for k in ("reason", "stragglers") if k in event})

    def _restore(self, event):
        """The State of the last committed step on the rebuilt world; returns
        where it came from."""
        if (event.get("replaced") or event.get("grown")) and self.options.restore != "checkpoint":
            # A spare was placed or a replica grew: the state of the last
            # committed step goes to the newcomers first (restored here),
            # then every layer moves to the new groups with them (they do
            # the same, in this order).
            self.state.restore()
            self._share_state(event)
            self._spare_regroup(event)
            return "memory"
        lost = self._regroup_parts(event)
        how = self.options.restore
        if how == "memory" and lost:
            raise ElasticError(f"rank {self.world.rank}: {len(lost)} part(s) of the State "
                               "lost their state in the regroup and restore='memory'")
        if how == "checkpoint" or lost:
            self._load_checkpoint()
            return "checkpoint"
        self.state.restore()
        return "memory"

    def _restored(self, restored_from, labels):
        """Records the restore; the event (as recorded, with ``labels`` and
        the step to run) is kept, printed at the next step and given to
        on_world_changed."""
        self._loop.record_restore(restored_from)
        event = json.loads(self._loop.events()[-1])
        event.update(labels)
        event["step"] = self.state.step
        self.events.append(event)
        self._pending = event
        if self.on_world_changed is not None:
            self.on_world_changed(event, self.world)
        return event

    def stand_by(self, build=None):
        """On a spare (``world.is_spare``): waits, cheaply, until a failure
        gives this rank a failed member's place, then makes its State
        (``build(world)``, or the State given to the constructor), receives
        the state of its position from its data-parallel group and returns
        the recovery event; returns None when the job finished without
        needing it. On a member: returns None at once."""
        if self._arrived is not None:  # a joiner placed at once
            event, self._arrived = self._arrived, None
        elif not self.world.is_spare:
            return None
        else:
            _warm_up()
            kind, text = self._loop.stand_by()
            if kind == "finished":
                return None
            event = json.loads(text)
            if kind == "leave":
                return self._leave(event)
        from ._data_parallel import deferred_sync
        from ._elastic_transfer import Prefetch, Receiving
        # Its state arrives while it builds its models (a thread receives
        # what comes before the models' tensors, then those into the built
        # models); strata's layers leave their weights uninitialised then.
        plan = self._transfer_plan(event)
        if plan is None:
            raise ElasticError(f"rank {self.world.rank} was placed by epoch {event['epoch']}'s "
                               "regroup, which names it neither a placed spare nor grown")
        dp, sources, _ = plan
        arriving = Prefetch(dp, sources)
        try:
            with deferred_sync(), Receiving():
                if build is not None:
                    self.attach(build(self.world))
                elif self.state is None:
                    self.attach(State())
        except BaseException:
            arriving.built([])  # the thread receives the rest into new tensors
            raise
        arriving.built([m.state_dict() for m in self.state.models])
        # The gradient buffers take the member's bucket order (and are
        # zeroed, their pages touched the first time) while the models'
        # tensors arrive.
        self._adopt_layouts(arriving.skeleton()["layouts"])
        self._load_state(arriving.result())
        self._spare_regroup(event)
        return self._restored("replica", {})

    def _spare_regroup(self, event):
        """_regroup_parts after a spare was placed: a part that lost state
        cannot be restored from the checkpoint then (the spare has none of
        it), so that stops the job by name."""
        lost = self._regroup_parts(event)
        if lost:
            raise ElasticError(
                f"rank {self.world.rank}: {len(lost)} part(s) of the State lost their state in "
                f"the regroup that placed rank(s) "
                f"{[s for _, s in event['replaced']] + event.get('grown', [])}; spares and "
                "joiners take the state of their place from a member, not from a checkpoint")

    def _transfer_plan(self, event):
        """(dp group, the ranks that send, the ranks that receive) when this
        rank's data-parallel group gained ranks in the regroup of ``event``
        (placed spares, a grown replica), else None. Every member of the
        group sends a share (their states are equal)."""
        placed = {pair[1] for pair in event.get("replaced") or []} | set(event.get("grown") or [])
        if not placed:
            return None
        members = event["members"]
        jobs = [members[r] for r in self.world.mesh.group_of(self.world.rank, "dp")]
        newcomers = [i for i, j in enumerate(jobs) if j in placed]
        if not newcomers:
            return None
        sources = [i for i, j in enumerate(jobs) if j not in placed]
        return self.world.group("dp"), sources, newcomers

    def _share_state(self, event):
        """After a regroup that placed spares or grew a replica, on a member:
        in every data-parallel group that gained ranks, the members send
        their state (step, parameters and buffers, optimizer and scheduler
        states, sampler, user values) to each newcomer (:meth:`stand_by`),
        point to point: the first member all but the parameters and
        optimizer states, which all hold alike and send in turn."""
        import torch
        from ._elastic_transfer import send_state
        plan = self._transfer_plan(event)
        if plan is None or plan[0].rank not in plan[1]:
            return
        dp, sources, newcomers = plan
        st = self.state
        # Equal on every member of the group (the invariant of data
        # parallelism): the parameters and the optimizers' states, which
        # the members send in turn.
        shared = [p for m in st.models for p in m.parameters()] + [
            t for o in st.optimizers for per_param in o.state.values()
            for t in per_param.values() if isinstance(t, torch.Tensor)]
        # The models last: a newcomer receives the rest while it builds.
        state = {
            "step": st.step, "values": st._values,
            "layouts": [layer._layout_state() for layer in self._dp_layers()],
            "optimizers": [o.state_dict() for o in st.optimizers],
            "schedulers": [x.state_dict() for x in st.schedulers],
            "sampler": None if st.sampler is None else st.sampler.state_dict(),
            "buffers": [_unsaved_buffers(m) for m in st.models],
            "models": [m.state_dict() for m in st.models]}
        send_state(dp, newcomers, state, part=sources.index(dp.rank), parts=len(sources),
                   shared=shared)

    def _load_state(self, got):
        """On a newcomer: loads what :meth:`_share_state` sent (the models'
        tensors arrived in place already; the layouts were adopted)."""
        import torch
        st = self.state
        st.step = int(got["step"])
        st._values.update(got["values"])
        for m, sd, extra in zip(st.models, got["models"], got["buffers"]):
            m.load_state_dict(sd)  # what arrived in place is not copied again
            mine = _unsaved_buffers(m)
            if mine.keys() != extra.keys():
                raise ElasticError(
                    f"rank {self.world.rank}: the model built for its place has the buffers "
                    f"{sorted(mine)} outside its state_dict, the member's {sorted(extra)}: "
                    "build(world) must make the same model on every rank")
            with torch.no_grad():
                for name, b in mine.items():
                    b.copy_(extra[name])
        for o, sd in zip(st.optimizers, got["optimizers"]):
            o.load_state_dict(sd)
        for x, sd in zip(st.schedulers, got["schedulers"]):
            x.load_state_dict(sd)
        if st.sampler is not None and got["sampler"] is not None:
            st.sampler.load_state_dict(got["sampler"])
        st.commit()

    def _adopt_layouts(self, layouts):
        """On a newcomer: its strata.nn.DataParallel layers take the member's
        bucket orders (sent by :meth:`_share_state`)."""
        layers = self._dp_layers()
        if len(layers) != len(layouts):
            raise ElasticError(
                f"rank {self.world.rank}: the State built for its place holds {len(layers)} "
                f"strata.nn.DataParallel layer(s), the member's {len(layouts)}: build(world) "
                "must make the same model on every rank")
        for layer, layout in zip(layers, layouts):
            layer._adopt_layout(layout)

    def _dp_layers(self):
        """The strata.nn.DataParallel layers of the State's models (or inside
        them, as pipeline stages hold them), in module order."""
        from ._data_parallel import DataParallel
        layers = []
        for m in self.state.models:
            for sub in m.modules():
                if isinstance(sub, DataParallel) and not any(sub is x for x in layers):
                    layers.append(sub)
        return layers

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
        # Not imported here when the script never did: a DistributedOptimizer
        # cannot exist then, and the import alone took 0.1-0.2 s of the
        # restore phase with 8 ranks on 2 cores.
        optim = sys.modules.get(__package__ + ".optim")
        for layer in self._dp_layers():
            layer.rebuild(self.world, keep_state=False)
        lost = [o for o in self.state.optimizers
                if optim is not None and isinstance(o, optim.DistributedOptimizer)]
        for part in self.state._parts():
            hook = getattr(part, "_strata_elastic_regroup", None)
            if hook is not None:
                hook(self.world, event)
            if getattr(part, "_strata_elastic_state_lost", lambda e: False)(event):
                lost.append(part)
        return lost

    def _leave(self, event):
        failed, cause = event["failed"], event["cause"]
        evicted = cause["source"] == "request" and event["rank"] in cause["evict"]
        if evicted:
            why = f"it was evicted ({cause['detail']})"
        elif cause["source"] == "request" and cause["evict"]:
            why = (f"its data-parallel replica was dropped with evicted rank(s) {cause['evict']} "
                   f"({cause['detail']})")
        else:
            why = f"its data-parallel replica lost rank(s) {failed} and was dropped"
        msg = (f"strata.elastic: rank {event['rank']} leaves the job: {why} (epoch "
               f"{event['epoch']}, the others go on as {event['mesh_after']['describe']}); "
               "exiting with status 0")
        self.events.append(event)
        if self.options.leave == "exit":
            print(msg, file=sys.stderr, flush=True)
            sys.stdout.flush()
            self.close()  # done with the store, as far as its directory goes
            _before_exit()  # and as its server, when this process is that
            # Not sys.exit: MPI's finalize would wait for the ranks that go on (and
            # the dead one). Under supervise() the status tells the supervisor.
            os._exit(_LEFT if _supervised() else 0)
        print(msg.replace("; exiting with status 0", ""), file=sys.stderr, flush=True)
        return None

    def close(self):
        """Stops the monitor thread and removes the optimizer hooks; the last
        member of the final epoch to close removes the temporary file store
        the job made for itself (mpirun on one host). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        membership, rank = self._loop.membership, self._loop.rank
        self._loop.stop()
        directory, self._store_dir = self._store_dir, None
        _release_store(self._store, directory, self.options, self._job_ranks,
                       membership["epoch"], rank, self._serving)


def _warm_up():
    """What a spare does before it stands by, so that its placement does not
    pay for it: torch's first optimizer imports torch._dynamo (about a
    second of CPU), and autograd's first backward starts its engine."""
    import torch
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0, momentum=0.9)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    (p * p).sum().backward()
    opt.step()


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


def _record_recovery(metrics, event):
    """strata_recoveries_total, and strata_evictions_total{reason} per rank
    the recovery left out (reason: "straggler" for the straggler policy's
    evictions, else what detected the failure)."""
    metrics.record_recovery()
    reason = event.get("reason") or (event.get("cause") or {}).get("source") or "unknown"
    for _ in event.get("failed") or []:
        metrics.record_eviction(reason)


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
    build = None
    if callable(state) and not isinstance(state, State):
        build, state = state, None
    elif not isinstance(state, State):
        raise InvalidArgument(f"run: state must be a strata.elastic.State or a function "
                              f"world -> State, got {type(state).__name__}")
    elif getattr(world, "_join", None) is not None:
        raise InvalidArgument(
            "run: this process joins a running job (STRATA_ELASTIC_JOIN): its model is made "
            "once it has a place, so pass state as a function world -> State")
    elif getattr(world, "is_spare", False):
        raise InvalidArgument(
            "run: this rank is a hot spare (strata.init(spares=)): its model is made once it "
            "has a place in the mesh, so pass state as a function world -> State")
    c = Controller(world, None if build is not None else state, options, on_world_changed)
    if build is not None and not world.is_spare and c._arrived is None:
        c.attach(build(world))
    if world.is_spare or c._arrived is not None:
        try:
            event = c.stand_by(build)
        except BaseException:
            c.close()
            raise
        if event is None:
            epoch = c.epoch
            c.close()
            return Result(0, c.events, left=c.events != [], epoch=epoch, stood_by=not c.events)
    state = c.state
    metrics = getattr(world, "metrics", None)  # strata.metrics: each step is marked here
    timeline = getattr(world, "timeline", None)  # strata.timeline: so is each step there
    try:
        while state.step < steps:
            try:
                ctx = c.begin_step()
            except CommError as e:
                ctx = c._ctx
                c.fail_step(ctx, e)
            else:
                try:
                    with contextlib.ExitStack() as marks:
                        if metrics is not None:
                            marks.enter_context(metrics.step())
                        if timeline is not None:
                            marks.enter_context(timeline.step(state.step))
                        loss = train_step(ctx)
                except StepAborted:
                    pass
                except (CommError, PipelineError) as e:  # a pipeline step's peer failed
                    c.fail_step(ctx, e)
                else:
                    c.finish_step(ctx, loss)
            if not ctx.committed or c.admitting:
                event = c.recover()
                if event is None:
                    return Result(state.step, c.events, left=True, epoch=c.epoch)
                if metrics is not None:
                    _record_recovery(metrics, event)
                if timeline is not None:
                    timeline._recovery(event)
        c._loop.finish()  # spares still standing by end
        return Result(state.step, c.events, left=False, epoch=c.epoch)
    finally:
        c.close()
