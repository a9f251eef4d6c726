"""Process plumbing for run_recovery.py: following a rank's JSON-lines events
as they are written, timing when processes exit, killing from outside, and
the shared lock for 8-rank jobs.

Every wait here has a deadline (Timeout names what it waited for)."""

import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time


class Timeout(Exception):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JsonLines:
    """Follows JSON records from a file (polled, so it survives the writer
    being killed and replaced) or from a pipe (a reader thread). Each record is
    kept with the wall-clock time the driver saw it."""

    def __init__(self, path=None, pipe=None, raw_log=None, poll_s=0.02):
        self.records = []  # (seen_at, record)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._raw = open(raw_log, "a", buffering=1) if raw_log else None
        target = self._follow_file if path else self._follow_pipe
        self._thread = threading.Thread(target=target, args=(path or pipe, poll_s), daemon=True)
        self._thread.start()

    def _add(self, line):
        if self._raw:
            self._raw.write(line if line.endswith("\n") else line + "\n")
        line = line.strip()
        if not line.startswith("{"):
            return
        try:
            rec = json.loads(line)
        except ValueError:
            return
        with self._cond:
            self.records.append((time.time(), rec))
            self._cond.notify_all()

    def _follow_file(self, path, poll_s):
        pos, partial = 0, ""
        while not self._stop.is_set():
            try:
                with open(path) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except FileNotFoundError:
                chunk = ""
            if chunk:
                partial += chunk
                *lines, partial = partial.split("\n")
                for line in lines:
                    self._add(line)
            else:
                time.sleep(poll_s)

    def _follow_pipe(self, pipe, _poll_s):
        for raw in iter(pipe.readline, b""):
            self._add(raw.decode(errors="replace"))
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, predicate, deadline, what, after=0):
        """The first record (seen_at, rec) from index `after` on that satisfies
        predicate(rec); raises Timeout naming `what` at `deadline` (time.time())."""
        with self._cond:
            i = after
            while True:
                while i < len(self.records):
                    if predicate(self.records[i][1]):
                        return self.records[i]
                    i += 1
                left = deadline - time.time()
                if left <= 0:
                    raise Timeout(f"no {what} within the deadline")
                self._cond.wait(min(left, 0.5))

    def index(self, entry):
        """The position of a (seen_at, rec) entry wait_for returned."""
        with self._cond:
            return next(i for i, e in enumerate(self.records) if e is entry)

    def stop(self):
        self._stop.set()
        if self._raw:
            self._raw.close()


class ExitWatcher:
    """Records when each of `pids` exits (pidfd; works for processes that are
    not our children)."""

    def __init__(self, pids):
        self.exits = {}
        self._fds = {}
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except (ProcessLookupError, OSError):
                self.exits[pid] = None  # already gone before we looked
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        deadline = time.time() + 600
        while self._fds and time.time() < deadline:
            for fd, _ in poller.poll(200):
                self.exits[self._fds.pop(fd)] = time.time()
                poller.unregister(fd)
                os.close(fd)
        for fd in list(self._fds):
            os.close(fd)

    def wait(self, timeout):
        self._thread.join(timeout)
        return dict(self.exits)


def read_pids(pid_dir, ranks):
    pids = {}
    for r in ranks:
        with open(os.path.join(pid_dir, f"{r}.pid")) as f:
            pids[r] = int(f.read().strip())
    return pids


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child has exited too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sigkill(pid):
    """SIGKILL from outside; returns the wall-clock time of the kill."""
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def stop_group(proc, grace=5.0):
    """Ends a launch started with start_new_session=True: SIGTERM to its
    process group, SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def _ancestors_hold(lock_path):
    """True when a process above us is `flock <lock_path> ...` (then it holds
    the lock for us and taking it again would deadlock)."""
    pid = os.getppid()
    real = os.path.realpath(lock_path)
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if argv and os.path.basename(argv[0]) == "flock" and any(
                os.path.realpath(a) == real for a in argv[1:] if not a.startswith("-")):
            return True
        pid = ppid
    return False


class MultirankLock:
    """The machine-wide lock every 8-rank job takes (/tmp/strata-mpirun.lock),
    held for the whole measurement; a no-op when an ancestor `flock` holds it."""

    def __init__(self, path):
        self.path = path
        self._fd = None

    def __enter__(self):
        if not self.path or _ancestors_hold(self.path):
            return self
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {self.path} (another 8-rank job holds it) ...", flush=True)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
