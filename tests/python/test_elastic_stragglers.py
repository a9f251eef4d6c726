"""The straggler policy's decision (strata.elastic.StragglerPolicy) in one
process: the rule (compute time > factor x the percentile of the others',
for `window` consecutive steps), its streaks across exchanges, what it does
not evict, and its options' errors. The same decision on real jobs, with
ranks slowed by sleeps and from outside: test_elastic_stragglers_jobs.py."""

import math

import pytest

import strata
import strata.elastic as elastic
from strata import _elastic_stragglers as S


class FakeMetrics:
    """What the Watch reads of strata.metrics.Metrics."""

    def __init__(self):
        self._steps = 0
        self.last_step = None

    def step(self, seconds, wait):
        self._steps += 1
        self.last_step = (seconds, wait)


def watch(**policy):
    return S.Watch(elastic.StragglerPolicy(**policy), FakeMetrics())


def rows(first_step, per_rank, replicas=None):
    """The gathered matrix: per_rank[r] is rank r's compute times."""
    out = []
    for r, times in enumerate(per_rank):
        replica = r if replicas is None else replicas[r]
        out.append([float(r), float(replica), float(first_step)] + [float(t) for t in times])
    return out


def feed(w, steps, slow, base=0.05, ranks=4, replicas=None, first=0):
    """`steps` exchanges of one step each; slow: {rank: factor or
    callable(step) -> factor}. Returns the step of the first decision that
    evicts (and the stragglers), or (None, [])."""
    for s in range(first, first + steps):
        times = []
        for r in range(ranks):
            f = slow.get(r, 1.0)
            f = f(s) if callable(f) else f
            times.append([base * f])
        found = w._decide(rows(s, times, replicas), ranks if replicas is None else
                          len(set(replicas)), False)
        if found:
            return s, found
    return None, []


def test_a_rank_at_3x_is_evicted_after_exactly_the_window():
    w = watch()
    onset = 7
    step, found = feed(w, 30, {2: lambda s: 3.0 if s >= onset else 1.0})
    assert step == onset + 4  # the 5th slow step: evicted before the next one runs
    assert [x["rank"] for x in found] == [2]
    x = found[0]
    assert x["steps"] == list(range(onset, onset + 5))
    assert x["ratio"] == pytest.approx(3.0)
    assert x["compute_s"] == [0.15] * 5 and x["others_percentile_s"] == [0.05] * 5


@pytest.mark.parametrize("factor", [10.0, 2.01])
def test_above_the_threshold_is_evicted(factor):
    step, found = feed(watch(), 20, {1: factor})
    assert step == 4 and [x["rank"] for x in found] == [1]


@pytest.mark.parametrize("factor", [1.5, 2.0])
def test_never_evicted_at_or_below_the_threshold(factor):
    step, found = feed(watch(), 50, {1: factor})
    assert step is None and found == []


def test_slow_for_one_step_less_than_the_window_then_fast_is_not_evicted():
    w = watch()
    # Slow at 10x for 4 steps, fast for one, slow for 4 again: never 5 in a row.
    step, _ = feed(w, 39, {3: lambda s: 10.0 if s % 5 != 4 else 1.0})  # steps 0-38
    assert step is None
    # The streak restarted after the fast step: one more slow step is not enough.
    assert len(w._streak.get(3, [])) == 4


def test_two_slow_ranks_with_the_median_and_masked_by_the_p95_in_a_small_job():
    # With 4 ranks, the P95 (nearest rank) of a rank's 3 others is their
    # max: a second slow rank hides the first. The percentile is an option.
    step, found = feed(watch(), 20, {1: 3.0, 3: 3.0})
    assert step is None
    step, found = feed(watch(percentile=50), 20, {1: 3.0, 3: 3.0})
    assert step == 4 and sorted(x["rank"] for x in found) == [1, 3]
    # With 64 ranks, P95 of the others leaves room for 3 slow ranks.
    step, found = feed(watch(), 20, {5: 3.0, 40: 4.0, 63: 10.0}, ranks=64)
    assert step == 4 and sorted(x["rank"] for x in found) == [5, 40, 63]


def test_not_evicted_when_that_would_drop_every_replica(capsys):
    # dp2 x tp2: ranks 0,1 are replica 0, ranks 2,3 replica 1; one slow
    # rank in each replica.
    replicas = [0, 0, 1, 1]
    w = watch(percentile=50)
    for s in range(10):
        found = w._decide(rows(s, [[0.05], [0.15], [0.05], [0.15]], replicas), 2, True)
        assert found == []
    out = capsys.readouterr()
    assert "not evicting straggler(s) [1, 3]: that would drop all 2 data-parallel replica(s)" \
        in out.err
    # Reported once per streak, as a "straggler" line, not as an eviction.
    assert out.out.count('"event": "straggler"') == 2 and '"eviction"' not in out.out


def test_report_only_prints_and_never_evicts(capsys):
    w = watch(action="report")
    for s in range(12):
        found = w._decide(rows(s, [[0.05], [0.05], [0.3], [0.05]]), 4, True)
        assert found == []
    assert [x["rank"] for x in w.stragglers] == [2]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert len(lines) == 1 and '"event": "straggler"' in lines[0] and '"rank": 2' in lines[0]


def test_exchanges_of_several_steps_keep_one_streak():
    # every=3: each exchange carries 3 steps per rank; the streak runs
    # across exchanges, the decision comes at the exchange after the 5th.
    w = watch(every=3)
    slow = [0.05, 0.05, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15]
    found = []
    for k in range(3):
        part = slow[3 * k:3 * k + 3]
        found = w._decide(rows(3 * k, [[0.05] * 3, part, [0.05] * 3, [0.05] * 3]), 4, False)
        if found:
            break
    # Slow from step 2, the 5th slow step is 6; the exchange that carries
    # it (steps 6-8) decides, naming the last 5 slow steps.
    assert k == 2 and found[0]["rank"] == 1 and found[0]["steps"] == [4, 5, 6, 7, 8]


def test_unmeasured_steps_count_as_not_slow():
    # Slow in steps 0-2, unmeasured in step 3 (NaN: a step not marked),
    # slow from step 4: the streak that counts starts at 4.
    w = watch()
    decided = [s for s in range(10)
               if w._decide(rows(s, [[0.05], [math.nan if s == 3 else 0.5], [0.05], [0.05]]),
                            4, False)]
    assert decided == [8, 9]  # 4..8 is the first streak of 5 after the gap


def test_record_takes_compute_from_the_metrics_step_minus_waits():
    w = watch()
    m = w._metrics
    m.step(0.200, 0.050)  # a step of 200 ms, 50 ms of it blocked in Work::Wait
    w.record(0, commit_wait=0.010)
    w.record(1, commit_wait=0.0)  # no step marked since: not measured
    assert w._pending == [(0, pytest.approx(0.140)), (1, None)]
    assert w.due()
    w.reset()
    assert w._pending == [] and not w.due()


def test_why_names_the_measured_times():
    found = [{"rank": 3, "steps": [4, 5, 6, 7, 8], "compute_s": [0.15, 0.16, 0.15, 0.15, 0.15],
              "others_percentile_s": [0.05] * 5, "ratio": 3.0}]
    text = S.why(found, elastic.StragglerPolicy())
    assert text == ("straggler: rank 3's compute time over steps 4-8 was [150.0, 160.0, 150.0, "
                    "150.0, 150.0] ms against a P95 of the others of [50.0, 50.0, 50.0, 50.0, "
                    "50.0] ms, at least 3x (threshold 2x for 5 consecutive steps)")


@pytest.mark.parametrize("field,value,message", [
    ("factor", 1.0, "factor must be a number > 1, got 1.0"),
    ("factor", "2", "factor must be a number > 1"),
    ("percentile", 0, r"percentile must be in \(0, 100\], got 0"),
    ("percentile", 101, r"percentile must be in \(0, 100\], got 101"),
    ("window", 0, "window must be an int >= 1, got 0"),
    ("every", 2.5, "every must be an int >= 1, got 2.5"),
    ("action", "replace", "action must be one of 'report', 'evict', got 'replace'"),
    ("exchange", "tree", "exchange must be one of 'auto', 'gather', 'histogram', got 'tree'"),
])
def test_policy_errors_name_the_value(field, value, message):
    policy = elastic.StragglerPolicy(**{field: value})
    with pytest.raises(strata.InvalidArgument, match=message):
        elastic.Options(straggler=policy)._validate()


def test_options_want_a_policy_and_the_policy_wants_metrics():
    with pytest.raises(strata.InvalidArgument, match="straggler must be a "
                       "strata.elastic.StragglerPolicy or None, got dict"):
        elastic.Options(straggler={"factor": 3})._validate()
    with pytest.raises(strata.InvalidArgument, match=r"needs the world's metrics .* "
                       r"strata.init\(metrics=False\)"):
        S.Watch(elastic.StragglerPolicy(), None)


# ---- the histogram exchange (large worlds) ----------------------------------------


def run_histogram(n, steps, slow, base=0.05, replicas=None, **policy):
    """The histogram exchange of n ranks, simulated: the all-reduce is a sum
    of every rank's vector, the all-gather a list of every rank's row.
    Returns the step of the first eviction decision and what every rank
    decided then."""
    ws = [watch(exchange="histogram", **policy) for _ in range(n)]
    replicas = replicas or list(range(n))
    for s in range(steps):
        pending = []
        for r in range(n):
            f = slow.get(r, 1.0)
            f = f(s) if callable(f) else f
            pending.append([(s, base * f)])
        vectors = [w.histograms(pending[r]) for r, w in enumerate(ws)]
        summed = [sum(col) for col in zip(*vectors)]
        for r, w in enumerate(ws):
            w.apply_histograms(summed, pending[r], r)
        if summed[-1] > 0:
            rows = [w.candidate_row(r, replicas[r]) for r, w in enumerate(ws)]
            decisions = [w.conclude_candidates(rows, len(set(replicas)), False) for w in ws]
            assert all(d == decisions[0] for d in decisions)  # the same on every rank
            if decisions[0]:
                return s, decisions[0]
    return None, []


def test_the_histogram_exchange_evicts_one_exchange_later_than_the_gather():
    onset = 7
    step, found = run_histogram(8, 30, {5: lambda s: 3.0 if s >= onset else 1.0})
    # The 5th slow step is onset + 4; the exchange after it names the rank.
    assert step == onset + 5 and [x["rank"] for x in found] == [5]
    x = found[0]
    assert x["steps"] == list(range(onset + 1, onset + 6))  # its last 5 slow steps
    # The reference is the bin's upper edge: at least the exact P95 (0.05),
    # under 9% above it.
    for ref in x["others_percentile_s"]:
        assert 0.05 <= ref < 0.05 * 1.091
    assert 3.0 / 1.091 < x["ratio"] <= 3.0


@pytest.mark.parametrize("factor,evicted", [(1.5, False), (2.0, False), (2.3, True), (10.0, True)])
def test_the_histogram_exchange_keeps_the_threshold(factor, evicted):
    # Never below the threshold (the percentile is rounded up to its bin's
    # edge, never down); 2.3x is clear of a 9% bin.
    step, found = run_histogram(6, 20, {2: factor})
    assert (step is not None) == evicted, (step, found)


def test_the_histogram_exchange_a_blip_of_four_steps_and_two_stragglers():
    step, _ = run_histogram(8, 40, {3: lambda s: 10.0 if s % 5 != 4 else 1.0})
    assert step is None
    step, found = run_histogram(64, 20, {5: 3.0, 40: 4.0, 63: 10.0})
    assert step == 5 and sorted(x["rank"] for x in found) == [5, 40, 63]
    step, found = run_histogram(4, 20, {1: 3.0, 3: 3.0}, percentile=50)
    assert step == 5 and sorted(x["rank"] for x in found) == [1, 3]


def test_histogram_percentile_is_the_upper_edge_of_the_nearest_rank_bin():
    counts = [0.0] * S._BINS
    for t in (0.010, 0.011, 0.012, 0.050):
        counts[S._bin(t)] += 1
    assert 0.050 <= S.histogram_percentile(counts, 95) < 0.050 * 1.091
    assert 0.011 <= S.histogram_percentile(counts, 50) < 0.011 * 1.091
    assert S.histogram_percentile([0.0] * S._BINS, 95) is None
    assert S._bin(1e-7) == 0 and S._bin(1e9) == S._BINS - 1
    assert S._upper(S._BINS - 1) == math.inf


def test_evictions_are_counted_with_the_reason_straggler():
    calls = []

    class M:
        def record_recovery(self):
            calls.append("recovery")

        def record_eviction(self, reason):
            calls.append(reason)

    elastic._record_recovery(M(), {"failed": [1, 3], "reason": "straggler",
                                   "cause": {"source": "request"}})
    elastic._record_recovery(M(), {"failed": [5], "cause": {"source": "heartbeat"}})
    assert calls == ["recovery", "straggler", "straggler", "recovery", "heartbeat"]


def test_the_histogram_exchange_reports_a_new_streak_again(capsys):
    # action="report": a straggler is reported once per streak, also when
    # its streak ended and a new one began (the histogram path learns of
    # the end only through the exchanges).
    ws = [watch(exchange="histogram", action="report") for _ in range(4)]
    slow = lambda s: 3.0 if s < 8 or s >= 12 else 1.0  # noqa: E731
    for s in range(24):
        pending = [[(s, 0.05 * (slow(s) if r == 2 else 1.0))] for r in range(4)]
        summed = [sum(c) for c in zip(*[w.histograms(pending[r]) for r, w in enumerate(ws)])]
        for r, w in enumerate(ws):
            w.apply_histograms(summed, pending[r], r)
        if summed[-1] > 0:
            rows = [w.candidate_row(r, r) for r, w in enumerate(ws)]
            for r, w in enumerate(ws):
                assert w.conclude_candidates(rows, 4, r == 0) == []
    lines = [ln for ln in capsys.readouterr().out.splitlines() if '"event": "straggler"' in ln]
    assert len(lines) == 2 and all('"rank": 2' in ln for ln in lines), lines


def test_the_percentile_of_the_others_equals_the_one_of_the_list_without_the_rank():
    import random
    rng = random.Random(3)
    for _ in range(300):
        values = [rng.choice([0.01, 0.02, 0.05, rng.random()]) for _ in range(rng.randint(2, 40))]
        ordered = sorted(values)
        q = rng.choice([50, 90, 95, 99, 100, 1])
        for i, t in enumerate(values):
            assert S._percentile_of_others(ordered, t, q) == \
                S.percentile(values[:i] + values[i + 1:], q)
    assert S._percentile_of_others([0.5], 0.5, 95) is None
