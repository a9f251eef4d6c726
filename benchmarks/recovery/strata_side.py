"""strata's side of run_recovery.py: its example (examples/elastic/train.py, or
any command given with --strata-cmd) launched once per kill.

The command gets the job through placeholders ({python}, {mpirun}, {example},
{steps}, {pid_dir}, plus the job's numbers {hidden} {layers} {batch} {samples}
{lr} {strata_lr} {momentum} {warmup}) and must

  - train job.py's job on 8 ranks, data parallel over all 8;
  - write its pid to {pid_dir}/<world rank>.pid on every rank;
  - print on rank 0's stdout one JSON line per committed step,
    {"event": "step", "step", "loss", "world", "dp", "time"} (time: time.time()
    when the step was committed), and one per recovery, {"event": "recovery",
    "failed", "detect_s", "agree_s", "rebuild_s", "restore_s", "world", "dp"};
  - exit 0 when the survivors finish.

Kill i comes when rank 0 printed step ``kill_step`` (plus the kill's phase of
a step). The recovery line carries wall-clock times (time.time() on rank 0,
the same clock as the driver's kill time): ``known_by_all_at`` (every
survivor knew of the failure), ``rebuilt_at`` (the end of the new world's
first barrier: its first collective, which every member has entered) and
``cause.failed_at + first_step_s`` (rank 0's commit of the first step after
the recovery, which every rank agreed through the store). So

  kill -> first collective  = rebuilt_at - t_kill
  kill -> first step        = failed_at + first_step_s - t_kill
  phases (adding up to it)  = detection (kill -> known_by_all_at), agreement
                              (agree_s), rebuild (rebuild_s, with the
                              Shrink and the first barrier), restore
                              (restore_s) and the redone step (the rest).

A line without those times falls back on when the driver read it.
"""

import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import analysis  # noqa: E402
import harness  # noqa: E402
import job  # noqa: E402

PHASES = [("detect_s", "detection (kill -> every survivor knew)"), ("agree_s", "agreement"),
          ("rebuild_s", "rebuild (shrink, new world, first barrier)"), ("restore_s", "restore"),
          ("redo_s", "the redone step")]


def command(template, values):
    return shlex.split(template.format(**values))


def run(opts, template, values, workdir, kills, phases, victims, log):
    results, extra = [], {"commands": []}
    for i in range(kills):
        pid_dir = os.path.join(workdir, f"pids.{i}")
        vals = dict(values, pid_dir=pid_dir, steps=opts.kill_step + 4)
        cmd = command(template, vals)
        if i == 0:
            log(f"  $ {' '.join(cmd)}")
        extra["commands"].append(" ".join(cmd))
        with open(os.path.join(workdir, f"strata.{i}.err"), "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        out = harness.JsonLines(pipe=proc.stdout, raw_log=os.path.join(workdir, f"strata.{i}.out"))
        res = {"kill": i, "victim": victims[i], "phase": phases[i]}
        results.append(res)
        try:
            seen, rec = out.wait_for(lambda r: r.get("event") == "step" and r.get("step") == opts.kill_step,
                                     time.time() + opts.deadline, f"step {opts.kill_step} from strata")
            res["world_before"] = rec.get("world")
            res["dp_before"] = rec.get("dp")
            step_time = analysis.steady_step_time([_timed(s, r) for s, r in out.records
                                                   if r.get("event") == "step"])
            t_ref = _timed(seen, rec)["time"]
            time.sleep(max(0.0, t_ref + phases[i] * step_time - time.time()))
            pid = harness.read_pids(pid_dir, [victims[i]])[victims[i]]
            t_kill = harness.sigkill(pid)
            res.update({"t_kill": t_kill, "step_time": step_time})
            log(f"  kill {i + 1}/{kills}: rank {victims[i]} (pid {pid}) "
                f"{t_kill - t_ref:.2f} s after step {opts.kill_step}")
            entry = out.wait_for(lambda r: r.get("event") == "recovery",
                                 time.time() + opts.deadline, "a recovery line")
            seen_rec, recov = entry
            seen_step, first = out.wait_for(lambda r: r.get("event") == "step",
                                            time.time() + opts.deadline,
                                            "a committed step after the recovery line",
                                            after=out.index(entry) + 1)
            # The old world may commit the step in flight before it learns
            # of the failure: the last committed is the last before the recovery line.
            before = [_timed(t, r) for t, r in out.records[:out.index(entry)]
                      if r.get("event") == "step"]
            res["last_committed"] = max(r["step"] for r in before)
            t_prev = max(r["time"] for r in before if r["step"] == res["last_committed"])
            t_step = _timed(seen_step, first)["time"]
            t_coll = seen_rec - float(recov.get("restore_s") or 0.0)
            cause = recov.get("cause") or {}
            if isinstance(recov.get("rebuilt_at"), (int, float)):
                t_coll = float(recov["rebuilt_at"])
            if isinstance(cause.get("failed_at"), (int, float)) and recov.get("first_step_s") is not None:
                t_step = float(cause["failed_at"]) + float(recov["first_step_s"])
            split = {k: float(recov[k]) for k, _ in PHASES if recov.get(k) is not None}
            if isinstance(recov.get("known_by_all_at"), (int, float)):
                split["detect_s"] = float(recov["known_by_all_at"]) - t_kill
            split["redo_s"] = (t_step - t_kill) - sum(split[k] for k, _ in PHASES[:4] if k in split)
            redo = [(_timed(s, r)["time"]) for s, r in out.records if r.get("event") == "step"
                    and r.get("step") == res["last_committed"] + 1 and s > t_kill]
            if first.get("step") == res["last_committed"] + 1:
                redo = [t_step]
            res.update({
                "ok": True, "recovery": recov, "phases": split,
                "detected_by": cause.get("source"),
                "kill_to_collective": t_coll - t_kill, "kill_to_step": t_step - t_kill,
                "kill_to_step_steps": (t_step - t_kill) / step_time,
                "steps_redone": res["last_committed"] + 1 - first["step"],
                "lost_s": (redo[0] - (t_prev + step_time)) if redo else None,
                "world_after": first.get("world"), "dp_after": first.get("dp"),
            })
            log(f"    kill {i + 1}: first collective {res['kill_to_collective']:.2f} s, first step "
                f"{res['kill_to_step']:.2f} s ({res['kill_to_step_steps']:.2f} steps), found by "
                f"{res['detected_by']}, phases "
                f"{ {k: round(v, 3) for k, v in res['phases'].items()} }")
            proc.wait(timeout=opts.deadline)
            if proc.returncode != 0:
                res["exit_code"] = proc.returncode
        except (harness.Timeout, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
            res["ok"] = False
            res["error"] = f"{type(e).__name__}: {e}"
            log(f"    strata kill {i + 1}: {res['error']}")
        finally:
            harness.stop_group(proc)
            out.stop()
    return results, extra


def _timed(seen_at, rec):
    """A step record with a wall-clock "time": its own when it is one
    (time.time() of the commit), else when the driver saw the line."""
    t = rec.get("time")
    if not isinstance(t, (int, float)) or abs(t - seen_at) > 60:
        t = seen_at
    return dict(rec, time=t)
