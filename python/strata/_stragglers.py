"""The straggler report: which ranks are slow, from the cluster view's samples.

Every rank's sample (strata.metrics' cluster view, one all-gather of a few
numbers per rank) holds, over the steps since the previous one, its mean
step time, its mean compute time (step time minus the time it was blocked
in Work::Wait) and its mean time blocked waiting for collectives. A rank
that is slow makes everyone else wait in the collectives that follow, so
step time alone names nobody; compute time names the slow rank, and the
others show the wait it caused. Pure functions: the report is computed on
rank 0 from samples it already has (nothing is measured twice).
"""

import math
import statistics

# The policy the report checks by default: a rank whose compute time
# exceeds FACTOR x the P95 of the other ranks' is flagged.
FACTOR = 2.0


def _percentile(values, q):
    """Nearest rank: the smallest value with at least q% of values at or below it."""
    v = sorted(values)
    if not v:
        return None
    return v[max(0, math.ceil(q / 100.0 * len(v)) - 1)]


def analyze(samples, names, hosts=None, local_ranks=None, *, factor=FACTOR, first_step=None,
            last_step=None):
    """The report as a dict from ``samples[r]`` (rank r's cluster sample,
    in ``names`` order). ``hosts`` / ``local_ranks``: per rank, when known."""
    n = len(samples)
    col = {name: i for i, name in enumerate(names)}
    for need in ("compute_seconds", "collective_wait_seconds", "step_duration_seconds"):
        if need not in col:
            raise ValueError(f"the samples have no {need!r} figure (names: {names})")
    ranks = []
    for r, s in enumerate(samples):
        ranks.append({"rank": r, "host": hosts[r] if hosts else None,
                      "local_rank": local_ranks[r] if local_ranks else None,
                      "step_seconds": s[col["step_duration_seconds"]],
                      "compute_seconds": s[col["compute_seconds"]],
                      "wait_seconds": s[col["collective_wait_seconds"]]})
    compute = [x["compute_seconds"] for x in ranks]
    wait = [x["wait_seconds"] for x in ranks]
    med_c, med_w = statistics.median(compute), statistics.median(wait)
    for x in ranks:
        others = [c for c in compute[:x["rank"]] + compute[x["rank"] + 1:]]
        p95_others = _percentile(others, 95) if others else None
        x["compute_vs_median"] = x["compute_seconds"] / med_c if med_c else None
        x["wait_vs_median"] = x["wait_seconds"] / med_w if med_w else None
        x["compute_vs_p95_of_others"] = (x["compute_seconds"] / p95_others
                                         if p95_others else None)
        x["straggler"] = bool(x["compute_vs_p95_of_others"] is not None
                              and x["compute_vs_p95_of_others"] > factor)
    return {"ranks": ranks, "num_ranks": n, "factor": factor,
            "first_step": first_step, "last_step": last_step,
            "compute_median": med_c, "compute_p95": _percentile(compute, 95),
            "wait_median": med_w, "wait_p95": _percentile(wait, 95),
            "stragglers": [x["rank"] for x in ranks if x["straggler"]]}


def _who(x):
    where = []
    if x["host"]:
        where.append(f"host {x['host']}")
    if x["local_rank"] is not None:
        where.append(f"local rank {x['local_rank']}")
    return f"rank {x['rank']}" + (f" ({', '.join(where)})" if where else "")


def _ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _x(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_report(report, top=3):
    """The report as text: the slowest ranks by compute time and by
    collective wait, with the evidence, and the verdict."""
    ranks = report["ranks"]
    span = ""
    if report["first_step"] is not None and report["last_step"] is not None:
        span = f" over steps {report['first_step']}-{report['last_step']}"
    lines = [f"straggler report{span} ({report['num_ranks']} ranks; compute = step time - time "
             "blocked waiting for collectives, means per step)",
             f"  compute: median {_ms(report['compute_median'])}, P95 "
             f"{_ms(report['compute_p95'])}; collective wait: median "
             f"{_ms(report['wait_median'])}, P95 {_ms(report['wait_p95'])}",
             "  slowest by compute time:"]
    for x in sorted(ranks, key=lambda x: -x["compute_seconds"])[:top]:
        lines.append(f"    {_who(x)}: {_ms(x['compute_seconds'])}, {_x(x['compute_vs_median'])} "
                     f"the median, {_x(x['compute_vs_p95_of_others'])} the P95 of the others; "
                     f"waits {_ms(x['wait_seconds'])}")
    lines.append("  longest collective wait:")
    for x in sorted(ranks, key=lambda x: -x["wait_seconds"])[:top]:
        lines.append(f"    {_who(x)}: {_ms(x['wait_seconds'])}, {_x(x['wait_vs_median'])} the "
                     f"median; computes {_ms(x['compute_seconds'])}")
    if report["stragglers"]:
        for r in report["stragglers"]:
            x = ranks[r]
            lines.append(f"  => {_who(x)} is a straggler: its compute time is "
                         f"{_x(x['compute_vs_p95_of_others'])} the P95 of the others "
                         f"(threshold {report['factor']:g}x)")
    else:
        lines.append(f"  => no straggler (no rank's compute time above {report['factor']:g}x "
                     "the P95 of the others)")
    return "\n".join(lines)
