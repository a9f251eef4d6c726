"""How strata.elastic finds its store and lives with its launcher: the store
the ranks agree through, the warning for a launcher that would undo a
recovery, :func:`supervise` (torchrun) and :func:`shutdown` (re-exported by
:mod:`strata.elastic`)."""

import atexit
import os
import signal
import sys
import tempfile

from . import _strata
from ._settings import settings as _settings
from .errors import CommError, ElasticError

# ---- the store --------------------------------------------------------------------


def _job_id(env=None):
    env = os.environ if env is None else env
    for key in ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "SLURM_JOB_ID"):
        if env.get(key):
            suffix = env.get("SLURM_STEP_ID", "") if key == "SLURM_JOB_ID" else ""
            if key == "PMIX_NAMESPACE":
                # "prterun-<host>-<pid>@1" names mpirun by its pid, which the
                # system reuses: with the launcher's start time, a job never
                # opens the directory an earlier job left behind.
                pid = env[key].rpartition("@")[0].rpartition("-")[2]
                suffix = "-" + (_start_ticks(pid) or "0")
            return "".join(c if c.isalnum() or c in "-_." else "_" for c in env[key] + suffix)
    return None


def _start_ticks(pid):
    """Process ``pid``'s start time (/proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _local_store_dir(env=None):
    """The one-host file store's directory of the job ``env`` describes (a
    process's environment; this one's by default)."""
    job = _job_id(env)
    if job is None:
        job = f"{os.getpid()}-{_start_ticks(os.getpid())}"
    return os.path.join(_local_store_base(), f"strata-elastic-{job}-{os.getuid()}")


def _local_store_base():
    """/dev/shm where it is a writable directory (memory: each step's commit
    is a few small file writes and renames there, which on a disk's
    filesystem cost 0.3-0.9 ms each through its journal), else the
    temporary directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _tcp_client(launch, timeout):
    """A new client of the TCPStore the world bootstrapped through (served by
    torchrun's agent, or by rank 0 of an srun job). strata's own client: its
    operations run without the GIL (with torch's, the monitor's heartbeats,
    30 store operations a second, cost the training thread 3-5% of its
    step in GIL hand-overs)."""
    from . import store as _store
    host, port = launch.master_addr, launch.master_port
    try:
        return _store.tcp_store(host, port, timeout=timeout)
    except CommError as e:
        raise ElasticError(f"rank {launch.rank}: cannot reach the rendezvous store (torch "
                           f"TCPStore {host}:{port}) for the elastic layer within {timeout:g}s: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _store_for(world, options):
    """(the store the main thread agrees through, the store the monitor
    thread uses or None for the same one, the temporary directory of a file
    store this job made for itself or None: :func:`_release_store` removes
    it when the job ends)."""
    from . import store as _store
    if options.store is not None:
        s = options.store
        return (s if isinstance(s, _store.Store) else _store.from_torch(s)), None, None
    boot = getattr(world, "_store", (None, None))[0]
    if boot is not None:
        # Two connections of our own (strata's client: no GIL in its
        # operations): a connection serves one request at a time, so the
        # monitor's heartbeats must not share one with the main thread's
        # waits for commits and decisions (nor with Gloo's rebuild, which
        # goes through the bootstrap connection).
        launch = _strata.launch_env(None)
        return (_tcp_client(launch, options.rebuild_timeout),
                _tcp_client(launch, options.rebuild_timeout), None)
    url = _settings()["STRATA_STORE"].value
    if url:
        if not url.startswith("file:"):
            raise ElasticError(f"STRATA_STORE={url!r}: strata.elastic takes a file: store URL")
        return (_store.file_store(url[len("file:"):].replace("//", "/", 1) + "/elastic"), None,
                None)
    launch = _strata.launch_env(None)
    job = _job_id()
    if launch.world_size == 1 or (launch.num_nodes == 1 and launch.local_world_size ==
                                  launch.world_size and job):
        path = _local_store_dir()
        # Local (memory or disk on this host): each step's commit waits on it,
        # typically for well under a millisecond, so poll it finely: from
        # 50 us, doubling up to 2 ms (a read that misses is one failed
        # open(2); 8 ranks waiting long read about 4000 times a second).
        return _store.file_store(path, max_poll=0.002, min_poll=5e-5), None, path
    raise ElasticError(
        f"strata.elastic needs a store every rank reaches (rank {launch.rank} of "
        f"{launch.world_size} on {launch.num_nodes} node(s), launcher {launch.launcher}): "
        "under torchrun it uses torchrun's; across nodes under mpirun or srun set "
        "STRATA_STORE=file:/shared/dir or pass Options(store=...)")


def _served_store(world, options):
    """(whether a rank's process serves the job's TCPStore, as under a
    launch without torchrun's agent; its description if this process is
    that rank, else None)."""
    if getattr(world, "_store", (None, None))[1] is None or options.store is not None:
        return False, None
    from .store import _agent_serves
    launch = _strata.launch_env(None)
    if _agent_serves(launch):
        return False, None
    return True, (f"torch TCPStore {launch.master_addr}:{launch.master_port}"
                  if launch.rank == 0 else None)


# Run once before the process ends: at interpreter exit, or before an
# os._exit of this module's (shutdown) or strata.elastic's (a rank leaving).
_exit_hooks = []


def _before_exit():
    while _exit_hooks:
        try:
            _exit_hooks.pop(0)()
        except Exception:  # noqa: BLE001: the store may be gone; the process ends anyway
            pass


atexit.register(_before_exit)


def _hold_served_store(store, prefix, ranks, rank, epoch, options, served):
    """Where a rank's process serves the job's store (``served``, from
    :func:`_served_store`), the store must outlive every process that uses
    it, which goes on after its elastic loop closed (the script's final
    checkpoint makes a communicator through it). Every rank marks itself
    released when its process ends; the serving rank then waits for the
    others (:func:`_wait_for_store_users`)."""
    some_rank, server = served
    if not some_rank:
        return
    stale = options.heartbeat_timeout
    _exit_hooks.append(lambda: store.set(f"{prefix}/released/{rank}", "1", stale))
    if server is not None:
        _exit_hooks.append(lambda: _wait_for_store_users(
            store, prefix, ranks, epoch, rank, stale, options.rebuild_timeout, server))


def _release_store(store, directory, options, ranks, epoch, rank, served):
    """Called by every rank when its elastic loop closed (or it leaves): it
    marks itself done, and the rank that then finds
    every rank of the job (``ranks``) done or its process gone removes the
    temporary file-store ``directory`` (None: nothing to remove). A rank
    still running (one that left late, or was taken as failed while slow)
    keeps the directory until it is done too: the last member of the final
    epoch is not always the last user of the store. A job whose last rank
    dies keeps its directory (the keys say what happened). A store that a
    rank serves is held until the end of the processes that use it
    (:func:`_hold_served_store`)."""
    prefix = f"strata/elastic/{options.job}"
    _hold_served_store(store, prefix, ranks, rank, epoch, options, served)
    try:
        store.set(f"{prefix}/exited/{rank}", "1", options.heartbeat_timeout)
        if directory is None:
            return
        for r in ranks:
            if r != rank and _peek(store, f"{prefix}/exited/{r}") is None and \
                    not _process_gone(store, prefix, r, epoch):
                return
    except Exception:  # noqa: BLE001: the store is gone; nothing to remove then
        return
    import shutil
    shutil.rmtree(directory, ignore_errors=True)


def _wait_for_store_users(store, prefix, ranks, epoch, rank, stale, patience, serving):
    """Waits, in the process that serves the store (rank 0 of a launch
    without torchrun's agent: srun, or RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set by hand), while another rank of ``ranks`` may use it:
    one whose process has not released it and runs, and whose elastic loop
    is open and beating (a heartbeat that changed within ``stale`` seconds:
    a rank that hangs is not waited for) or closed less than ``patience``
    seconds ago (it may still make a communicator, a checkpoint's). Leaving
    with a dropped replica, or finishing first, the serving rank would take
    the store from the ranks that go on. Says once, after a second, why the
    process stays."""
    import time
    start = time.monotonic()
    seen = {}  # rank -> (its latest heartbeat, when it last changed, its epoch)
    closed = {}  # rank -> when its loop was first seen closed
    done = set()
    said = False
    pause = max(0.1, 0.001 * len(ranks))  # a few store reads per rank and pause
    while True:
        now = time.monotonic()
        users = []
        for r in ranks:
            if r == rank or r in done:
                continue
            if _peek(store, f"{prefix}/released/{r}") is not None:
                done.add(r)
                continue
            beat, e = _latest_beat(store, prefix, r, seen.get(r, (None, None, epoch))[2])
            if beat is None or _gone(beat):
                done.add(r)
                continue
            if r in closed or _peek(store, f"{prefix}/exited/{r}") is not None:
                closed.setdefault(r, now)
                if now - closed[r] <= patience:
                    users.append(r)
                continue
            last, changed, _ = seen.get(r, (None, now, e))
            if beat != last:
                changed = now
            seen[r] = (beat, changed, e)
            if now - changed <= stale:
                users.append(r)
        if not users:
            return
        if not said and now - start > 1.0:
            said = True
            print(f"strata.elastic: rank {rank} serves the job's store ({serving}): its process "
                  f"stays until rank(s) {users} are done with it", file=sys.stderr, flush=True)
        time.sleep(pause)


def _latest_beat(store, prefix, r, epoch):
    """(rank ``r``'s heartbeat in the latest epoch it beat in at or after
    ``epoch``, else before it, or None; that epoch)."""
    e = epoch
    while _peek(store, f"{prefix}/{e + 1}/hb/{r}") is not None:
        e += 1
    while e > 0:
        beat = _peek(store, f"{prefix}/{e}/hb/{r}")
        if beat is not None:
            return beat, e
        e -= 1
    return None, epoch


def _gone(beat):
    """Whether the process a heartbeat names no longer runs (the monitors'
    /proc probe; a process on another host is not taken as gone)."""
    _, _, process = beat.partition(" ")
    try:
        return _strata._elastic_probe_process(process) == "gone"
    except ElasticError:
        return True  # not a process record: nothing to wait for


def _peek(store, key):
    """The key's value, or None when it is absent (one look)."""
    try:
        value = store.get(key, 0.001)
    except TimeoutError:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _process_gone(store, prefix, r, epoch):
    """Whether rank ``r``'s process, named by its latest heartbeat, no longer
    runs (the monitors' /proc probe; a process on another host is not
    taken as gone)."""
    for e in range(epoch, 0, -1):
        beat = _peek(store, f"{prefix}/{e}/hb/{r}")
        if beat is not None:
            return _gone(beat)
    return True  # it never beat: it never got this far


def _launcher_warning(launcher, env):
    """What to tell a user whose launcher will undo a recovery, or None."""
    if launcher == "mpirun" and env.get("OMPI_MCA_mpi_ft_enable", "") not in ("1", "true"):
        return ("strata.elastic: mpirun was started without --with-ft ulfm: when a rank dies, "
                "prterun ends the whole job before the survivors can go on; launch with "
                "`mpirun --with-ft ulfm ...` to recover in process")
    return None


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
    spare = getattr(world, "is_spare", False)  # a spare has no group to ask
    world.destroy()
    lost = result is None or bool(getattr(result, "events", None))
    if (backend == "mpi" and lost) or spare:
        _before_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


# ---- launchers --------------------------------------------------------------------


# The status a supervised training process exits with when it left the job
# (its replica was dropped): the supervisor may start a joiner in its place,
# else it exits 0 (EX_TEMPFAIL).
_LEFT = 75


def _supervised():
    return bool(_settings()["STRATA_ELASTIC_SUPERVISED"].value)


def supervise(restarts=0):
    """Makes a rank's death survivable under torchrun: call it first thing in
    the script (before importing torch). Under torchrun the process forks;
    the child returns from this call and trains; the parent (the process
    torchrun watches) waits for it. When the child is killed by a signal
    (SIGKILL, a crash), the parent starts a new child, up to ``restarts``
    times, which joins the running job (STRATA_ELASTIC_JOIN: it stands by as
    a spare, or completes a replica and dp grows back; docs/elastic.md
    "Growing back"); with no restart left it prints why and exits with
    status 0, so torchrun's agent does not stop every other worker (it does
    on a non-zero exit). A child that exits returns its status through the
    parent. Signals sent to the parent (torchrun stopping the job) are
    passed on to the child. Does nothing outside torchrun or when already
    supervised."""
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ElasticError(f"supervise: restarts must be an int >= 0, got {restarts!r}")
    env = os.environ
    if not env.get("TORCHELASTIC_RUN_ID") or _settings()["STRATA_ELASTIC_SUPERVISED"].value:
        return
    forwarded = []
    child = [0]

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    started = 0
    while True:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            env["STRATA_ELASTIC_SUPERVISED"] = str(os.getppid())
            _die_with_parent()
            return
        child[0] = pid
        if started == 0:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                      signal.SIGUSR2):
                signal.signal(s, forward)
        started += 1
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) != _LEFT:
            os._exit(os.WEXITSTATUS(status))
        if os.WIFEXITED(status):  # it left the job: its replica was dropped
            what = "left the job (evicted, or its replica was dropped)"
        else:
            sig = os.WTERMSIG(status)
            if sig in forwarded:
                os._exit(128 + sig)
            what = f"was killed by {signal.Signals(sig).name}"
        if started <= restarts:
            print(f"strata.elastic.supervise: rank {env.get('RANK', '?')}'s training process "
                  f"(pid {pid}) {what}; starting a new one that joins the running job (restart "
                  f"{started} of {restarts})", file=sys.stderr, flush=True)
            env["STRATA_ELASTIC_JOIN"] = "1"
            continue
        if os.WIFEXITED(status):
            os._exit(0)
        name = signal.Signals(sig).name
        print(f"strata.elastic.supervise: rank {env.get('RANK', '?')}'s training process (pid "
              f"{pid}) was killed by {name}; exiting with status 0 so that torchrun lets the "
              "other ranks go on without it", file=sys.stderr, flush=True)
        os._exit(0)


def _finished_before_joining(job):
    """A joiner that found the job finished (before or while it asked to be
    admitted: a restart slower than the rest of the run): nothing to join.
    Exits with status 0, as a spare that stood by to the end finishes."""
    print(f"strata.elastic: rank {os.environ.get('RANK', '?')}'s new process found job "
          f"{job!r} finished before it was admitted; nothing to join, exiting with status 0",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    _before_exit()
    os._exit(0)


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
