"""strata.timeline: a Chrome trace / Perfetto timeline of selected steps.

Each rank records spans of the steps it is asked to record and writes them
as Chrome trace JSON (``{"traceEvents": [...]}``: complete events with ``ts``
and ``dur`` in whole microseconds, one process per rank, one thread per lane),
which Perfetto (ui.perfetto.dev) and chrome://tracing open::

    world = strata.init(mesh)
    tl = strata.timeline.Timeline("out/timeline", world=world, steps=range(10, 13))
    for step in range(100):
        with tl.step(step):
            with tl.span("forward"):
                loss = model(x).sum()
            with tl.span("backward"):
                loss.backward()
            optimizer.step()
    tl.write()                      # out/timeline/timeline_rank_<r>.json
    # once every rank wrote:  python -m strata.timeline out/timeline
    #                         -> out/timeline/timeline.json (all ranks)

Lanes (threads of a rank's process in the viewer):

- ``compute``: the step itself and the spans the user marks; strata's
  pipeline schedules add each forward / backward (and weight-gradient)
  action per microbatch when the world has a timeline.
- ``comm <group>`` (``comm <group> send`` / ``recv`` for point-to-point):
  every collective and point-to-point operation of the world's groups that
  ran during a recorded step, from the world's flight
  recorder (so the timeline measures nothing twice: the recorder is on by
  default); from when the backend started it to when it completed.
  Operations of one group that overlap in time (a bucket's all-reduce
  launched while the previous one runs) go to ``comm <group> #2`` and so
  on, so that every lane nests properly.
- ``checkpoint``: the time ``save()`` blocked (staging); ``checkpoint io``:
  writing and committing in the background, placed from the checkpointer's
  durations starting when ``save()`` returned.
- ``recovery``: each recovery of ``strata.elastic.run`` (always recorded,
  selected step or not), with its phases detect, agree, rebuild and
  restore, from the times the recovery event carries.

The file also names the rank's host and pid. Timestamps are the system's
wall clock (``time.time_ns()``), so ranks of one host share one time axis;
across hosts they are as close as the hosts' clocks are.
"""

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time

from ._settings import settings as _settings
from .errors import CommError, InvalidArgument

__all__ = ["Timeline", "merge", "check_nesting"]

_FILE = "timeline_rank_{rank}.json"
_MERGED = "timeline.json"
_ACTION = re.compile(r"(\d+)([FBWI])(\d+)")
_ACTION_NAMES = {"F": "forward", "B": "backward", "W": "weight grad", "I": "input grad"}


class Timeline:
    """Records spans of the selected ``steps`` (an iterable of step
    numbers; None: every step) of this rank and writes them to
    ``directory`` (default: ``$STRATA_TIMELINE_DIR``). With ``world``, the
    world's collectives are taken from its flight recorder and strata's
    own loops (pipeline schedules, ``strata.elastic.run``, checkpoints)
    record into this timeline (``world.timeline``). ``max_events`` bounds
    the memory: spans past it are counted, not kept."""

    def __init__(self, directory=None, *, world=None, steps=None, rank=None,
                 max_events=200_000):
        if directory is None:
            directory = _settings()["STRATA_TIMELINE_DIR"].value or None
        if not directory:
            raise InvalidArgument("strata.timeline.Timeline needs a directory (or "
                                  "STRATA_TIMELINE_DIR)")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise InvalidArgument(f"max_events must be an int >= 1, got {max_events!r}")
        if steps is not None:
            try:
                steps = frozenset(steps)
            except TypeError:
                raise InvalidArgument(f"steps must be an iterable of step numbers or None, got "
                                      f"{type(steps).__name__}") from None
            bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
            if bad:
                raise InvalidArgument(f"steps must be ints >= 0; got {sorted(map(repr, bad))[:3]}")
        self.directory = str(directory)
        self.steps = steps
        self.max_events = max_events
        self.world = world
        if rank is None:
            rank = world.rank if world is not None else int(os.environ.get("RANK", "0"))
        self.rank = int(rank)
        self.dropped = 0
        self._events = []
        self._lanes = {}
        self._lock = threading.Lock()
        self._step = None
        self._pending_checkpoints = {}
        if world is not None:
            world.timeline = self

    # ---- what is recorded ----------------------------------------------------
    def selected(self, step):
        """Whether ``step`` is one of the steps to record."""
        return self.steps is None or step in self.steps

    @property
    def recording(self):
        """True inside a recorded step (always when every step is recorded)."""
        return self.steps is None or self._step is not None

    @contextlib.contextmanager
    def step(self, step):
        """Marks one training step; records it, its spans and the world's
        operations during it when ``step`` is selected. Inside another
        step() (a user's marker in a loop of strata's that marks its steps
        itself) it records nothing more: the step is recorded once."""
        if not self.selected(step) or self._step is not None:
            yield
            return
        outer, self._step = self._step, step
        t0 = time.time_ns()
        failed = True
        try:
            yield
            failed = False
        finally:
            t1 = time.time_ns()
            args = {"step": step}
            if failed:
                args["failed"] = True
            self.add(f"step {step}", t0, t1, lane="compute", cat="step", args=args)
            self._take_operations(t0, t1)
            self._step = outer

    @contextlib.contextmanager
    def span(self, name, *, lane="compute", cat="compute", **args):
        """A span of this rank's work (forward, backward, data loading...),
        recorded while a selected step runs. Spans of one lane must nest
        (``with`` blocks do)."""
        if not self.recording:
            yield
            return
        t0 = time.time_ns()
        try:
            yield
        finally:
            self.add(str(name), t0, time.time_ns(), lane=lane, cat=cat, args=args or None)

    def add(self, name, start_ns, end_ns, *, lane="compute", cat="compute", args=None):
        """Adds one span [start_ns, end_ns] (``time.time_ns()`` clock)."""
        # Whole microseconds, each end rounded on its own: rounding is
        # monotonic, so spans that nest or follow each other still do
        # (a float of today's time in microseconds has no exact fraction).
        start_us = (int(start_ns) + 500) // 1000
        end_us = max((int(end_ns) + 500) // 1000, start_us)
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                 "tid": self._lane(lane), "ts": start_us, "dur": end_us - start_us}
        if args:
            event["args"] = args
        with self._lock:
            if len(self._events) >= self.max_events:
                self.dropped += 1
                return
            self._events.append(event)

    def _lane(self, lane):
        with self._lock:
            tid = self._lanes.get(lane)
            if tid is None:
                tid = self._lanes[lane] = len(self._lanes) + 1
            return tid

    # ---- what strata's own layers add ---------------------------------------
    def _take_operations(self, t0, t1):
        raw = getattr(self.world, "_raw", None)
        if raw is None or not getattr(raw, "alive", False):
            return
        try:
            ops = raw.recorded_ops(t0)  # [] when the world keeps no flight recorder
        except CommError:  # destroyed since the check above: no operations
            return
        spans = []
        for op in ops:
            start = op["started_ns"] or op["created_ns"]
            done = op["state"] == "completed"
            end = op["completed_ns"] if done else t1
            if start > t1 or end < t0:
                continue
            name = op["op"] if done else f"{op['op']} (not completed)"
            args = {"group": op["group"], "backend": op["backend"], "seq": op["seq"],
                    "bytes": op["bytes"]}
            if op["peer"] >= 0:
                args["peer"] = op["peer"]
            if op["started_ns"] and op["created_ns"]:
                args["queued_us"] = (op["started_ns"] - op["created_ns"]) / 1000.0
            if done and not op["ok"]:
                args["error"] = True
            lane = op["group"] + (f" {op['op']}" if op["op"] in ("send", "recv") else "")
            spans.append((start, end, lane, name, args))
        # Operations of one lane that overlap go to further lanes.
        lane_ends = {}
        for start, end, group, name, args in sorted(spans, key=lambda s: (s[0], -s[1])):
            ends = lane_ends.setdefault(group, [])
            k = next((i for i, e in enumerate(ends) if e <= start), None)
            if k is None:
                ends.append(end)
                k = len(ends) - 1
            else:
                ends[k] = end
            lane = f"comm {group}" + (f" #{k + 1}" if k else "")
            self.add(name, start, end, lane=lane, cat="comm", args=args)

    def _pipeline_step(self, stats, schedule_name):
        """Each compute action of one pipeline step (StepStats.timings)."""
        if not self.recording or stats is None:
            return
        base = stats.start_time
        for token, start, end in stats.timings:
            m = _ACTION.fullmatch(token)
            if m is None:
                continue
            stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3))
            self.add(f"{kind}{mb}", int((base + start) * 1e9), int((base + end) * 1e9),
                     cat="pipeline", args={"action": _ACTION_NAMES[kind], "microbatch": mb,
                                           "stage": stage, "schedule": schedule_name})

    def _checkpoint_staged(self, step, t0_ns, t1_ns):
        if not self.recording:
            return
        self.add(f"checkpoint staging (step {step})", t0_ns, t1_ns, lane="checkpoint",
                 cat="checkpoint", args={"step": step})
        self._pending_checkpoints[step] = t1_ns

    def _checkpoint_written(self, step, write_seconds, commit_seconds):
        t1 = self._pending_checkpoints.pop(step, None)
        if t1 is None:
            return
        w = int(write_seconds * 1e9)
        c = int(commit_seconds * 1e9)
        self.add(f"checkpoint write (step {step})", t1, t1 + w, lane="checkpoint io",
                 cat="checkpoint", args={"step": step})
        self.add(f"checkpoint commit (step {step})", t1 + w, t1 + w + c, lane="checkpoint io",
                 cat="checkpoint", args={"step": step})

    def _recovery(self, event):
        """The phases of one recovery event of strata.elastic (times in
        seconds since the epoch)."""
        cause = event.get("cause") or {}
        marks = [cause.get("failed_at"), event.get("known_by_all_at"), event.get("decided_at"),
                 event.get("rebuilt_at"), event.get("restored_at")]
        if any(m is None for m in marks):
            return
        ns, last = [], None
        for m in marks:  # clamp: phases follow each other
            v = int(m * 1e9)
            last = v if last is None else max(v, last)
            ns.append(last)
        epoch = event.get("epoch")
        args = {"epoch": epoch, "failed": event.get("failed"),
                "mesh_after": (event.get("mesh_after") or {}).get("describe"),
                "cause": cause.get("detail")}
        self.add(f"recovery (epoch {epoch})", ns[0], ns[4], lane="recovery", cat="recovery",
                 args=args)
        for name, a, b in (("detect", ns[0], ns[1]), ("agree", ns[1], ns[2]),
                           ("rebuild", ns[2], ns[3]), ("restore", ns[3], ns[4])):
            self.add(name, a, b, lane="recovery", cat="recovery")

    # ---- output -------------------------------------------------------------
    def trace(self):
        """This rank's trace as a dict (Chrome trace JSON)."""
        host = socket.gethostname()
        with self._lock:
            events = list(self._events)
            lanes = dict(self._lanes)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank} ({host}, pid {os.getpid()})"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        for lane, tid in lanes.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"name": lane}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"sort_index": tid}})
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"strata_rank": self.rank, "host": host, "pid": os.getpid(),
                              "steps": None if self.steps is None else sorted(self.steps),
                              "dropped_events": self.dropped}}

    def write(self):
        """Writes this rank's file (atomically) and returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, _FILE.format(rank=self.rank))
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.trace(), f)
        os.replace(tmp, path)
        return path

    def close(self):
        """Writes the file and detaches from the world."""
        path = self.write()
        if self.world is not None and getattr(self.world, "timeline", None) is self:
            self.world.timeline = None
        return path

    def __repr__(self):
        steps = "all" if self.steps is None else len(self.steps)
        return (f"Timeline(rank={self.rank}, steps={steps}, events={len(self._events)}, "
                f"directory={self.directory!r})")


def merge(directory, out=None):
    """Merges every rank's file in ``directory`` into one trace (written to
    ``out``, default ``directory/timeline.json``); returns (path, ranks)."""
    names = sorted(n for n in os.listdir(directory)
                   if re.fullmatch(r"timeline_rank_\d+\.json", n))
    if not names:
        raise InvalidArgument(f"no timeline_rank_<r>.json files in {directory}")
    events, ranks, other = [], [], {}
    for n in names:
        with open(os.path.join(directory, n)) as f:
            t = json.load(f)
        events.extend(t["traceEvents"])
        rank = t.get("otherData", {}).get("strata_rank")
        ranks.append(rank)
        other[str(rank)] = t.get("otherData", {})
    out = out or os.path.join(directory, _MERGED)
    tmp = f"{out}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"ranks": other}}, f)
    os.replace(tmp, out)
    return out, sorted(r for r in ranks if r is not None)


def check_nesting(trace):
    """Problems of a Chrome trace's complete events: negative durations and
    spans of one lane that overlap without nesting. Empty when valid."""
    lanes = {}
    problems = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e["dur"] < 0:
            problems.append(f"{e['name']} (pid {e['pid']}, tid {e['tid']}): negative duration")
        lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    for (pid, tid), evs in lanes.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                problems.append(f"pid {pid} tid {tid}: '{e['name']}' at {e['ts']:.3f} us overlaps "
                                f"'{stack[-1]['name']}' without nesting in it")
            stack.append(e)
    return problems


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m strata.timeline",
                                description="Merges the timeline_rank_<r>.json files of DIR into "
                                            "one Chrome trace / Perfetto JSON.")
    p.add_argument("directory")
    p.add_argument("-o", "--out", help="the merged file (default DIR/timeline.json)")
    a = p.parse_args(argv)
    try:
        path, ranks = merge(a.directory, a.out)
    except (InvalidArgument, OSError, ValueError) as e:
        print(f"strata.timeline: {e}", file=sys.stderr)
        return 1
    print(f"{path}: {len(ranks)} rank(s) merged; open it in ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
