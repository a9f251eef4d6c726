#!/usr/bin/env python3
"""Mesh benchmark driver: strata's mesh_bench (Google Benchmark) next to a
peer, an independent pure-Python implementation of Megatron-Core's
masked-orthogonal rule enumerating the same groups, in the same run.

    python3 benchmarks/run_mesh.py [--build build]

Target (issue 2): every group of every axis of a 131,072-rank mesh in under
100 ms; memory linear in the world size (bytes per rank constant).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402

DENSE = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp"]
EXPERT = ["tp", "ep", "dp", "tp-ep", "tp-ep-pp"]
ORDER = ["tp", "cp", "ep", "dp", "pp"]


def python_groups(sizes, mask):
    """Megatron-Core's rule written plainly: enumerate groups over the unmasked
    axes, members over the masked axes, first axis fastest."""
    strides, s = [], 1
    for n in sizes:
        strides.append(s)
        s *= n
    masked = [(n, st) for n, st, m in zip(sizes, strides, mask) if m]
    unmasked = [(n, st) for n, st, m in zip(sizes, strides, mask) if not m]

    def offsets(axes):
        out = [0]
        for n, st in axes:
            out = [o + c * st for c in range(n) for o in out]
        return out

    member = offsets(masked)
    return [[b + o for o in member] for b in sorted(offsets(unmasked))]


def peer_seconds(world):
    tp, cp, ep = 8, 2, 8
    pp = 16 if world >= 16384 else 4
    dp = world // (tp * cp * pp)
    edp = world // (tp * ep * pp)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert = {"tp": tp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    start = time.perf_counter()
    for sizes_by_name, tokens in ((dense, DENSE), (expert, EXPERT)):
        sizes = [sizes_by_name[a] for a in ORDER]
        for t in tokens:
            python_groups(sizes, [a in t.split("-") for a in ORDER])
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    args = ap.parse_args()
    binary = os.path.join(args.build, "benchmarks", "mesh_bench")
    out = subprocess.run([binary, "--benchmark_format=json", "--benchmark_min_time=0.5"],
                         check=True, capture_output=True, text=True)
    results = json.loads(out.stdout)["benchmarks"]
    rows = []
    for b in results:
        name, world = b["name"].split("/")[0], int(b["ranks"])
        ms = b["real_time"]  # unit: ms
        if name == "BM_MeshAllGroups":
            peer = peer_seconds(world) * 1e3
            rows.append({"case": f"all groups, {world} ranks", "metric": "time", "unit": "ms",
                         "strata": ms, "peer": "pure-Python Megatron rule", "peer_value": peer,
                         "target": "< 100" if world == 131072 else None,
                         "target_on": "strata"})
            rows.append({"case": f"all groups, {world} ranks", "metric": "group bytes per rank",
                         "unit": "B", "strata": b["bytes_per_rank"], "peer": None,
                         "peer_value": None, "target": None})
        else:
            rows.append({"case": f"topology check + order search, {world} ranks",
                         "metric": "time", "unit": "ms", "strata": ms, "peer": None,
                         "peer_value": None, "target": None})
    path = bench_util.write_results("mesh", "python3 benchmarks/run_mesh.py", rows,
                                    notes="13 group sets (8 dense, 5 expert) per mesh; "
                                          "tp 8, cp 2, ep 8, pp 4 (1,024 ranks) or 16.")
    for r in rows:
        print(f"{r['case']:45s} {r['metric']:22s} {bench_util._fmt(r['strata']):>10s} {r['unit']}"
              f"   peer {bench_util._fmt(r.get('peer_value'))}")
    print("wrote", path)


if __name__ == "__main__":
    main()
