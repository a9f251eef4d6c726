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

How it is exchanged (``exchange``; "auto": "gather" below 1,024 ranks,
"histogram" from there): every ``every`` committed steps, at the start of
the next step.

- "gather": one all-gather over the world of ``every + 3`` float64 per rank
  (its job rank, its data-parallel replica, its compute times). Every rank
  then holds the same matrix and runs the same deterministic evaluation, so
  every rank takes the same decision without a further round.
- "histogram": one all-reduce of ``256 * every + 1`` float64 whatever the
  world's size: per step a histogram of the ranks' compute times (log bins
  9% wide), and how many ranks were stragglers at the last exchange. Each
  rank takes its own count out of the sum (the others' histogram), compares
  itself with the percentile read from it (the bin's upper edge, never below
  the exact value, so never a lower threshold than "gather"'s) and keeps its
  own streak. Only when some rank was a straggler does an all-gather of
  ``3 * window + 3`` float64 per rank name them (every rank again takes the
  same decision from the same records). A straggler is thus evicted one
  exchange later than with "gather".

Either way the eviction then goes through the recovery's agreement (a
planned change, the epoch's alarm) like any membership change.

The rule, per step and rank: slow when its compute time exceeds ``factor``
times the ``percentile`` (nearest rank) of the other ranks' compute times of
that step; a rank slow for ``window`` consecutive committed steps is a
straggler. A rank is never evicted below the threshold: one fast step
resets its count. ``action="report"`` only reports (rank 0 prints one line
per straggler); ``"evict"`` also evicts, unless that would drop every
data-parallel replica (then it reports why it did not).

Cost at scale, per rank and exchange: "gather" receives ``8 * (every + 3) *
world`` bytes (512 KiB at 16,384 ranks with ``every=1``) and sorts the world's
times; "histogram" all-reduces ``8 * (256 * every + 1)`` bytes (2 KiB with
``every=1``) at any size, plus the naming all-gather (``8 * (3 * window + 3)
* world`` bytes, 2.4 MB at 16,384 ranks) only in the exchanges that follow
one with a straggler (with ``action="report"``, each exchange while it stays
slow). With ``every`` > 1 an eviction comes up to ``every - 1`` steps later.
"""

import bisect
import dataclasses
import json
import math
import sys

from .errors import InvalidArgument

_ACTIONS = ("report", "evict")
_EXCHANGES = ("auto", "gather", "histogram")
# "auto" gathers every rank's times below this many ranks, else histograms.
GATHER_BELOW = 1024

# The histogram exchange's bins: bin 0 holds times <= _LO, bin i the times in
# (_LO * _R**(i-1), _LO * _R**i], the last one everything above: 10 us to
# 10 hours in bins 9% wide.
_LO, _R, _BINS = 1e-5, 2 ** 0.125, 256


def _bin(t):
    if t <= _LO:
        return 0
    return min(_BINS - 1, 1 + int(math.log(t / _LO) / math.log(_R)))


def _upper(i):
    return math.inf if i == _BINS - 1 else _LO * _R ** i


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
    exchange: str = "auto"

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
        if self.exchange not in _EXCHANGES:
            raise InvalidArgument(f"strata.elastic.StragglerPolicy.exchange must be one of "
                                  f"{', '.join(map(repr, _EXCHANGES))}, got {self.exchange!r}")


def percentile(values, q):
    """Nearest rank: the smallest value with at least q% of values at or below it."""
    v = sorted(values)
    if not v:
        return None
    return v[max(0, math.ceil(q / 100.0 * len(v)) - 1)]


def _percentile_of_others(ordered, t, q):
    """percentile() of `ordered` (sorted, holding t) less one copy of t,
    without building that list: O(log n)."""
    n = len(ordered) - 1
    if n < 1:
        return None
    k = max(0, math.ceil(q / 100.0 * n) - 1)
    return ordered[k] if k < bisect.bisect_left(ordered, t) else ordered[k + 1]


def histogram_percentile(counts, q):
    """The nearest-rank percentile of the times a histogram counts, as the
    upper edge of its bin: never below the exact value (so the rule's
    threshold is never lower than the exact rule's). None when empty."""
    n = sum(counts)
    if n <= 0:
        return None
    k, seen = max(1, math.ceil(q / 100.0 * n - 1e-9)), 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= k:
            return _upper(i)
    return math.inf


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
        self._candidate = False  # the histogram exchange: a straggler at the last one
        self.stragglers = []  # the last decision's, as dicts (also printed by rank 0)

    def reset(self):
        """After a membership change: ranks and their pace start afresh."""
        self._pending = []
        self._streak = {}
        self._reported = set()
        self._candidate = False
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
        """The exchange and the decision (collective over the world: every
        member calls it at the same step, since commits are agreed). Returns
        the stragglers to evict now: a list of dicts."""
        group = world.group("world")
        how = self.policy.exchange
        if how == "auto":
            how = "gather" if group.size < GATHER_BELOW else "histogram"
        replica, replicas = world.group("dp").rank, world.group("dp").size
        k = self.policy.every
        pending, self._pending = self._pending[-k:], []
        if how == "gather":
            row = [float(job_rank), float(replica), float(pending[0][0])]
            row += [math.nan if c is None else c for _, c in pending]
            rows = _all_gather(group, row)
            return self._decide(rows, replicas, world.rank == 0)
        # The histogram exchange: one all-reduce of a fixed size whatever
        # the world's (each step's histogram of compute times, and how many
        # ranks were stragglers at the last exchange); only when some rank
        # was does an all-gather name them.
        summed = _all_reduce(group, self.histograms(pending))
        self.apply_histograms(summed, pending, job_rank)
        if summed[-1] <= 0:
            self.stragglers = []
            self._reported.clear()  # nobody was a straggler: a new streak is news again
            return []
        rows = _all_gather(group, self.candidate_row(job_rank, replica))
        return self.conclude_candidates(rows, replicas, world.rank == 0)

    # -- the histogram exchange, in parts (tests run them without a world)
    def histograms(self, pending):
        """This rank's part of the all-reduce: per pending step a one-hot
        histogram of its compute time, then 1 if it was a straggler at the
        last exchange."""
        out = []
        for _, c in pending:
            h = [0.0] * _BINS
            if c is not None:
                h[_bin(c)] = 1.0
            out += h
        out.append(1.0 if self._candidate else 0.0)
        return out

    def apply_histograms(self, summed, pending, job_rank):
        """This rank's own streak from the summed histograms (less its own
        count: the others')."""
        p = self.policy
        for j, (step, c) in enumerate(pending):
            counts = summed[j * _BINS:(j + 1) * _BINS]
            ref = None
            if c is not None:
                counts = list(counts)
                counts[_bin(c)] -= 1.0
                ref = histogram_percentile(counts, p.percentile)
            if ref is not None and c > p.factor * ref:
                self._streak.setdefault(job_rank, []).append((step, c, ref))
            else:
                self._streak.pop(job_rank, None)
        self._candidate = len(self._streak.get(job_rank, [])) >= p.window

    def candidate_row(self, job_rank, replica):
        """This rank's record in the all-gather that names the stragglers:
        job rank, replica, streak length, then (step, time, reference) of its
        last `window` slow steps (NaN when shorter)."""
        w = self.policy.window
        streak = self._streak.get(job_rank, [])[-w:]
        row = [float(job_rank), float(replica), float(len(self._streak.get(job_rank, [])))]
        for i in range(w):
            row += list(streak[i]) if i < len(streak) else [math.nan] * 3
        return row

    def conclude_candidates(self, rows, replicas, print_it):
        w = self.policy.window
        found = []
        for row in rows:
            if row[2] >= w:
                last = [tuple(row[3 + 3 * i:6 + 3 * i]) for i in range(w)]
                found.append(_straggler(int(row[0]), [(int(s), t, ref) for s, t, ref in last]))
        replica_of = {int(r[0]): int(r[1]) for r in rows}
        self._reported -= {int(r[0]) for r in rows if r[2] < w}
        return self._conclude(found, replica_of, replicas, print_it)

    def _decide(self, rows, replicas, print_it):
        p = self.policy
        ranks = [int(r[0]) for r in rows]
        replica_of = {int(r[0]): int(r[1]) for r in rows}
        first = int(rows[0][2])
        for j in range(len(rows[0]) - 3):
            known = {ranks[i]: rows[i][3 + j] for i in range(len(rows))
                     if not math.isnan(rows[i][3 + j])}
            ordered = sorted(known.values())  # once per step, not once per rank
            for r in ranks:
                t = known.get(r)
                ref = _percentile_of_others(ordered, t, p.percentile) if t is not None else None
                if ref is not None and t > p.factor * ref:
                    self._streak.setdefault(r, []).append((first + j, t, ref))
                else:
                    self._streak.pop(r, None)
                    self._reported.discard(r)
        found = [_straggler(r, self._streak[r][-p.window:]) for r in ranks
                 if len(self._streak.get(r, [])) >= p.window]
        return self._conclude(found, replica_of, replicas, print_it)

    def _conclude(self, found, replica_of, replicas, print_it):
        """What to do about the stragglers found (the same on every rank)."""
        p = self.policy
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


def _straggler(rank, last):
    """A straggler's record from its last slow steps [(step, time, reference)]."""
    return {"rank": rank, "steps": [s for s, _, _ in last],
            "compute_s": [round(t, 6) for _, t, _ in last],
            "others_percentile_s": [round(ref, 6) for _, _, ref in last],
            "ratio": round(min(t / ref for _, t, ref in last), 3)}


def _device(group):
    return "cuda" if group.memory == "cuda" else "cpu"


def _all_gather(group, row):
    import torch

    mine = torch.tensor(row, dtype=torch.float64, device=_device(group))
    every = torch.empty(group.size * len(row), dtype=torch.float64, device=_device(group))
    group.all_gather(every, mine)
    return every.view(group.size, len(row)).cpu().tolist()


def _all_reduce(group, values):
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=_device(group))
    group.all_reduce(t)
    return t.cpu().tolist()


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
