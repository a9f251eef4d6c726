"""Rendezvous stores for store-bootstrapped backends (Gloo, NCCL under torchrun).

Under torchrun (or srun with MASTER_ADDR/MASTER_PORT), :func:`strata.init`
connects to the TCPStore torchrun serves at ``MASTER_ADDR:MASTER_PORT`` and
bootstraps through it; nothing needs to be called by hand. To bootstrap
through a store you already have (e.g. the one ``torch.distributed`` was
initialised with), pass it::

    store = strata.store.from_torch(torch.distributed.TCPStore(...))
    world = strata.init(backend="gloo", store=store)

Keys strata writes are under the prefix ``strata/`` so they never clash
with torch.distributed's own keys in a shared store.

Scale: the Gloo bootstrap does O(1) store operations per rank (rank 0
publishes one record, every rank reads it), so the store is not the
bottleneck at thousands of ranks.
"""

import datetime
import os

from . import _strata
from .errors import CommError, InvalidArgument

__all__ = ["from_torch", "file_store", "connect_torchrun", "Store"]

Store = _strata._Store

# A non-positive wait is one look: torch's TCPStore reads a timeout of 0
# as "wait forever", so it is never passed through.
_ONE_LOOK = 0.0


def _first_line(exc):
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _TorchStoreAdapter:
    """The operations strata's stores have (python/src/store_bindings.cc),
    over a ``torch.distributed.Store``. Each takes the seconds left until the
    caller's deadline; raises TimeoutError when it passes, LookupError when a
    key is absent (compare_set), and lets anything else (the store is
    unreachable) propagate."""

    def __init__(self, store, describe, prefix):
        self._store = store
        self._describe = describe
        self._prefix = prefix

    def describe(self):
        return self._describe

    def _key(self, key):
        return self._prefix + key

    def _wait(self, keys, seconds):
        import torch.distributed as dist
        keys = [self._key(k) for k in keys]
        if seconds <= _ONE_LOOK:
            if not self._store.check(keys):
                raise TimeoutError(f"deadline passed; keys {keys} not all present")
            return
        try:
            self._store.wait(keys, datetime.timedelta(seconds=seconds))
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise TimeoutError(f"keys {keys} not all present within {seconds:.3g}s "
                                   f"({_first_line(e)})") from None
            raise

    def set(self, key, value, seconds):
        self._store.set(self._key(key), value)

    def get(self, key, seconds):
        self._wait([key], seconds)
        return self._store.get(self._key(key))

    def wait(self, keys, seconds):
        self._wait(list(keys), seconds)

    def add(self, key, delta, seconds):
        return self._store.add(self._key(key), delta)

    def compare_set(self, key, expected, desired, seconds):
        k = self._key(key)
        value = self._store.compare_set(k, expected, desired)
        # torch answers `expected` for an absent key; strata says NotFound.
        if expected and value == expected and not self._store.check([k]):
            raise LookupError(f"key '{key}' is absent")
        return value


def from_torch(store, describe=None, prefix="strata/"):
    """A strata store over a ``torch.distributed.Store`` (TCPStore,
    FileStore, PrefixStore, ...). ``describe`` names it in messages."""
    import torch.distributed as dist
    if not isinstance(store, dist.Store):
        raise InvalidArgument(
            f"expected a torch.distributed.Store, got {type(store).__module__}."
            f"{type(store).__qualname__}")
    if describe is None:
        host = getattr(store, "host", None)
        port = getattr(store, "port", None)
        describe = (f"torch TCPStore {host}:{port}" if host is not None
                    else f"torch {type(store).__name__}")
    return _strata._python_store(_TorchStoreAdapter(store, describe, prefix))


def file_store(path, max_poll=0.02, min_poll=None):
    """A store kept in directory ``path`` (created if missing), which every
    rank must see: a shared filesystem across nodes. Use a fresh directory
    per job. A wait for a key polls the directory, from ``min_poll`` (default
    0.5 ms, or ``max_poll`` if smaller) doubling up to ``max_poll`` seconds:
    smaller answers sooner and costs more reads (on a network filesystem,
    more requests to its server)."""
    if min_poll is None:
        min_poll = min(0.0005, float(max_poll))
    return _strata._file_store(os.fspath(path), float(max_poll), float(min_poll))


def tcp_store(host, port, timeout=60.0, prefix="strata/"):
    """A client of the torch.distributed TCPStore server at ``host:port``
    (under torchrun: MASTER_ADDR, MASTER_PORT) that speaks its protocol in
    C++: its operations never take Python's GIL, so a thread using it does
    not slow the training thread. Keys are prefixed with ``prefix``, as
    :func:`from_torch` does, so both see the same keys. One connection, one
    request at a time: give each thread that waits long its own client."""
    return _strata._tcp_store(str(host), int(port), float(timeout), str(prefix))


def _agent_serves(launch, env=None):
    """Whether torchrun's agent serves the TCPStore at the launch's
    MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True for that
    address); else rank 0's process does."""
    env = os.environ if env is None else env
    return (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and env.get("MASTER_ADDR") == launch.master_addr
            and env.get("MASTER_PORT") == str(launch.master_port))


def connect_torchrun(launch, timeout, env=None):
    """Connects to the TCPStore at the launch's MASTER_ADDR:MASTER_PORT the
    way torch.distributed's env:// rendezvous does: under torchrun the agent
    serves it (TORCHELASTIC_USE_AGENT_STORE=True) and every rank is a client;
    otherwise (srun, hand-set variables) rank 0 serves it. Raises CommError
    naming the address when the store cannot be reached within ``timeout``
    seconds. ``env``: the environment the launch was read from (default
    os.environ)."""
    import torch.distributed as dist
    host, port = launch.master_addr, launch.master_port
    if not host or port <= 0:
        raise CommError(
            f"rank {launch.rank} of {launch.world_size} (launcher {launch.launcher}) needs a store "
            f"to bootstrap, and MASTER_ADDR/MASTER_PORT are not set (got '{host}', {port}); "
            "set them, or pass store=strata.store.file_store('/shared/dir')")
    serve = not _agent_serves(launch, env) and launch.rank == 0
    try:
        store = dist.TCPStore(host, port, launch.world_size, serve,
                              timeout=datetime.timedelta(seconds=timeout),
                              multi_tenant=serve, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        role = "serve" if serve else "reach"
        raise CommError(
            f"rank {launch.rank} of {launch.world_size}: cannot {role} the rendezvous store "
            f"(torch TCPStore at MASTER_ADDR:MASTER_PORT = {host}:{port}) within {timeout:g}s: "
            f"{_first_line(e)}") from None
    return store, from_torch(store, describe=f"torch TCPStore {host}:{port}")
