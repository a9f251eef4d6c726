"""What the demo shows of the job seen from inside (docs/observability.md):
metrics served over HTTP and written as .prom files while it trains, MFU,
a timeline of a few steps (Chrome trace / Perfetto JSON), the pipeline
schedule as pictures (simulated and measured), the straggler report, and a
closing summary table.

Everything lands in the output folder: $STRATA_DEMO_OUT, else
build/demo-out of the repository.
"""

import contextlib
import json
import os
import statistics
import time

import torch

import strata.metrics as sm
import strata.timeline as stl
from strata import pipeline

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.environ.get("STRATA_DEMO_OUT") or os.path.join(REPO, "build", "demo-out")
SUMMARY = os.path.join(OUT, "summary.json")


def percentile(values, q):
    """The q-th percentile (0-100) by linear interpolation, as numpy's default."""
    v = sorted(values)
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def make_metrics():
    """The demo's registry: served on a port of each rank's own (rank 0's URL
    is printed) and written to OUT/metrics_rank<r>.prom."""
    os.makedirs(OUT, exist_ok=True)
    return sm.Metrics(job="strata-demo", port=0, file=os.path.join(OUT, "metrics_rank{rank}.prom"),
                      write_interval=5.0)


class Observe:
    """Marks the demo's training steps for the metrics and the timeline and
    prints what they measured."""

    def __init__(self, world, steps):
        self.world = world
        self.steps = steps
        self.timeline_steps = sorted({2, 3, min(100, steps)})
        self.timeline = stl.Timeline(os.path.join(OUT, "timeline"), world=world,
                                     steps=self.timeline_steps)
        self.step_seconds = []
        self.tokens = 0
        self.flops_per_token = None
        self.peak = None

    def start(self, model, seq, tokens_per_step_here):
        """MFU from the model's FLOPs per token (this rank's share, 6N + the
        attention term) over this CPU's measured GEMM peak."""
        self.tokens = tokens_per_step_here
        self.flops_per_token = sm.flops_per_token(model, seq)
        self.peak = sm.peak_flops()
        self.world.metrics.set_mfu(self.flops_per_token, self.peak)
        if self.world.rank == 0:
            print(f"metrics: {self.world.metrics.url} (each rank serves its own port), "
                  f"files {os.path.join(OUT, 'metrics_rank<r>.prom')}; MFU from "
                  f"{self.flops_per_token / 1e6:.2f} MFLOP per token on this rank (6N + 12LHQT) "
                  f"over a measured CPU GEMM peak of {self.peak / 1e9:.1f} GFLOP/s", flush=True)

    @contextlib.contextmanager
    def step(self, step):
        """One training step (schedule, optimizer, checkpoint)."""
        t0 = time.perf_counter()
        with self.world.metrics.step(tokens=self.tokens), self.timeline.step(step):
            yield
        self.step_seconds.append(time.perf_counter() - t0)

    def finish(self, schedule, checkpoint_blocked):
        """Writes the timeline and the pictures; rank 0 prints where they are
        and the summary table. Collective."""
        world = self.world
        self.timeline.close()
        # Which ranks were slow, by compute time (step less the time blocked
        # in collectives) and by collective wait: the cluster view's
        # figures, gathered with one all-gather.
        stragglers = world.metrics.straggler_report()
        # The dp all-reduces still in the flight recorder (its last 2000
        # operations), for their P95.
        ops = world._raw.recorded_ops(0)
        reduces = [(o["completed_ns"] - (o["started_ns"] or o["created_ns"])) / 1e9 for o in ops
                   if o["op"] == "all_reduce" and o["group"] == "dp" and o["state"] == "completed"]
        totals = world.metrics.totals()
        mine = torch.tensor([totals["steps"], totals["step_seconds"],
                             percentile(reduces, 95) or 0.0], dtype=torch.float64)
        every = torch.zeros(world.size * 3, dtype=torch.float64)
        world.group("world").all_gather(every, mine)
        world.metrics.write()
        world.group("world").barrier()
        if world.rank != 0:
            return
        rows = every.view(world.size, 3).tolist()
        merged, ranks = stl.merge(os.path.join(OUT, "timeline"))
        simulated = pipeline.save_picture(schedule.schedule, os.path.join(OUT, "pipeline_1f1b.png"),
                                          title=f"{schedule.schedule.name} (simulated, F = B = 1)")
        measured = self._measured_picture(merged, schedule)
        mfu = [s_tok / sec * self.flops_per_token / self.peak if sec > 0 else 0.0
               for s_tok, sec in ((r[0] * self.tokens, r[1]) for r in rows)]
        dp = world.group("dp").size
        wall = sum(self.step_seconds)
        summary = {
            "tokens_per_second": self.tokens * dp * len(self.step_seconds) / wall,
            "mfu_mean_over_ranks": statistics.mean(mfu),
            "step_seconds_p50": percentile(self.step_seconds, 50),
            "step_seconds_p95": percentile(self.step_seconds, 95),
            "dp_all_reduce_seconds_p95_max_over_ranks": max(r[2] for r in rows),
            "checkpoint_blocked_seconds_total": sum(checkpoint_blocked),
            "checkpoint_saves": len(checkpoint_blocked),
            "steps": len(self.step_seconds),
            "outputs": {"timeline": merged, "pictures": [simulated, measured],
                        "metrics_files": os.path.join(OUT, "metrics_rank<r>.prom")},
        }
        with open(SUMMARY, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"\n{stragglers}", flush=True)
        print(f"\ntimeline of steps {self.timeline_steps} ({len(ranks)} ranks): {merged} "
              "(open it in ui.perfetto.dev)", flush=True)
        print(f"pipeline pictures: {simulated}, {measured}", flush=True)
        print_summary()

    def _measured_picture(self, merged, schedule):
        """The pipeline's step 3 as it ran on the ranks of dp 0 / tp 0 (one
        per stage), from the timeline."""
        with open(merged) as f:
            trace = json.load(f)
        mesh = self.world.mesh
        step = self.timeline_steps[1]
        rows = []
        for stage in range(self.world.group("pp").size):
            rank = mesh.rank(pp=stage, dp=0, tp=0)
            ev = [e for e in trace["traceEvents"] if e.get("pid") == rank and e.get("ph") == "X"]
            (window,) = [e for e in ev if e["cat"] == "step" and e["args"]["step"] == step]
            end = window["ts"] + window["dur"]
            rows.append([(f"{e['args']['stage']}{e['name']}", e["ts"] / 1e6,
                          (e["ts"] + e["dur"]) / 1e6)
                         for e in ev if e["cat"] == "pipeline" and window["ts"] <= e["ts"] <= end])
        t0 = min(a[1] for r in rows for a in r)
        rows = [[(tok, a - t0, b - t0) for tok, a, b in r] for r in rows]
        return pipeline.save_picture(schedule.schedule, os.path.join(OUT, "pipeline_measured.png"),
                                     rows=rows, title=f"{schedule.schedule.name}, step {step} "
                                                      "as measured (dp 0, tp 0)")


def record_recovery(recovery_seconds, detail, eviction=None, spares=None, joins=None):
    """The recovery act's figures, added to the summary (recovery.py)."""
    try:
        with open(SUMMARY) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {}
    summary["recovery_kill_to_first_step_seconds"] = recovery_seconds
    summary["recovery"] = detail
    if eviction:
        summary["straggler_eviction"] = eviction
    summary["spares_placed"] = spares or []
    summary["joins"] = joins or []
    os.makedirs(OUT, exist_ok=True)
    with open(SUMMARY, "w") as f:
        json.dump(summary, f, indent=1)


def print_summary():
    """The summary table of OUT/summary.json."""
    try:
        with open(SUMMARY) as f:
            s = json.load(f)
    except (OSError, ValueError):
        return
    rows = [("tokens/s (whole job)", s.get("tokens_per_second"), "{:.0f}"),
            ("MFU (mean over ranks, CPU GEMM peak)", s.get("mfu_mean_over_ranks"), "{:.3f}"),
            ("step time P50", s.get("step_seconds_p50"), "{:.3f} s"),
            ("step time P95", s.get("step_seconds_p95"), "{:.3f} s"),
            ("dp all-reduce P95 (slowest rank)", s.get("dp_all_reduce_seconds_p95_max_over_ranks"),
             "{:.4f} s"),
            ("time blocked by checkpoints", s.get("checkpoint_blocked_seconds_total"),
             "{:.3f} s in " + str(s.get("checkpoint_saves", 0)) + " saves"),
            ("recovery: SIGKILL -> first step", s.get("recovery_kill_to_first_step_seconds"),
             "{:.3f} s")]
    e = s.get("straggler_eviction")
    if e and "evicted_at_step" in e:
        rows.append((f"straggler: rank {e['rank']} evicted", e["ratio"],
                     "{:.2f}x the others' P95, " + f"{e['evicted_at_step'] - e['first_step']} "
                     f"steps after it turned slow, regroup {e['regroup_s']:.3f} s"))
    for sp in s.get("spares_placed") or []:
        for p in sp["placed"]:
            rows.append((f"spare: rank {p['spare']} took rank {p['failed']}'s place",
                         sp["first_step_s"], "first step at dp" + str(sp["dp"]) + " {:.3f} s "
                         "after the failure"))
    for j in s.get("joins") or []:
        what = f"dp{j['dp']} again" if j["grown"] else "as a spare"
        rows.append((f"rejoin: restarted rank(s) {j['joined']}", j["first_step_s"],
                     "joined " + what + ", admission + one step {:.3f} s"))
    print("\n== summary " + "=" * 50, flush=True)
    for name, value, fmt in rows:
        shown = fmt.format(value) if value is not None else "(not run)"
        print(f"  {name:40s} {shown}", flush=True)
    print(f"  (all figures in {SUMMARY})", flush=True)
