#!/usr/bin/env python3
"""Topology benchmark driver: detection + NCCL profile + lint on each machine
fixture and on this machine (benchmarks/topo_bench.cc), in one run.

    python3 benchmarks/run_topo.py [--build build]

Target (issue 5): under 50 ms per fixture (target_on strata). There is no
peer: no other tool derives NCCL profiles or lints NCCL settings, and the
detection-only alternative, `nvidia-smi topo -m`, needs an NVIDIA driver
(absent on CPU-only machines). When nvidia-smi exists, its run time is
recorded next to this machine's row for scale.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402


def nvidia_smi_ms():
    if not shutil.which("nvidia-smi"):
        return None
    start = time.perf_counter()
    r = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True)
    return (time.perf_counter() - start) * 1e3 if r.returncode == 0 else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    args = ap.parse_args()
    binary = os.path.join(args.build, "benchmarks", "topo_bench")
    out = subprocess.run([binary, "--benchmark_format=json", "--benchmark_min_time=0.5"],
                         check=True, capture_output=True, text=True)
    rows = []
    for b in json.loads(out.stdout)["benchmarks"]:
        name, ms = b["name"], b["real_time"]  # unit: ms
        if name.startswith("BM_Fixture/"):
            rows.append({"case": name.split("/", 1)[1], "metric": "detect + profile + lint",
                         "unit": "ms", "strata": ms, "peer": None, "peer_value": None,
                         "target": "< 50", "target_on": "strata"})
        elif name == "BM_ThisMachine":
            smi = nvidia_smi_ms()
            rows.append({"case": "this machine (/sys, NVML if present)",
                         "metric": "detect + profile + lint", "unit": "ms", "strata": ms,
                         "peer": "nvidia-smi topo -m" if smi is not None else None,
                         "peer_value": smi, "target": None})
        else:
            rows.append({"case": "ncclGetVersion via dlopen (once per process)",
                         "metric": "time", "unit": "ms", "strata": ms, "peer": None,
                         "peer_value": None, "target": None})
    notes = ("Each fixture is a sysfs tree (plus nvidia-smi text) of a real machine type; the "
             "lint runs over the eleven settings of the issue's guide. No peer: nothing else "
             "derives NCCL profiles or lints NCCL settings; nvidia-smi (detection only) needs a "
             "driver.")
    path = bench_util.write_results("topo", "python3 benchmarks/run_topo.py", rows, notes=notes)
    for r in rows:
        print(f"{r['case']:45s} {bench_util._fmt(r['strata']):>8s} ms   target {r.get('target') or '-'}")
    print("wrote", path)


if __name__ == "__main__":
    main()
