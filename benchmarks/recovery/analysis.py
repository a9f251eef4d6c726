"""Reading the per-rank event files the workers write, and the figures every
side of the recovery benchmark is measured by (run_recovery.py's docstring
defines them)."""

import glob
import json
import os
import statistics


def load_events(directory):
    """Every record of every events.<rank>.jsonl under `directory`, by time."""
    out = []
    for path in glob.glob(os.path.join(directory, "events.*.jsonl")):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut by SIGKILL
    out.sort(key=lambda r: r["time"])
    return out


def steady_step_time(step_records, upto=None, count=5):
    """Median interval between consecutive committed steps of one rank
    (records of consecutive step numbers only), over the last `count`
    intervals before `upto`."""
    recs = [r for r in step_records if upto is None or r["time"] < upto]
    intervals = [b["time"] - a["time"] for a, b in zip(recs, recs[1:])
                 if b["step"] == a["step"] + 1]
    intervals = intervals[-count:]
    return statistics.median(intervals) if intervals else None


def first_step_after(events, event, t_kill, pids=None, above=0):
    """The lowest step number above `above` that has `event` records after
    t_kill (from processes in `pids` if given), and the time the last of them
    came: the moment every rank that took part had it."""
    by_step = {}
    for r in events:
        if r["event"] == event and r["time"] > t_kill and r["step"] > above and (
                pids is None or r["pid"] in pids):
            by_step.setdefault(r["step"], []).append(r)
    if not by_step:
        return None, None, []
    step = min(by_step)
    recs = by_step[step]
    return step, max(r["time"] for r in recs), recs


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(kills, keys):
    """Median (and min/max) of each key over the kills that recovered."""
    ok = [k for k in kills if k.get("ok")]
    out = {"kills": len(kills), "recovered": len(ok)}
    for key in keys:
        vals = [k[key] for k in ok if k.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
        out[key + "_min"] = min(vals) if vals else None
        out[key + "_max"] = max(vals) if vals else None
    phases = {}
    for k in ok:
        for name, v in (k.get("phases") or {}).items():
            phases.setdefault(name, []).append(v)
    out["phases"] = {name: statistics.median(v) for name, v in phases.items()}
    return out
