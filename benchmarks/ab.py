#!/usr/bin/env python3
"""Before/after: one benchmark of two checkouts of strata, run alternately on
the same machine, so that a change's effect can be told from the machine's
noise (a loaded 2-core machine moves a ratio by 10% from one run to the
next; two builds measured hours apart cannot be compared). Not a run_*.py:
`make bench` does not run it (it needs a second checkout).

    python3 benchmarks/ab.py --before /path/to/old/checkout --bench tp --rounds 2
    python3 benchmarks/ab.py --before OLD --bench busbw --rounds 2 -- --np 4 --min-bytes 32M

Each checkout must be built (``<checkout>/build``) and runs its own
``benchmarks/run_<bench>.py`` against its own build (a benchmark's worker
follows its tree's API). Rounds alternate before, after, before, after, ...
Each run's rows are read from that tree's ``benchmarks/results/<bench>.json``;
the trees' results files and RESULTS.md are put back as they were, so the
comparison leaves no trace in either tree but its own results:
``benchmarks/results/ab_<bench>.json`` and a section of RESULTS.md, one row
per case and metric with the before and after values of the ratio to the
benchmark's peer, each round's and the median of each side.

The row's "strata" is the median after, its "peer_value" the median before,
its "ratio" after / before (of the ratios to the benchmark's own peer):
1.0 is no change, and the spread of the rounds says how much is noise.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_util  # noqa: E402

AFTER = os.path.dirname(HERE)


def run_once(tree, bench, extra):
    results = os.path.join(tree, "benchmarks", "results")
    saved = {}
    for path in (os.path.join(results, f"{bench}.json"),
                 os.path.join(tree, "benchmarks", "RESULTS.md")):
        if os.path.exists(path):
            saved[path] = open(path, "rb").read()
    script = os.path.join(tree, "benchmarks", f"run_{bench}.py")
    try:
        run = subprocess.run([sys.executable, script, "--build", "build"] + extra, cwd=tree,
                             capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise SystemExit(f"{script} failed ({run.returncode}):\n{run.stdout[-3000:]}"
                             f"{run.stderr[-3000:]}")
        with open(os.path.join(results, f"{bench}.json")) as f:
            return json.load(f)["rows"]
    finally:
        for path, data in saved.items():
            with open(path, "wb") as f:
                f.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the other checkout (built in ./build)")
    ap.add_argument("--after", default=AFTER, help="default: this checkout")
    ap.add_argument("--bench", required=True, help="tp, busbw, pipeline, checkpoint, ...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="after --: arguments for run_<bench>.py")
    args = ap.parse_args()
    for tree in (args.before, args.after):
        if not os.path.isfile(os.path.join(tree, "benchmarks", f"run_{args.bench}.py")):
            raise SystemExit(f"{tree} has no benchmarks/run_{args.bench}.py")
        if not os.path.isdir(os.path.join(tree, "build")):
            raise SystemExit(f"{tree} is not built ({tree}/build is missing)")
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        for side, tree in (("before", args.before), ("after", args.after)):
            print(f"round {r + 1}: {side} ({tree})", flush=True)
            runs[side].append(run_once(tree, args.bench, args.extra))
    rows = []
    # A case is (case, metric, peer): one case may be compared with several peers.
    keys = [(row["case"], row["metric"], row.get("peer")) for row in runs["after"][0]
            if row.get("ratio")]
    for case, metric, peer in keys:
        per, values = {}, {}
        for side in ("before", "after"):
            mine = [row for rs in runs[side] for row in rs if row.get("ratio") and
                    (row["case"], row["metric"], row.get("peer")) == (case, metric, peer)]
            per[side] = [row["ratio"] for row in mine]
            values[side] = [row.get("strata") for row in mine]
        if not per["before"]:
            continue
        before, after = statistics.median(per["before"]), statistics.median(per["after"])
        unit = next(row.get("unit") for row in runs["after"][0] if row["case"] == case)
        rows.append({"case": case, "metric": f"ratio to {peer}: {metric}", "unit": "ratio",
                     "strata": after, "peer": "the same ratio before", "peer_value": before,
                     "before_rounds": per["before"], "after_rounds": per["after"],
                     "before_values": values["before"], "after_values": values["after"],
                     "values_unit": unit, "target": None})
    cmd = " ".join(["python3 benchmarks/ab.py", "--before", args.before, "--bench",
                    args.bench, "--rounds", str(args.rounds)] +
                   (["--"] + args.extra if args.extra else []))
    before_rev = subprocess.run(["git", "-C", args.before, "log", "--oneline", "-1"],
                                capture_output=True, text=True).stdout.strip()
    after_rev = subprocess.run(["git", "-C", args.after, "log", "--oneline", "-1"],
                               capture_output=True, text=True).stdout.strip()
    notes = (f"before: {before_rev}; after: {after_rev}. Rounds alternate before/after on the "
             f"same machine, {args.rounds} of each; each value is the ratio of strata to the "
             f"benchmark's own peer in that run (lower is better for times, higher for "
             f"bandwidths); the row's ratio is median after / median before. The machine's "
             f"load average at the end: {os.getloadavg()[0]:.1f}.")
    path = bench_util.write_results(f"ab_{args.bench}", cmd, rows, notes=notes)
    for row in rows:
        print(f"{row['case'][:55]:55s} {row['metric'][-40:]:40s} before "
              f"{', '.join(f'{x:.3g}' for x in row['before_rounds'])}  after "
              f"{', '.join(f'{x:.3g}' for x in row['after_rounds'])}  (strata "
              f"{', '.join(f'{x:.3g}' for x in row['before_values'])} -> "
              f"{', '.join(f'{x:.3g}' for x in row['after_values'])} {row['values_unit']})")
    print("wrote", path)


if __name__ == "__main__":
    main()
