"""Peer 2 of run_recovery.py: torchft 0.2.0 from PyPI, 8 replica groups of one
rank (torchft_worker.py, run with the venv's python), one Lighthouse from the
wheel's ``torchft_lighthouse``, Gloo, CPU.

The driver is every replica group's supervisor, as its own torchrun agent
(``--max-restarts``) would be in torchft's documented setup: a replica that
exits on its own (a crash) is started again at once. The replica we SIGKILL is
started again only after the survivors committed a step without it (a
replacement arriving later), so that its start (import torch, healing from a
peer) does not take the survivors' CPU while they recover; the next kill
waits until all 8 train together again for ``--steady`` steps.

Each kill: the survivors' first error (failure_seen / step_failed), the new
quorum (torchft logs "reconfiguring for quorum_id=" when the Lighthouse's
answer arrives), the process group reconfigured, the first successful
all-reduce, the first committed step."""

import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import analysis  # noqa: E402
import harness  # noqa: E402
import job  # noqa: E402

# torchft's README: `torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
# --join_timeout_ms 10000` (heartbeat timeout left at its 5000 ms default).
README_LIGHTHOUSE = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]

CONFIGS = {
    "defaults": {
        "label": "torchft defaults",
        "detail": "Lighthouse as in torchft's README (--min_replicas 1 --quorum_tick_ms 100 "
                  "--join_timeout_ms 10000, heartbeat timeout 5000 ms); ProcessGroupGloo() "
                  "(60 s timeout); Manager defaults (timeout, quorum_timeout 60 s, heartbeat "
                  "100 ms), min_replica_size 1",
        "lighthouse": README_LIGHTHOUSE, "worker": []},
    "example": {
        "label": "torchft train_ddp.py settings",
        "detail": "as torchft's train_ddp.py example: ProcessGroupGloo(timeout=5 s), "
                  "Manager(timeout=30 s, min_replica_size=1); README Lighthouse",
        "lighthouse": README_LIGHTHOUSE, "worker": ["--pg-timeout", "5", "--timeout", "30"]},
    "fast": {
        "label": "torchft fastest honest settings",
        "detail": "ProcessGroupGloo(timeout=2 s): the shortest Gloo timeout that kept the "
                  "no-failure steps of every run here free of spurious failures (1 s did "
                  "not); Lighthouse --heartbeat_timeout_ms 1000 --quorum_tick_ms 20 "
                  "(a dead replica is out of the healthy set before the survivors' Gloo "
                  "timeout ends); Manager timeout 30 s (it also bounds the checkpoint "
                  "transfer a rejoining replica heals from), heartbeat 100 ms",
        "lighthouse": ["--min_replicas", "1", "--quorum_tick_ms", "20", "--join_timeout_ms",
                       "10000", "--heartbeat_timeout_ms", "1000"],
        "worker": ["--pg-timeout", "2", "--timeout", "30"]},
}

PHASES = [
    ("detect", "failure seen by every survivor (Gloo error or timeout)"),
    ("quorum", "new quorum from the Lighthouse"),
    ("reconfigure", "process group reconfigured"),
    ("first_collective", "first all-reduce among the survivors"),
    ("commit", "should_commit + optimizer step"),
]


class Replicas:
    """The 8 replica processes and their supervision."""

    def __init__(self, python, argv, workdir, log):
        self._python, self._argv, self._workdir, self._log = python, argv, workdir, log
        self.procs = {}
        self.crashes = []  # (time, replica, returncode)
        self.held = set()  # killed by us: not restarted by the supervisor
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)

    def start(self):
        for r in range(job.WORLD):
            self.spawn(r)
        self._thread.start()

    def spawn(self, r, echo=False):
        out = open(os.path.join(self._workdir, f"replica.{r}.log"), "a")
        with self._lock:
            self.procs[r] = subprocess.Popen(
                [self._python, os.path.join(HERE, "torchft_worker.py"), "--replica", str(r),
                 *self._argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
            self.held.discard(r)
        out.close()
        return self.procs[r]

    def _supervise(self):
        while not self._stop.wait(0.05):
            with self._lock:
                dead = [(r, p) for r, p in self.procs.items()
                        if p.poll() is not None and r not in self.held]
            for r, p in dead:
                self.crashes.append((time.time(), r, p.returncode))
                self._log(f"    replica {r} (pid {p.pid}) exited with {p.returncode}; restarting it")
                self.spawn(r)

    def kill(self, r):
        with self._lock:
            self.held.add(r)
            pid = self.procs[r].pid
        return pid, harness.sigkill(pid)

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        for p in self.procs.values():
            harness.stop_group(p, grace=3)


def run(opts, venv, config, workdir, kills, phases, victims, log, ddp=False):
    python = os.path.join(venv, "bin", "python")
    port = harness.free_port()
    ev_dir = os.path.join(workdir, "events")
    lh_cmd = [os.path.join(venv, "bin", "torchft_lighthouse"), "--bind", f"[::]:{port}",
              *config["lighthouse"]]
    argv = ["--events", ev_dir, "--pid-dir", os.path.join(workdir, "pids"), "--steps", "1000000",
            "--lighthouse", f"http://localhost:{port}", *config["worker"]] + (["--ddp"] if ddp else [])
    log(f"  $ {' '.join(lh_cmd)}")
    log(f"  $ {python} torchft_worker.py --replica R {' '.join(argv)}  (R = 0..7)")
    lh_log = os.path.join(workdir, "lighthouse.log")
    with open(lh_log, "w") as f:
        lighthouse = subprocess.Popen(lh_cmd, stdout=f, stderr=subprocess.STDOUT,
                                      env=dict(os.environ, RUST_LOG="info"), start_new_session=True)
    replicas = Replicas(python, argv, workdir, log)
    rank0 = harness.JsonLines(path=os.path.join(ev_dir, "events.0.jsonl"))
    results, windows = [], []
    try:
        replicas.start()
        since = 0.0
        for i in range(kills):
            rec = _wait_steady(rank0, since, opts.steady, time.time() + opts.torchft_deadline)
            steps = [r for _, r in rank0.records if r["event"] == "step" and r["world"] == job.WORLD]
            step_time = analysis.steady_step_time(steps)
            time.sleep(max(0.0, rec["time"] + phases[i] * step_time - time.time()))
            victim = victims[i]
            pids = {r: p.pid for r, p in replicas.procs.items()}
            pid, t_kill = replicas.kill(victim)
            res = {"kill": i, "victim": victim, "t_kill": t_kill, "phase": phases[i],
                   "step_time": step_time, "pids": pids}
            results.append(res)
            log(f"  kill {i + 1}/{kills}: replica {victim} (pid {pid}) "
                f"{t_kill - rec['time']:.2f} s after step {rec['step']}")
            try:
                # A step of the old quorum may still commit after the kill
                # (its all-reduce had finished): wait for one of the new.
                rank0.wait_for(lambda r, t=t_kill: r["event"] == "step" and r["time"] > t
                               and r["world"] < job.WORLD,
                               time.time() + opts.torchft_deadline,
                               "committed step on replica 0 after the kill")
            except harness.Timeout as e:
                res["error"] = f"{e} ({opts.torchft_deadline:.0f} s); lighthouse: " + _last_status(lh_log)
                log(f"    {res['error']}")
                break
            res["t_respawn"] = time.time()
            res["respawn_pid"] = replicas.spawn(victim).pid
            since = res["t_respawn"]
            windows.append((t_kill, None))
        if results and "error" not in results[-1]:
            _wait_steady(rank0, since, opts.steady, time.time() + opts.torchft_deadline)
    except harness.Timeout as e:
        log(f"  torchft: {e}; lighthouse: {_last_status(lh_log)}")
        if results and "error" not in results[-1]:
            results[-1]["error"] = str(e)
    finally:
        replicas.stop()
        harness.stop_group(lighthouse)
        rank0.stop()
    events = analysis.load_events(ev_dir)
    for res in results:
        _analyse(res, events, replicas.crashes, log)
    starts = [r for r in events if r["event"] == "start"]
    steady = [r for r in events if r["event"] == "step" and r["rank"] == 0 and r["world"] == job.WORLD]
    extra = {"lighthouse_command": " ".join(lh_cmd), "worker_args": " ".join(argv),
             "crashes": [{"time": t, "replica": r, "returncode": c} for t, r, c in replicas.crashes],
             "spurious_failures": _spurious(events, results),
             "steady_step_s": analysis.steady_step_time(steady, count=1000),
             "torch": starts[0]["torch"] if starts else None,
             "torchft": starts[0]["torchft"] if starts else None,
             "import_torch_s": analysis.median([r["imported"] - r["main"] for r in starts]),
             "rejoin_s": analysis.median([r.get("rejoin_s") for r in results]),
             "ddp_errors": _errors(os.path.join(workdir)) if ddp else None}
    return results, extra


def _wait_steady(rank0, since, count, deadline):
    """The record of the `count`-th consecutive step replica 0 committed with
    all 8 replicas after `since`."""
    state = {"run": 0}

    def steady(r):
        if r["time"] <= since or r["event"] not in ("step", "step_failed"):
            return False
        if r["event"] == "step" and r["world"] == job.WORLD:
            state["run"] += 1
        else:
            state["run"] = 0
        return state["run"] >= count

    _, rec = rank0.wait_for(steady, deadline, f"{count} steps with all {job.WORLD} replicas")
    return rec


def _analyse(res, events, crashes, log):
    t_kill, victim = res["t_kill"], res["victim"]
    survivors = {p for r, p in res["pids"].items() if r != victim}
    if res.get("error"):
        res["ok"] = False
        res["crashed"] = sorted({r for t, r, _ in crashes if t > t_kill})
        return
    # Steps whose all-reduce finished before the kill belong to the old
    # quorum even when their commit comes after it.
    committed = max(r["step"] for r in events if r["event"] == "collective"
                    and r["time"] < t_kill and r["pid"] in survivors)
    t_prev = max(r["time"] for r in events if r["event"] == "step" and r["step"] == committed
                 and r["pid"] in survivors)

    def all_survivors(names):
        firsts = {}
        for r in events:
            if r["event"] in names and r["time"] > t_kill and r["pid"] in survivors:
                firsts.setdefault(r["pid"], r["time"])
        return max(firsts.values()) if firsts else None

    coll_step, t_coll, _ = analysis.first_step_after(events, "collective", t_kill, above=committed)
    step_no, t_step, recs = analysis.first_step_after(events, "step", t_kill, above=committed)
    bounds = [("detect", all_survivors({"failure_seen", "step_failed"})),
              ("quorum", all_survivors({"quorum"})),
              ("reconfigure", all_survivors({"pg_configured"})),
              ("first_collective", t_coll), ("commit", t_step)]
    phases, prev = {}, t_kill
    for name, t in bounds:
        t = prev if t is None else max(t, prev)
        phases[name] = t - prev
        prev = t
    redo = [r["time"] for r in events if r["event"] == "step" and r["step"] == committed + 1
            and r["time"] > t_kill]
    rejoin = [r["time"] for r in events if r["event"] == "step" and r["pid"] == res.get("respawn_pid")]
    res.update({
        "ok": True, "phases": phases,
        "kill_to_collective": t_coll - t_kill, "kill_to_step": t_step - t_kill,
        "kill_to_step_steps": (t_step - t_kill) / res["step_time"],
        "last_committed": committed, "first_step_after": step_no,
        "steps_redone": committed + 1 - step_no,
        "lost_s": (max(redo) - (t_prev + res["step_time"])) if redo else None,
        "world_after": max(r["world"] for r in recs),
        "crashed": sorted({r for t, r, _ in crashes if t_kill < t < t_step}),
        "rejoin_s": (min(rejoin) - res["t_respawn"]) if rejoin else None,
    })
    log(f"    kill {res['kill'] + 1}: first all-reduce {res['kill_to_collective']:.2f} s, "
        f"first step {res['kill_to_step']:.2f} s (world {res['world_after']}), "
        f"phases {', '.join(f'{k} {v:.2f}' for k, v in phases.items())}"
        + (f", crashed replicas {res['crashed']}" if res["crashed"] else ""))


def _spurious(events, results):
    """Failed steps outside any kill's recovery and any rejoin (there should
    be none: a setting that fails steps without a fault is not honest)."""
    windows = []
    for res in results:
        end = res["t_kill"] + (res.get("kill_to_step") or 1e9)
        windows.append((res["t_kill"], end))
        if res.get("t_respawn"):
            windows.append((res["t_respawn"], res["t_respawn"] + (res.get("rejoin_s") or 1e9)
                            + 2 * res["step_time"]))
    first_steady = min((r["time"] for r in events if r["event"] == "step"
                        and r["world"] == job.WORLD), default=None)
    if first_steady is None:
        return None
    bad = [r for r in events if r["event"] == "step_failed" and r["time"] > first_steady
           and not any(a <= r["time"] <= b for a, b in windows)]
    return len(bad)


def _last_status(lh_log):
    try:
        with open(lh_log) as f:
            lines = [ln.strip() for ln in f if "Quorum status" in ln or "ERROR" in ln]
        return lines[-1][:300] if lines else "(no quorum status logged)"
    except OSError:
        return "(no log)"


def _errors(workdir):
    """The distinct error lines the replicas printed (for the DDP-wrapper probe)."""
    seen = []
    for name in sorted(os.listdir(workdir)):
        if name.startswith("replica.") and name.endswith(".log"):
            with open(os.path.join(workdir, name)) as f:
                for line in f:
                    line = line.strip()
                    if (line.endswith("Error") or "Error:" in line or "error:" in line) \
                            and line[:200] not in seen:
                        seen.append(line[:200])
    return seen[:8]
