"""strata.metrics: a rank's training and communication figures in
Prometheus form (docs/observability.md).

One registry per :class:`Metrics` (prometheus-cpp, in libstrata). The World
that :func:`strata.init` builds has one (``world.metrics``) whose sink every
communicator of the world records into, so collective figures need no code;
steps are marked by the training loop::

    world = strata.init()                      # world.metrics, from STRATA_METRICS_*
    for batch in loader:
        with strata.metrics.step(tokens=batch.numel()):
            loss = model(batch).sum(); loss.backward(); opt.step()

strata's own loops (``strata.elastic.run``, pipeline schedules'
``step()``) mark their steps themselves; a ``step()`` inside one of them
adds its tokens to that step instead of counting a second one.

Exposition: ``port=`` / ``STRATA_METRICS_PORT`` serves
``http://127.0.0.1:<port>/metrics`` (format 0.0.4); ``file=`` /
``STRATA_METRICS_FILE`` is written atomically (``{rank}`` replaced) every
``write_interval`` seconds at a step's end and on :meth:`Metrics.write`;
:meth:`Metrics.collector` mounts the same registry into a prometheus_client
registry. The cluster view (min / median / p95 / max per figure over the
ranks, and the rank with the max) is published on rank 0 by
:meth:`Metrics.publish_cluster`, automatically every ``cluster_every``
steps: one all-gather of a few numbers per rank, whatever the step count.

MFU: ``flops_per_token`` (FLOPs of forward + backward per token, this
rank's share) over ``peak_flops`` (default: :func:`peak_flops`: the GPU's
dense BF16 peak from a table, or the measured FP32 GEMM rate on CPU);
:func:`flops_per_token` computes it for models of strata layers as
torchtitan and nanoGPT do (6N + 12 L H Q T).
"""

import contextlib
import socket
import sys
import time
import weakref

from . import _strata, _stragglers
from .errors import InvalidArgument

__all__ = [
    "Metrics",
    "step",
    "current",
    "flops_per_token",
    "peak_flops",
    "cluster_figure_names",
]

# The Metrics that module-level step() uses when given none: the most
# recently created one still open. A weak reference, so it owns nothing:
# the registry belongs to the Metrics object (and the World holding it).
_latest = None


def cluster_figure_names():
    """The figures of the cluster view, in order (each published as
    ``strata_cluster_<name>{stat=min|median|p95|max}`` and
    ``strata_cluster_<name>_max_rank``)."""
    return list(_strata._cluster_figure_names())


def peak_flops(device=None):
    """Peak FLOP/s for MFU: for a CUDA device (default: the current one when
    CUDA is available) its dense BF16 tensor-core peak from strata's table
    (torchtitan's figures), or None when the table lacks it; on CPU the
    FP32 GEMM rate this process measures (OpenBLAS, about 0.2 s)."""
    import torch

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        return _strata._peak_flops_for_device(torch.cuda.get_device_name(device))
    return _strata._measure_cpu_gemm_peak(n=512, seconds=0.2)


def flops_per_token(model=None, seq_len=None, *, num_params=None, num_layers=None,
                    num_heads=None, head_dim=None):
    """FLOPs of one token's forward and backward: ``6 N + 12 L H Q T``, the
    estimate torchtitan (``get_num_flop_per_token``) and nanoGPT
    (``estimate_mfu``) use: N parameters without the embeddings, L layers,
    H heads of Q features, T the sequence length.

    Given ``model`` (a module built of strata layers, such as
    ``strata.nn.ParallelGPT``), N is its parameters on this rank without
    token and position embeddings, and L, H, Q come from its
    ``ParallelSelfAttention`` layers (this rank's heads): the result is this
    rank's share under tensor parallelism, as this rank's MFU needs.
    Otherwise give every number."""
    if model is not None:
        import torch
        from . import nn as _nn

        embeds = (torch.nn.Embedding, _nn.VocabParallelEmbedding)
        embed_params = {id(p) for mod in model.modules() if isinstance(mod, embeds)
                        for p in mod.parameters()}
        num_params = sum(p.numel() for p in model.parameters() if id(p) not in embed_params)
        attn = [mod for mod in model.modules() if isinstance(mod, _nn.ParallelSelfAttention)]
        num_layers = len(attn)
        num_heads = attn[0].local_heads if attn else 0
        head_dim = attn[0].head_dim if attn else 0
    missing = [k for k, v in (("num_params", num_params), ("num_layers", num_layers),
                              ("num_heads", num_heads), ("head_dim", head_dim),
                              ("seq_len", seq_len)) if v is None]
    if missing:
        raise InvalidArgument(f"flops_per_token needs a model or {', '.join(missing)}")
    for k, v in (("num_params", num_params), ("num_layers", num_layers),
                 ("num_heads", num_heads), ("head_dim", head_dim), ("seq_len", seq_len)):
        if v < 0:
            raise InvalidArgument(f"flops_per_token: {k} must be >= 0, got {v}")
    return 6.0 * num_params + 12.0 * num_layers * num_heads * head_dim * seq_len


class _Step:
    """One step being measured (what ``with step():`` gives): set
    ``tokens`` inside when the count is known late; ``data_wait()`` times
    the wait for input."""

    __slots__ = ("_metrics", "tokens", "_data_wait", "_t0", "_outer", "_w0")

    def __init__(self, metrics, tokens, data_wait):
        self._metrics = metrics
        self.tokens = tokens
        self._data_wait = data_wait
        self._t0 = None
        self._outer = None

    @contextlib.contextmanager
    def data_wait(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._data_wait += time.perf_counter() - t0

    def __enter__(self):
        m = self._metrics
        self._outer = m._active
        if self._outer is None:
            m._active = self
        self._w0 = m._raw.collective_wait_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb):
        seconds = time.perf_counter() - self._t0
        m = self._metrics
        if self._outer is not None:
            # Inside a step strata's loop marks: lend it the figures.
            self._outer.tokens += self.tokens
            self._outer._data_wait += self._data_wait
            return False
        m._active = None
        if exc_type is None:  # a step that raised did not happen
            wait = m._raw.collective_wait_seconds() - self._w0
            m._raw.record_step(seconds, int(self.tokens), self._data_wait, wait)
            m.last_step = (seconds, wait)
            m._after_step()
        return False


class _Counter:
    def __init__(self, metrics, name, help):
        self._m, self.name, self._help = metrics, name, help

    def inc(self, amount=1.0):
        self._m._raw.counter_add(self.name, self._help, float(amount))


class _Gauge:
    def __init__(self, metrics, name, help):
        self._m, self.name, self._help = metrics, name, help

    def set(self, value):
        self._m._raw.gauge_set(self.name, self._help, float(value))


class _Histogram:
    def __init__(self, metrics, name, help, buckets):
        self._m, self.name, self._help, self._buckets = metrics, name, help, list(buckets)

    def observe(self, value):
        self._m._raw.histogram_observe(self.name, self._help, self._buckets, float(value))


class Collector:
    """strata's registry as a prometheus_client collector::

        prometheus_client.REGISTRY.register(world.metrics.collector())

    Each scrape reads the registry's exposition (it does not copy it at
    registration)."""

    def __init__(self, metrics):
        self._metrics = metrics

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        return list(text_string_to_metric_families(self._metrics.text()))

    def describe(self):
        # Nothing up front: the families grow as groups and ops appear.
        return []


class Metrics:
    """One rank's registry. ``job`` and ``rank`` label every series
    (defaults: "strata" and the launcher's rank). ``port``: serve over HTTP
    on ``bind_address`` (0: a port the OS picks; :attr:`url` says where);
    ``file``: the .prom file; either unset falls back to
    STRATA_METRICS_PORT (+ the local rank) / STRATA_METRICS_FILE.
    ``flops_per_token`` enables MFU over ``peak_flops`` (default
    :func:`peak_flops`). ``cluster_every``: publish the cluster view every
    so many steps over ``group`` (default: the world of the
    :func:`strata.init` that made this registry); collective, so every rank
    must use the same value. ``straggler_report``: each time the cluster
    view is published, rank 0 also makes the straggler report
    (:meth:`straggler_report`; printed to stderr when True, handed to the
    callable when one is given). Bad values raise
    :class:`strata.InvalidArgument`; a port that is taken raises
    :class:`strata.Error` naming it."""

    def __init__(self, job="strata", rank=None, *, port=None, file=None,
                 bind_address="127.0.0.1", flops_per_token=None, peak_flops=None,
                 step_buckets=None, collective_buckets=None, cluster_every=None, group=None,
                 write_interval=10.0, straggler_report=False,
                 straggler_factor=_stragglers.FACTOR, env=None):
        global _latest
        launch = _strata.launch_env(env)
        if rank is None:
            rank = launch.rank
        if cluster_every is not None and (not isinstance(cluster_every, int) or cluster_every < 1):
            raise InvalidArgument(f"cluster_every must be a positive int, got {cluster_every!r}")
        if not (straggler_report is True or straggler_report is False
                or callable(straggler_report)):
            raise InvalidArgument(f"straggler_report must be True, False or a callable, got "
                                  f"{straggler_report!r}")
        if isinstance(straggler_factor, bool) or not isinstance(straggler_factor, (int, float)) \
                or not straggler_factor > 1:
            raise InvalidArgument(f"straggler_factor must be a number > 1, got "
                                  f"{straggler_factor!r}")
        if flops_per_token and peak_flops is None:
            peak_flops = globals()["peak_flops"]()
            if peak_flops is None:
                raise InvalidArgument("no peak FLOP/s known for this GPU: give peak_flops=")
        self._raw = _strata._Metrics(
            job=job, rank=rank, local_rank=launch.local_rank, port=port,
            bind_address=bind_address, file=file, flops_per_token=float(flops_per_token or 0),
            peak_flops=float(peak_flops or 0), step_buckets=list(step_buckets or []),
            collective_buckets=list(collective_buckets or []), env=env)
        self._active = None
        self._steps = 0
        self._cluster_every = cluster_every
        self._group = group
        self._world = None  # weakref, set by strata.init
        self._write_interval = write_interval
        self._last_write = time.monotonic()
        self._closed = False
        self._straggler_report = straggler_report
        self._straggler_factor = float(straggler_factor)
        self._where = None  # (hosts, local ranks) of the group's ranks, gathered once
        self._published_at = 0  # steps at the previous publish_cluster
        self.last_report = None  # rank 0: the last straggler report (a dict)
        # The last step's (seconds, time blocked in Work::Wait): what
        # strata.elastic's straggler policy takes its compute time from.
        self.last_step = None
        _latest = weakref.ref(self)

    rank = property(lambda self: self._raw.rank, doc="The rank label.")
    job = property(lambda self: self._raw.job, doc="The job label.")
    port = property(lambda self: self._raw.port, doc="The HTTP port served on, or -1.")
    file = property(lambda self: self._raw.file or None,
                    doc="The .prom file ({rank} replaced), or None.")

    @property
    def url(self):
        """``http://<address>:<port>/metrics``, or None when not serving."""
        if self.port < 0:
            return None
        return f"http://{self._raw.bind_address}:{self.port}/metrics"

    # ---- steps ---------------------------------------------------------
    def step(self, tokens=0, data_wait=0.0):
        """A context manager that measures one training step (see the
        module's documentation)."""
        return _Step(self, tokens, float(data_wait))

    def _after_step(self):
        self._steps += 1
        if self._cluster_every and self._steps % self._cluster_every == 0:
            self.publish_cluster()
        if self.file and time.monotonic() - self._last_write >= self._write_interval:
            self.write()

    # ---- other figures -------------------------------------------------
    def record_checkpoint_blocked(self, seconds):
        self._raw.record_checkpoint_blocked(float(seconds))

    def record_checkpoint_write(self, nbytes):
        self._raw.record_checkpoint_write(int(nbytes))

    def record_recovery(self):
        self._raw.record_recovery()

    def record_eviction(self, reason):
        self._raw.record_eviction(str(reason))

    def set_mfu(self, flops_per_token, peak_flops=None):
        """Enables (or changes) MFU from now on."""
        if peak_flops is None:
            peak_flops = globals()["peak_flops"]()
        self._raw.set_mfu(float(flops_per_token), float(peak_flops or 0))

    def counter(self, name, help=""):
        """A custom counter (``.inc(amount=1)``), labelled like the rest."""
        return _Counter(self, name, help)

    def gauge(self, name, help=""):
        """A custom gauge (``.set(value)``)."""
        return _Gauge(self, name, help)

    def histogram(self, name, buckets, help=""):
        """A custom histogram (``.observe(value)``) with these upper bounds."""
        return _Histogram(self, name, help, buckets)

    # ---- export --------------------------------------------------------
    def text(self):
        """The exposition, Prometheus text format 0.0.4."""
        return self._raw.serialize()

    def write(self):
        """Writes the .prom file now (atomically); nothing without a file."""
        self._raw.write_file()
        self._last_write = time.monotonic()

    def collector(self):
        """This registry as a prometheus_client collector."""
        return Collector(self)

    def totals(self):
        """``steps``, ``step_seconds`` (their sum), ``last_step_seconds``,
        ``tokens_per_second`` and ``mfu`` of the last step."""
        return self._raw.totals()

    def publish_cluster(self, group=None):
        """Gathers every rank's figures over ``group`` (default: the one
        given at construction, else the world's root) and publishes the
        cluster view on its rank 0 (with the straggler report in
        :attr:`last_report`). Collective over the group. Returns whether
        this rank is the group's rank 0."""
        import torch

        group = group or self._group
        if group is None and self._world is not None and self._world() is not None:
            group = self._world().group("world")
        if group is None:
            raise InvalidArgument("publish_cluster needs a group: pass group= (or create the "
                                  "Metrics through strata.init)")
        sample = self._raw.cluster_sample()
        device = "cuda" if group.memory == "cuda" else "cpu"
        mine = torch.tensor(sample, dtype=torch.float64, device=device)
        every = torch.empty(group.size * len(sample), dtype=torch.float64, device=device)
        group.all_gather(every, mine)
        if self._where is None or len(self._where[0]) != group.size:
            self._where = _gather_where(group, device)
        first, self._published_at = self._published_at + 1, self._steps
        if group.rank == 0:
            samples = every.view(group.size, len(sample)).cpu().tolist()
            self._raw.set_cluster_view(samples)
            self.last_report = _stragglers.analyze(
                samples, cluster_figure_names(), *self._where, factor=self._straggler_factor,
                first_step=first, last_step=self._steps)
            if self._straggler_report is True:
                print(f"strata: {_stragglers.format_report(self.last_report)}",
                      file=sys.stderr, flush=True)
            elif callable(self._straggler_report):
                self._straggler_report(self.last_report)
        return group.rank == 0

    def straggler_report(self, group=None, *, top=3):
        """Publishes the cluster view now (collective over ``group``, as
        :meth:`publish_cluster`) and returns, on the group's rank 0, the
        straggler report as text (the slowest ranks by compute time and by
        collective wait, with host, local rank, their ratio to the median
        and to the P95 of the others, and which ranks exceed
        ``straggler_factor`` x that P95); None on the other ranks.
        :attr:`last_report` holds the same as a dict. The figures are the
        cluster view's (``strata_cluster_compute_seconds`` and
        ``strata_cluster_collective_wait_seconds``, with the rank holding the
        max): over the steps since the previous publication."""
        if not self.publish_cluster(group):
            return None
        return _stragglers.format_report(self.last_report, top=top)

    def close(self):
        """Writes the file a last time and stops serving over HTTP (the
        port is free when it returns). Figures can still be read with
        :meth:`text`. The World of :func:`strata.init` closes the Metrics
        it made when it is destroyed."""
        if not self._closed:
            self._closed = True
            self._raw.stop_serving()
            if self.file:
                self.write()

    def __repr__(self):
        where = [w for w in (self.url, self.file) if w]
        return (f"<strata.metrics.Metrics job={self.job!r} rank={self.rank}"
                f"{' ' + ', '.join(where) if where else ''}>")


def current():
    """The Metrics that :func:`step` uses by default: the most recently
    created one not yet closed (for example ``world.metrics``), or None."""
    m = _latest() if _latest is not None else None
    return None if m is None or m._closed else m


def step(tokens=0, data_wait=0.0, *, metrics=None):
    """``with strata.metrics.step(tokens=n):`` measures one training step
    on ``metrics`` (default :func:`current`). Raises InvalidArgument when
    there is no Metrics."""
    m = metrics if metrics is not None else current()
    if m is None:
        raise InvalidArgument("strata.metrics.step: no strata.metrics.Metrics exists; create "
                              "one (strata.metrics.Metrics()) or call strata.init() first")
    return m.step(tokens, data_wait)


def _gather_where(group, device):
    """(hosts, local ranks) of every rank of ``group``: one all-gather of a
    fixed-size record per rank (done once per group size)."""
    import torch

    width = 64
    name = socket.gethostname().encode()[:width - 1]
    local = _strata.launch_env().local_rank
    mine = torch.zeros(width + 1, dtype=torch.int64, device=device)
    mine[:len(name)] = torch.tensor(list(name), dtype=torch.int64)
    mine[width] = local
    every = torch.empty(group.size * (width + 1), dtype=torch.int64, device=device)
    group.all_gather(every, mine)
    rows = every.view(group.size, width + 1).cpu().tolist()
    hosts = [bytes(c for c in row[:width] if c).decode(errors="replace") for row in rows]
    return hosts, [int(row[width]) for row in rows]

