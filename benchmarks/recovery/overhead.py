"""The elastic loop's cost with no failure (run_recovery.py --sides overhead):
runs recovery/overhead_worker.py under each launcher (--overhead-launchers:
mpirun --with-ft ulfm, torchrun) once per rank count (--overhead-np), and
turns its block lines into rows.

Each rank count is one job alternating blocks of steps with the loop off
(a plain loop over the same step body), on (strata.elastic.run) and, for
scale, sync (the plain loop with one more small all-reduce). The figures:

- the ratio of the median step times, on / off (the issue's target);
- the loop's own time per step: the commit vote from the last rank's
  arrival to the answer (the median over the ranks, per step), plus what it
  adds between steps (end of optimizer.step() to the next step's start, on
  minus off). The vote's whole time on a rank is larger: it starts with the
  wait for the slowest rank, which in a plain loop the next collective
  absorbs instead, so it is reported apart and not counted;
- one small all-reduce timed the same way (from the last caller's arrival):
  what any synchronisation point costs on this machine. With more ranks than
  cores every hop waits for a rank to be scheduled.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_util  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_ARGS = ("{worker} --hidden {hidden} --layers {layers} --batch {batch} --samples {samples} "
               "--lr {strata_lr} --blocks {blocks} --block-steps {block_steps}")
# mpirun: strata's MPI backend, the elastic store a file store in /dev/shm;
# torchrun: Gloo, the elastic store torchrun's TCPStore (the agent serves it).
CMDS = {
    "mpirun": "{mpirun} --allow-run-as-root --oversubscribe --bind-to none --with-ft ulfm -np {np} "
              "-x PYTHONPATH -x OMP_NUM_THREADS=1 {python} " + WORKER_ARGS,
    "torchrun": "{python} -m torch.distributed.run --standalone --nproc-per-node {np} "
                + WORKER_ARGS,
}


def run(args, values, work, np, log, launcher="mpirun"):
    """One job of `np` ranks: {"np", "launcher", "off", "on", "blocks",
    ...figures}, or {"np", "launcher", "error"}."""
    worker = os.path.join(HERE, "overhead_worker.py")
    cmd = shlex.split(CMDS[launcher].format(worker=worker, np=np, blocks=args.overhead_blocks,
                                            block_steps=args.overhead_block_steps, **values))
    log(f"  $ {' '.join(cmd)}")
    t0 = time.time()
    load = os.getloadavg()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.deadline * 2,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as e:
        return {"np": np, "launcher": launcher, "command": " ".join(cmd),
                "error": f"overhead job did not finish in {e.timeout:.0f} s"}
    with open(os.path.join(work, f"overhead_{launcher}_np{np}.out"), "w") as f:
        f.write(out.stdout + "\n--- stderr\n" + out.stderr)
    res = {"np": np, "launcher": launcher, "command": " ".join(cmd), "off": [], "on": [], "sync": [], "blocks": [],
           "wall_s": time.time() - t0, "loadavg_before": load[0],
           "loadavg_after": os.getloadavg()[0], "cores": os.cpu_count()}
    for line in out.stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "block":
            res[rec["mode"]] += rec["intervals"]
            res["blocks"].append(rec)
    if out.returncode != 0 or not res["off"] or not res["on"]:
        res["error"] = f"overhead job exited {out.returncode}: {out.stderr.strip()[-400:]}"
        log(f"  {res['error']}")
        return res
    med = statistics.median

    def pooled(mode, key):
        return [x for b in res["blocks"] if b["mode"] == mode for x in b.get(key, [])]

    for mode in ("off", "on", "sync"):
        for key in ("opt_step", "gaps", "after_last", "waits"):
            values_ = pooled(mode, key)
            res[f"{mode}_{key}"] = med(values_) if values_ else None
    res["off_median"] = med(res["off"])
    res["on_median"] = med(res["on"])
    res["ratio"] = res["on_median"] / res["off_median"]
    # Before this split the benchmark reported optimizer.step() on - off plus
    # the gap: the vote's wait for the slowest rank included.
    res["added_s"] = (res["on_opt_step"] - res["off_opt_step"]) + (res["on_gaps"] - res["off_gaps"])
    res["own_s"] = res["on_after_last"] + max(0.0, res["on_gaps"] - res["off_gaps"])
    res["own_fraction"] = res["own_s"] / res["off_median"]
    # Each on block against the off block of the same round.
    off_by_round = {b["block"]: b for b in res["blocks"] if b["mode"] == "off" and b["intervals"]}
    res["pair_ratios"] = [med(b["intervals"]) / med(off_by_round[b["block"]]["intervals"])
                          for b in res["blocks"]
                          if b["mode"] == "on" and b["intervals"] and b["block"] in off_by_round]
    # The rounds' ratios pair each on block with the off block just before
    # it (drift in the machine's load cancels); their median, with a
    # bootstrap 95% interval, is the target's figure.
    res["round_median"] = med(res["pair_ratios"])
    res["round_ci"] = bench_util.median_ci(res["pair_ratios"])
    sync = ""
    if res["sync_after_last"] is not None:
        sync = f"; one more all-reduce {res['sync_after_last'] * 1e3:.2f} ms after the last caller"
    log(f"  {launcher}, {np} ranks: step time off {res['off_median']:.3f} s, on {res['on_median']:.3f} s: "
        f"on/off {res['ratio']:.3f} (rounds {[round(r, 3) for r in res['pair_ratios']]}: median "
        f"{res['round_median']:.3f}, 95% CI {res['round_ci'][0]:.3f}-{res['round_ci'][1]:.3f}); vote "
        f"{res['on_after_last'] * 1e3:.2f} ms after the last voter (whole wait "
        f"{res['on_waits'] * 1e3:.2f} ms), between steps {res['off_gaps'] * 1e3:.2f} -> "
        f"{res['on_gaps'] * 1e3:.2f} ms: the loop's own {res['own_s'] * 1e3:.2f} ms = "
        f"{res['own_fraction'] * 100:.2f}% of a step{sync}")
    return res


def rows(results, params_m):
    out = []
    for res in results:
        np = res["np"]
        case = (f"{res['launcher']}, {np} CPU ranks on {res.get('cores', '?')} cores, dp{np}, "
                f"MLP {params_m:.1f}M, no failure")
        if res.get("error"):
            out.append(dict(case=case, metric="step time, elastic loop on / off", unit="x",
                            strata=None, peer="same step, plain loop", peer_value=None,
                            target="<= 1.02"))
            continue
        out += [
            dict(case=case, metric="step time, elastic loop on (median)", unit="s",
                 strata=res["on_median"], peer="same step, plain loop (median)",
                 peer_value=res["off_median"], target=None),
            dict(case=f"{case}; {len(res['pair_ratios'])} rounds, median's 95% CI "
                 f"{res['round_ci'][0]:.3f}-{res['round_ci'][1]:.3f}",
                 metric="step time, elastic loop on / off (median of the rounds' ratios)",
                 unit="x", strata=res["round_median"], peer=None, peer_value=None,
                 target="<= 1.02", target_on="strata"),
            dict(case=case, metric="the loop's own time per step: the vote after the last voter "
                 "+ between steps (median)", unit="ms", strata=res["own_s"] * 1e3, peer=None,
                 peer_value=None, target=None),
            dict(case=case, metric="the loop's own time, share of the plain step", unit="%",
                 strata=100 * res["own_fraction"], peer=None, peer_value=None, target="<= 2",
                 target_on="strata"),
            dict(case=case, metric="the vote's whole wait on a rank (the slowest rank's lateness "
                 "included; median)", unit="ms", strata=res["on_waits"] * 1e3, peer=None,
                 peer_value=None, target=None),
        ]
        if res["sync_after_last"] is not None:
            out.append(dict(case=case, metric="the vote after the last voter (median)", unit="ms",
                            strata=res["on_after_last"] * 1e3,
                            peer="one more all-reduce (2 int64, dp), after the last caller",
                            peer_value=res["sync_after_last"] * 1e3, target=None))
    return out


def note(results):
    lines = []
    for res in results:
        if res.get("error"):
            lines.append(f"- overhead, {res['launcher']}, {res['np']} ranks: {res['error']}")
            continue
        lines.append(
            f"- overhead (no failure), {res['launcher']}, {res['np']} ranks: one job alternating "
            f"blocks of {len(res['blocks'][0]['intervals']) + 2} steps with the elastic loop off, "
            f"on and (sync) off with one more all-reduce (recovery/overhead_worker.py); "
            f"{len(res['off'])} / {len(res['on'])} step intervals off / on; on/off per round "
            f"{', '.join(f'{r:.3f}' for r in res['pair_ratios'])}; optimizer.step() median "
            f"{res['off_opt_step'] * 1e3:.1f} ms off, {res['on_opt_step'] * 1e3:.1f} ms on (the "
            f"vote in its pre-hook: {res['on_waits'] * 1e3:.2f} ms on a rank, of which "
            f"{res['on_after_last'] * 1e3:.2f} ms after the last voter; on - off as the earlier "
            f"rows counted it, wait included: {res['added_s'] * 1e3:.1f} ms); end of "
            f"optimizer.step() to the next step's start {res['off_gaps'] * 1e3:.2f} ms off, "
            f"{res['on_gaps'] * 1e3:.2f} ms on; load average {res['loadavg_before']:.1f} before, "
            f"{res['loadavg_after']:.1f} after")
    return "\n".join(lines)
