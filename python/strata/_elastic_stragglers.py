"""The straggler policy of strata.elastic: a rank that is alive but slow is
found from measurements every rank already makes, and evicted like a failed
rank (or reported), by a decision every rank takes from the same numbers.

What is measured: each committed step's compute time on every rank, that is
its step time (strata.metrics' step marker, which :func:`strata.elastic.run`
puts around every step) minus the time it was blocked in ``Work::Wait``
(the same figure as ``strata_collective_wait_seconds_total``) and minus its
wait for the step commit's vote. A slow rank makes every other rank wait in
the collectives that follow, so step time alone would name everybody;
compute time names the slow rank. Nothing is measured twice: the figures are
the metrics layer's.

How it is exchanged: every ``every`` committed steps, one all-gather over the
world of ``every + 3`` float64 per rank (its job rank, its data-parallel
replica, and its compute times of those steps). Every rank then holds the
same matrix and runs the same deterministic evaluation, so every rank takes
the same decision without a further round; the eviction itself then goes
through the recovery's agreement (a planned change, the epoch's alarm) like
any membership change.

The rule, per step and rank: slow when its compute time exceeds ``factor``
times the ``percentile`` (nearest rank) of the other ranks' compute times of
that step; a rank slow for ``window`` consecutive committed steps is a
straggler. A rank is never evicted below the threshold: one fast step
resets its count. ``action="report"`` only reports (rank 0 prints one line
per straggler); ``"evict"`` also evicts, unless that would drop every
data-parallel replica (then it reports why it did not).

Cost at scale: the all-gather moves ``8 * (every + 3)`` bytes per rank, so
``8 * (every + 3) * world`` bytes arrive at each rank: 64 KiB per step at
16,384 ranks with ``every=1`` (a 1B-parameter model's gradient all-reduce
moves 4 GB), or 26 KiB per step with ``every=5``; the evaluation is one sort
of the world's values per step gathered (about 2 ms in Python at 16,384
ranks). With ``every`` > 1 an eviction comes up to ``every - 1`` steps
later.
"""

import dataclasses
import json
import math
import sys

from .errors import InvalidArgument

_ACTIONS = ("report", "evict")


@dataclasses.dataclass
class StragglerPolicy:
    """When a rank counts as a straggler and what is done about it (see the
    module :mod:`strata.elastic`; defaults: compute time > 2x the P95 of the
    other ranks' for 5 consecutive steps, evicted)."""

    factor: float = 2.0
    percentile: float = 95.0
    window: int = 5
    action: str = "evict"
    every: int = 1

    def _validate(self):
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 1:
            raise InvalidArgument(f"strata.elastic.StragglerPolicy.factor must be a number > 1, "
                                  f"got {f!r}")
        q = self.percentile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 100:
            raise InvalidArgument(f"strata.elastic.StragglerPolicy.percentile must be in (0, 100], "
                                  f"got {q!r}")
        for name in ("window", "every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"strata.elastic.StragglerPolicy.{name} must be an int >= 1, "
                                      f"got {v!r}")
        if self.action not in _ACTIONS:
            raise InvalidArgument(f"strata.elastic.StragglerPolicy.action must be one of "
                                  f"{', '.join(map(repr, _ACTIONS))}, got {self.action!r}")


def percentile(values, q):
    """Nearest rank: the smallest value with at least q% of values at or below it."""
    v = sorted(values)
    if not v:
        return None
    return v[max(0, math.ceil(q / 100.0 * len(v)) - 1)]


class Watch:
    """The policy's state on one rank: the compute times of the steps since
    the last exchange, and every member's streak of slow steps (the same on
    every rank). Driven by :class:`strata.elastic.Controller`."""

    def __init__(self, policy, metrics):
        if metrics is None:
            raise InvalidArgument(
                "strata.elastic: the straggler policy needs the world's metrics (it reuses their "
                "measurement of compute time and collective wait); this world was made with "
                "strata.init(metrics=False)")
        self.policy = policy
        self._metrics = metrics
        self._seen = metrics._steps  # steps the metrics recorded when last looked at
        self._pending = []  # this rank's compute times (None: not measured) since the exchange
        self._streak = {}  # job rank -> [(step, compute, others' percentile), ...] slow in a row
        self._reported = set()
        self.stragglers = []  # the last decision's, as dicts (also printed by rank 0)

    def reset(self):
        """After a membership change: ranks and their pace start afresh."""
        self._pending = []
        self._streak = {}
        self._reported = set()
        self._seen = self._metrics._steps

    def record(self, step, commit_wait):
        """A committed step: its compute time, from the metrics' step marker
        (None when the step was not marked: a hand-written loop without one)."""
        m = self._metrics
        compute = None
        if m._steps != self._seen and m.last_step is not None:
            seconds, wait = m.last_step
            compute = max(0.0, seconds - wait - commit_wait)
        self._seen = m._steps
        self._pending.append((step, compute))

    def due(self):
        return len(self._pending) >= self.policy.every

    def exchange(self, world, job_rank):
        """The all-gather and the decision (collective over the world: every
        member calls it at the same step, since commits are agreed). Returns
        the stragglers to evict now: a list of dicts."""
        import torch

        k = self.policy.every
        pending, self._pending = self._pending[-k:], []
        group = world.group("world")
        device = "cuda" if group.memory == "cuda" else "cpu"
        row = [float(job_rank), float(world.group("dp").rank), float(pending[0][0])]
        row += [math.nan if c is None else c for _, c in pending]
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        every = torch.empty(group.size * len(row), dtype=torch.float64, device=device)
        group.all_gather(every, mine)
        rows = every.view(group.size, len(row)).cpu().tolist()
        return self._decide(rows, world.group("dp").size, world.rank == 0)

    def _decide(self, rows, replicas, print_it):
        p = self.policy
        ranks = [int(r[0]) for r in rows]
        replica_of = {int(r[0]): int(r[1]) for r in rows}
        first = int(rows[0][2])
        for j in range(len(rows[0]) - 3):
            times = {ranks[i]: rows[i][3 + j] for i in range(len(rows))}
            known = {r: t for r, t in times.items() if not math.isnan(t)}
            for r in ranks:
                t = known.get(r)
                others = [u for o, u in known.items() if o != r]
                ref = percentile(others, p.percentile) if others else None
                if t is not None and ref is not None and t > p.factor * ref:
                    self._streak.setdefault(r, []).append((first + j, t, ref))
                else:
                    self._streak.pop(r, None)
                    self._reported.discard(r)
        found = []
        for r in ranks:
            streak = self._streak.get(r, [])
            if len(streak) >= p.window:
                last = streak[-p.window:]
                found.append({"rank": r, "steps": [s for s, _, _ in last],
                              "compute_s": [round(t, 6) for _, t, _ in last],
                              "others_percentile_s": [round(ref, 6) for _, _, ref in last],
                              "ratio": round(min(t / ref for _, t, ref in last), 3)})
        self.stragglers = found
        new = [x for x in found if x["rank"] not in self._reported]
        self._reported.update(x["rank"] for x in found)
        evict = []
        if p.action == "evict" and found:
            dropped = {replica_of[x["rank"]] for x in found}
            if len(dropped) < replicas:
                evict = found
            elif print_it and new:
                print(f"strata.elastic: not evicting straggler(s) {[x['rank'] for x in found]}: "
                      f"that would drop all {replicas} data-parallel replica(s)", file=sys.stderr,
                      flush=True)
        if print_it:
            for x in (evict if evict else new):
                print(json.dumps({"event": "eviction" if evict else "straggler",
                                  "rank": x["rank"], "reason": "straggler",
                                  "ratio": x["ratio"], "steps": len(x["steps"]),
                                  "first_step": x["steps"][0], "last_step": x["steps"][-1],
                                  "compute_s": x["compute_s"],
                                  "others_percentile_s": x["others_percentile_s"],
                                  "factor": p.factor, "percentile": p.percentile}), flush=True)
        return evict


def why(found, policy):
    """The text of an eviction's cause (it reaches the evicted rank's exit
    message and the recovery event): each rank's measured times."""
    parts = []
    for x in found:
        ms = ", ".join(f"{t * 1e3:.1f}" for t in x["compute_s"])
        ref = ", ".join(f"{t * 1e3:.1f}" for t in x["others_percentile_s"])
        parts.append(f"rank {x['rank']}'s compute time over steps {x['steps'][0]}-"
                     f"{x['steps'][-1]} was [{ms}] ms against a P{policy.percentile:g} of the "
                     f"others of [{ref}] ms, at least {x['ratio']:g}x")
    return (f"straggler: {'; '.join(parts)} (threshold {policy.factor:g}x for "
            f"{policy.window} consecutive steps)")
