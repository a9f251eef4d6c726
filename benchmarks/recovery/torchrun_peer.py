"""Peer 1 of run_recovery.py, the conventional way: one torchrun job
(``--standalone --nproc-per-node 8 --max-restarts <kills>``, its default
``--monitor-interval`` 0.1 s) of torchrun_worker.py; each kill restarts every
worker, which reload the latest checkpoint.

Kill i comes when rank 0 of attempt i has committed step ``ckpt_every * (i+1)
+ kill_offset`` (plus the kill's phase of a step), so that every kill finds
the same situation: the latest checkpoint ``kill_offset`` steps back. The
restarted attempt redoes those steps and carries on past the step that was in
flight (that is when the lost time is measured) to the next kill."""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import analysis  # noqa: E402
import harness  # noqa: E402
import job  # noqa: E402

PHASES = [
    ("detect_teardown", "detection + teardown by the agent"),
    ("agent_restart", "agent restart (rendezvous) + spawn"),
    ("start_import", "process start + import torch"),
    ("init_pg", "init_process_group (re-rendezvous)"),
    ("build", "build model, optimizer, data"),
    ("ckpt_load", "checkpoint load (torch.load + load_state_dict)"),
    ("first_collective", "DDP init broadcast (first collective)"),
    ("first_step", "first training step"),
]


def run(opts, workdir, kills, phases, victims, log):
    ev_dir = os.path.join(workdir, "events")
    pid_dir = os.path.join(workdir, "pids")
    ckpt_dir = os.path.join(workdir, "ckpt")
    K, off = opts.ckpt_every, opts.kill_offset
    kill_steps = [K * (i + 1) + off for i in range(kills)]
    # Past the last kill: the step in flight, then one more.
    total = kill_steps[-1] + 2 if kills else K + 2
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(job.WORLD),
           "--max-restarts", str(kills), os.path.join(HERE, "torchrun_worker.py"),
           "--events", ev_dir, "--pid-dir", pid_dir, "--steps", str(total),
           "--ckpt-dir", ckpt_dir, "--ckpt-every", str(K)]
    log(f"  $ {' '.join(cmd)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(os.path.join(workdir, "torchrun.out"), "w") as out, \
            open(os.path.join(workdir, "torchrun.err"), "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
    rank0 = harness.JsonLines(path=os.path.join(ev_dir, "events.0.jsonl"))
    results, watchers = [], []
    try:
        for i in range(kills):
            target = kill_steps[i]
            seen, rec = rank0.wait_for(
                lambda r, i=i, t=target: r["event"] == "step" and r["attempt"] == i
                and r["step"] == t, time.time() + opts.deadline,
                f"step {target} of attempt {i} on rank 0")
            steps = [r for _, r in rank0.records if r["event"] == "step" and r["attempt"] == i]
            step_time = analysis.steady_step_time(steps)
            when = rec["time"] + phases[i] * step_time
            time.sleep(max(0.0, when - time.time()))
            pids = harness.read_pids(pid_dir, range(job.WORLD))
            victim = victims[i]
            watcher = harness.ExitWatcher([p for r, p in pids.items() if r != victim])
            t_kill = harness.sigkill(pids[victim])
            watchers.append(watcher)
            results.append({"kill": i, "victim": victim, "t_kill": t_kill, "phase": phases[i],
                            "step_time": step_time, "attempt": i, "pids": pids})
            log(f"  kill {i + 1}/{kills}: rank {victim} (pid {pids[victim]}) "
                f"{t_kill - rec['time']:.2f} s after step {target}")
        if kills:
            rank0.wait_for(lambda r: r["event"] == "done", time.time() + opts.deadline,
                           "the end of the last attempt")
        proc.wait(timeout=opts.deadline)
    except (harness.Timeout, subprocess.TimeoutExpired) as e:
        log(f"  torchrun: {e}")
        if results:
            results[-1]["error"] = str(e)
    finally:
        harness.stop_group(proc)
        rank0.stop()
    events = analysis.load_events(ev_dir)
    for res, watcher in zip(results, watchers):
        _analyse(res, events, watcher.wait(5), log)
    saves = [r["seconds"] for r in events if r["event"] == "ckpt_saved"]
    sizes = [r["bytes"] for r in events if r["event"] == "ckpt_saved"]
    imports = [r["imported"] - r["main"] for r in events if r["event"] == "start"]
    interp = [r["main"] - r["proc_start"] for r in events if r["event"] == "start"]
    first = [r for r in events if r["event"] == "step" and r["attempt"] == 0 and r["rank"] == 0]
    extra = {"command": " ".join(cmd), "exit_code": proc.returncode,
             "ckpt_save_s": analysis.median(saves), "ckpt_bytes": max(sizes) if sizes else None,
             "import_torch_s": analysis.median(imports), "interpreter_start_s": analysis.median(interp),
             "steady_step_s": analysis.steady_step_time(first, count=100),
             "kill_steps": kill_steps}
    return results, extra


def _analyse(res, events, exits, log):
    i, t_kill = res["attempt"], res["t_kill"]
    new = [r for r in events if r.get("attempt") == i + 1]
    # Every step the killed attempt committed (some ranks may still commit
    # the step in flight after the kill: lost all the same).
    old_steps = [r for r in events if r["event"] == "step" and r.get("attempt") == i]
    if not new or res.get("error"):
        res["ok"] = False
        res.setdefault("error", f"attempt {i + 1} never started")
        return
    # The last step every rank committed before the kill.
    committed = min(max((r["step"] for r in old_steps if r["rank"] == k), default=0)
                    for k in range(job.WORLD))
    old_gone = [t for t in exits.values() if t is not None]

    def latest(event):
        ts = [r["time"] for r in new if r["event"] == event]
        return max(ts) if len(ts) == job.WORLD else None

    def latest_start(field):
        ts = [r[field] for r in new if r["event"] == "start"]
        return max(ts) if len(ts) == job.WORLD else None

    step_no, t_step, _ = analysis.first_step_after(new, "step", t_kill)
    loaded = [r["step"] for r in new if r["event"] == "ckpt_loaded"]
    bounds = [("detect_teardown", max(old_gone) if old_gone else None),
              ("agent_restart", latest_start("proc_start")),
              ("start_import", latest_start("imported")),
              ("init_pg", latest("pg_ready")), ("build", latest("model_built")),
              ("ckpt_load", latest("ckpt_loaded")), ("first_collective", latest("collective")),
              ("first_step", t_step)]
    if any(t is None for _, t in bounds):
        res["ok"] = False
        res["error"] = "missing events: " + ", ".join(n for n, t in bounds if t is None)
        return
    phases, prev = {}, t_kill
    for name, t in bounds:
        phases[name] = t - prev
        prev = t
    redo_end = [r["time"] for r in new if r["event"] == "step" and r["step"] == committed + 1]
    t_prev = max(r["time"] for r in old_steps if r["step"] == committed)
    res.update({
        "ok": True, "phases": phases,
        "kill_to_collective": latest("collective") - t_kill,
        "kill_to_step": t_step - t_kill,
        "kill_to_step_steps": (t_step - t_kill) / res["step_time"],
        "last_committed": committed, "resumed_from": min(loaded),
        "steps_redone": committed - min(loaded),
        "lost_s": (max(redo_end) - (t_prev + res["step_time"])) if len(redo_end) == job.WORLD else None,
        "world_after": job.WORLD,
    })
    log(f"    kill {i + 1}: first collective {res['kill_to_collective']:.2f} s, first step "
        f"{res['kill_to_step']:.2f} s, redone {res['steps_redone']} steps, lost "
        f"{res['lost_s'] if res['lost_s'] is None else round(res['lost_s'], 2)} s")
