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
