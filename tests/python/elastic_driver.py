"""Runs examples/elastic/train.py under a launcher and kills one of its ranks
from outside (SIGKILL, or SIGSTOP), as an operator or a failing machine
would: the fault tests (test_elastic_faults.py) and the recovery
measurements use it.

    python tests/python/elastic_driver.py --launcher mpirun --np 8 --steps 40 \\
        --kill random --signal KILL --out /tmp/run1 -- --step-sleep 0.05

The driver waits until every rank has written its pid (--pid-dir) and the
job has completed ``--after`` steps, then sends the signal to one rank
(``--rank``, or a random one; the process it kills is the training process
itself, which under torchrun is the child of strata.elastic.supervise), and
waits for the job to end. With ``--kill hold`` (and the example's ``--hold
OP:RANK:STEP``) it kills the rank that announces it waits inside OP
instead. It prints one JSON object: the launcher's exit
status, the rank killed, when (wall clock), the example's JSON lines, and
the paths of the per-rank reports.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "elastic", "train.py")


def _stat(pid):
    """(state, parent pid) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def descendants(pid):
    """The pids of ``pid``'s live descendants (torchrun starts its workers
    in sessions of their own, so a process group does not find them)."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(name)
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pids):
    """Those of ``pids`` that still run (zombies left out)."""
    return [p for p in pids if (_stat(p) or ("Z", 0))[0] != "Z"]


def mpirun_path():
    return os.environ.get("STRATA_MPIRUN") or os.path.join(sysconfig.get_paths()["data"], "bin",
                                                          "mpirun")


def command(launcher, np, example_args, python=sys.executable, launch_args=()):
    """The launch line of the docs, with what this machine needs (root,
    more ranks than cores)."""
    if launcher == "mpirun":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ([mpirun_path(), "--with-ft", "ulfm"] + root + ["--oversubscribe", "-np", str(np),
                                                               python, EXAMPLE] + example_args)
    if launcher == "torchrun":
        return ([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(np), EXAMPLE] + example_args)
    if launcher == "env":  # RANK, WORLD_SIZE, MASTER_* by hand: rank 0 serves the store
        return ([python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "env_launch.py"), "--np", str(np)] + list(launch_args) +
                ["--", EXAMPLE] + example_args)
    if launcher == "none":
        return [python, EXAMPLE] + example_args
    raise ValueError(f"unknown launcher {launcher!r}")


class Job:
    """A running job: its output lines (parsed JSON on stdout; stderr kept)."""

    def __init__(self, launcher, np, example_args, out, env=None, timeout=240, launch_args=()):
        self.out = out
        self.pid_dir = os.path.join(out, "pids")
        self.report = os.path.join(out, "report")
        for d in (self.pid_dir, self.report):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        args = list(example_args) + ["--pid-dir", self.pid_dir, "--report", self.report]
        self.cmd = command(launcher, np, args, launch_args=launch_args)
        self.np = np
        self.lines = []
        self.stderr = []
        self.stderr_at = []  # when each line of stderr came (wall clock)
        self.timeout = timeout
        self.started = time.time()
        self._cv = threading.Condition()
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full_env, start_new_session=True)
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, True)),
                         threading.Thread(target=self._read, args=(self.proc.stderr, False))]
        for t in self._threads:
            t.daemon = True
            t.start()

    def _read(self, stream, is_stdout):
        for line in stream:
            with self._cv:
                if is_stdout:
                    line = line.strip()
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        obj = {"text": line}
                    obj.setdefault("_t", time.time())
                    self.lines.append(obj)
                else:
                    self.stderr.append(line.rstrip("\n"))
                    self.stderr_at.append(time.time())
                self._cv.notify_all()

    def stderr_first(self, text):
        """When the first line of stderr containing ``text`` came (wall
        clock), or None."""
        with self._cv:
            return next((t for line, t in zip(self.stderr, self.stderr_at) if text in line), None)

    def steps(self):
        with self._cv:
            return [ln for ln in self.lines if ln.get("event") == "step"]

    def recoveries(self):
        with self._cv:
            return [ln for ln in self.lines if ln.get("event") == "recovery"]

    def wait_for(self, predicate, what, timeout):
        deadline = time.time() + timeout
        with self._cv:
            while not predicate():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the job ended (status {self.proc.returncode}) while "
                                       f"waiting for {what}:\n" + self.tail())
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout}s for {what}:\n" + self.tail())
                self._cv.wait(min(left, 0.2))

    def pids(self):
        out = {}
        for name in os.listdir(self.pid_dir):
            if name.endswith(".pid") and name[:-4].isdigit():  # not pos-<p>.pid
                with open(os.path.join(self.pid_dir, name)) as f:
                    out[int(name[:-4])] = int(f.read())
        return out

    def wait_pids(self, timeout):
        self.wait_for(lambda: len(self.pids()) == self.np, f"{self.np} pid files", timeout)
        return self.pids()

    def finish(self):
        """Waits for the launcher; kills the job's process group past the
        timeout (then raises)."""
        left = max(1.0, self.timeout - (time.time() - self.started))
        try:
            rc = self.proc.wait(left)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise TimeoutError(f"the job did not end within {self.timeout}s:\n" + self.tail())
        for t in self._threads:
            t.join(5)
        return rc

    def tail(self, n=40):
        with self._cv:
            out = [json.dumps(ln) for ln in self.lines[-n:]]
            return "\n".join(["--- stdout"] + out + ["--- stderr"] + self.stderr[-n:])

    def reports(self):
        out = {}
        for name in os.listdir(self.report):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(self.report, name)) as f:
                    r = json.load(f)
                out[r["rank"]] = r
        return out


def reference_model(out, steps, example_args, timeout=120):
    """The final parameters of the example trained in one process for
    ``steps`` steps (tp 1 unless ``example_args`` say otherwise), without
    any failure: what a job that kept its global batch across a change of
    membership must end with."""
    from strata import checkpoint
    job = Job("none", 1, ["--steps", str(steps)] + list(example_args), out, timeout=timeout)
    rc = job.finish()
    assert rc == 0, job.tail()
    return checkpoint.load(os.path.join(job.report, "final"))["model"]


def kill_rank(job, rank, sig, after_steps, when, rng, timeout):
    """Waits for the job to reach ``after_steps`` steps, then sends ``sig``
    to ``rank``'s training process: right after a step line ("between", with
    the example's --step-sleep keeping every rank out of collectives for a
    while) or after a random delay ("random"). Returns the wall-clock time
    of the kill."""
    pids = job.wait_pids(timeout)
    job.wait_for(lambda: len(job.steps()) >= after_steps, f"{after_steps} steps", timeout)
    if when == "random":
        time.sleep(rng.uniform(0.0, 1.0))
    else:
        n = len(job.steps())
        job.wait_for(lambda: len(job.steps()) > n, "the next step", timeout)
        time.sleep(0.02)
    t = time.time()
    os.kill(pids[rank], sig)
    return t


def run_and_kill(launcher, np, example_args, out, rank, after_steps, rng, timeout, env=None):
    """Runs the example, SIGKILLs ``rank`` at a random moment after
    ``after_steps`` steps (kill_rank), and waits for the job to end; the job
    is killed whole if anything goes wrong. Returns (the Job, when the kill
    was sent, the launcher's exit status)."""
    job = Job(launcher, np, example_args, out, env=env, timeout=timeout)
    try:
        killed_at = kill_rank(job, rank, signal.SIGKILL, after_steps, "random", rng,
                              max(30, timeout - 50))
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    return job, killed_at, rc


def check_survivors(job, ranks, steps, lr, batch, reference):
    """The checks every example job with a membership change ends with: each
    of ``ranks`` (report keys) committed ``steps`` steps, with the
    scheduler's epoch, learning rate (the example's warm-up) and sampler
    position that makes and the record of every step; the parameters are
    bitwise equal across replicas (per tp rank); the final model equals
    ``reference`` (a one-process run's, the global batch being kept)."""
    import math
    from strata import checkpoint
    reports = job.reports()
    by_tp = {}
    for r in ranks:
        rep = reports[r]
        by_tp.setdefault(rep["coords"]["tp"], set()).add(rep["param_hash"])
        assert rep["steps"] == steps and rep["scheduler_epoch"] == steps, r
        assert math.isclose(rep["lr"], lr * min(1.0, (steps + 1) / 10)), rep["lr"]
        assert rep["sampler_position"] == steps * batch, r
        assert [s[0] for s in rep["trained_samples"]] == list(range(steps)), r
    assert all(len(h) == 1 for h in by_tp.values()), by_tp
    final = checkpoint.load(os.path.join(job.report, "final"))["model"]
    assert sorted(final) == sorted(reference)
    for name in reference:
        a, b = final[name], reference[name]
        assert a.shape == b.shape, name
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), name


def rank_environ(pid):
    """The environment a rank's process started with (/proc/<pid>/environ)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    out = {}
    for item in items:
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


class StoreWatch:
    """Reads the elastic layer's store from outside the job, as the ranks
    find it (python/strata/_elastic_launch.py): under torchrun the agent's
    TCPStore at the ranks' MASTER_ADDR:MASTER_PORT (a client of our own);
    under mpirun the file store in the temporary directory named after the
    job's PMIx namespace (or STRATA_STORE). Keys are the layer's own
    (``strata/elastic/<job>/<epoch>/...``): the test watches for the markers
    the ranks write while they recover (the alarm, the decision) to kill a
    rank at a chosen phase."""

    def __init__(self, launcher, pid, job="default"):
        env = rank_environ(pid)
        self.job = job
        self._tcp = None
        self.directory = None
        if launcher == "torchrun":
            import datetime
            import torch.distributed as dist
            self._tcp = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                      timeout=datetime.timedelta(seconds=30),
                                      wait_for_workers=False)
        else:
            url = env.get("STRATA_STORE", "")
            if url.startswith("file:"):
                self.directory = url[len("file:"):].replace("//", "/", 1) + "/elastic"
            else:
                from strata._elastic_launch import _local_store_dir
                self.directory = _local_store_dir(env)

    def key(self, epoch, name):
        return f"strata/elastic/{self.job}/{epoch}/{name}"

    def get(self, key):
        """The key's value, or None while it is absent."""
        if self._tcp is not None:
            k = "strata/" + key  # strata.store.from_torch's prefix
            return self._tcp.get(k).decode() if self._tcp.check([k]) else None
        # The file store's name for a key (src/comm/store/file_store.cc).
        name = "".join(c if c.isalnum() or c in "_-" else "%%%02X" % ord(c) for c in key)
        path = os.path.join(self.directory, "k." + name)
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def wait(self, key, timeout, job=None):
        """Polls for ``key`` every few milliseconds; returns its value.
        ``job`` (a Job): fail early when it ends."""
        deadline = time.time() + timeout
        while True:
            v = self.get(key)
            if v is not None:
                return v
            if job is not None and job.proc.poll() is not None:
                raise RuntimeError(f"the job ended while waiting for store key {key}:\n" +
                                   job.tail())
            if time.time() > deadline:
                raise TimeoutError(f"store key {key} did not appear within {timeout}s" +
                                   ("" if job is None else "\n" + job.tail()))
            time.sleep(0.002)

    def close(self):
        self._tcp = None


def kill_on_hold(job, sig, timeout, poll=0.005):
    """Waits for the example's ``--hold`` announcement (``hold.json`` in the
    pid directory: the rank waits inside the operation it names), then
    sends ``sig`` to the rank that wrote it. Returns (the wall-clock time of
    the kill, the announcement)."""
    pids = job.wait_pids(timeout)
    path = os.path.join(job.pid_dir, "hold.json")
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if job.proc.poll() is not None:
            raise RuntimeError(f"the job ended (status {job.proc.returncode}) before a rank "
                               f"announced its hold in {path}:\n" + job.tail())
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout}s for a rank to announce its hold in {path}:\n"
                               + job.tail())
        time.sleep(poll)
    with open(path) as f:
        hold = json.load(f)
    if pids.get(hold["rank"]) != hold["pid"]:
        raise RuntimeError(f"{path} names rank {hold['rank']} pid {hold['pid']}, its pid file "
                           f"says {pids.get(hold['rank'])}")
    t = time.time()
    os.kill(hold["pid"], sig)
    return t, hold


def hold_released(job):
    """Whether the rank that announced a hold went on (the kill came after
    its hold ended: it did not land inside the operation)."""
    return os.path.exists(os.path.join(job.pid_dir, "hold.released"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", choices=["mpirun", "torchrun", "env"], required=True)
    p.add_argument("--np", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--after", type=int, default=5, help="steps before the kill")
    p.add_argument("--rank", type=int, default=None, help="the rank to kill (default: random)")
    p.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
    p.add_argument("--kill", default="random", choices=["random", "between", "hold", "none"],
                   help="hold: kill the rank that announces its --hold (give the example "
                        "--hold OP:RANK:STEP)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("example_args", nargs="*")
    a = p.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    out = a.out or tempfile.mkdtemp(prefix="strata-elastic-")
    job = Job(a.launcher, a.np, ["--steps", str(a.steps)] + a.example_args, out,
              timeout=a.timeout)
    rank = a.rank if a.rank is not None else rng.randrange(a.np)
    killed_at = None
    sig = signal.SIGKILL if a.signal == "KILL" else signal.SIGSTOP
    if a.kill == "hold":
        killed_at, hold = kill_on_hold(job, sig, a.timeout)
        rank = hold["rank"]
    elif a.kill != "none":
        killed_at = kill_rank(job, rank, sig, a.after, a.kill, rng, a.timeout)
    rc = job.finish()
    if sig == signal.SIGSTOP and a.kill != "none":
        try:  # fenced by the survivors already, normally
            os.kill(job.pids()[rank], signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(json.dumps({"rc": rc, "seed": seed, "rank": rank if a.kill != "none" else None,
                      "killed_at": killed_at, "lines": job.lines, "report": job.report,
                      "stderr_tail": job.stderr[-20:]}))


if __name__ == "__main__":
    main()
