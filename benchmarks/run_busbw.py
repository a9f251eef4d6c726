#!/usr/bin/env python3
"""Bus bandwidth of strata's MPI backend against torch.distributed with
gloo, on the same CPU ranks, in one go.

    python3 benchmarks/run_busbw.py [--build build] [--np 4] [--repeats 2]

Runs build/benchmarks/comm_busbw (strata) and benchmarks/gloo_busbw.py
(gloo) under mpirun with the same flags, alternately, `--repeats` times
each, and keeps each side's best busbw per operation and size (the machine
is shared, so the best of a few runs is the least disturbed one). Writes
benchmarks/results/busbw.json and the table in benchmarks/RESULTS.md:
one row per operation and size, ratio = strata busbw / gloo busbw, target
>= 1.5 from 1 MiB up (issue 3).

    python3 benchmarks/run_busbw.py --launcher torchrun [--np 4] [--repeats 2]

compares strata's store-bootstrapped Gloo backend with torch.distributed's
gloo under torchrun instead: one job of benchmarks/gloo_busbw.py under
`torchrun --standalone --nproc-per-node N` with both libraries (and strata
with host copies off, STRATA_GLOO_CMA=0) initialised in every process, each
operation and size run by the sides in turn, `--repeats` rounds; then
send/recv again with each library alone in its job (`--repeats` pairs of
jobs in turn), because the two libraries' send/recv times move with each
other's rounds when they share a process. Writes
benchmarks/results/busbw_torchrun.json; target >= 1.0 (issue 4).
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "sendrecv"]
# As tests/tools/run_multirank.sh: ranks that wait yield their core by
# sleeping, which matters when ranks outnumber cores (docs/mpi.md).
MPI_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
             "--mca", "mpi_yield_when_idle", "1",
             "--mca", "threads_pthreads_yield_strategy", "nanosleep"]
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?\d+)")


def mpirun_path(build):
    cache = os.path.join(build, "CMakeCache.txt")
    if os.path.exists(cache):
        with open(cache) as f:
            for line in f:
                if line.startswith("STRATA_MPI_HOME:"):
                    home = line.split("=", 1)[1].strip()
                    candidate = os.path.join(home, "bin", "mpirun")
                    if os.path.exists(candidate):
                        return candidate
    candidate = os.path.join(sysconfig.get_paths()["data"], "bin", "mpirun")
    return candidate if os.path.exists(candidate) else shutil.which("mpirun")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"run_busbw: {' '.join(cmd[:8])} ... failed ({out.returncode})")
    return out.stdout


def parse(text, n):
    """{(op, bytes): busbw}, from the time column (the printed busbw has
    three decimals: too few to compare small sizes)."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            op, size, us = m.group(4), int(m.group(1)), float(m.group(5))
            rows[(op, size)] = size / (us * 1e3) * bench_util.bus_factor(op, n)
    return rows


def best(into, rows):
    for key, v in rows.items():
        into[key] = max(into.get(key, 0.0), v)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--launcher", choices=["mpirun", "torchrun"], default="mpirun")
    args = ap.parse_args()
    if args.launcher == "torchrun":
        return main_torchrun(args)
    mpirun = mpirun_path(args.build)
    binary = os.path.join(args.build, "benchmarks", "comm_busbw")
    if not mpirun or not os.path.exists(binary):
        raise SystemExit(f"run_busbw: need mpirun ({mpirun}) and {binary}; build first")
    sizes = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes]
    strata_cmd = [mpirun, *MPI_FLAGS, "-np", str(args.np), binary, "--op", args.ops, *sizes]
    gloo_cmd = [mpirun, *MPI_FLAGS, "-np", str(args.np), sys.executable,
                os.path.join(HERE, "gloo_busbw.py"), "--op", args.ops, *sizes]
    strata_best, gloo_best = {}, {}
    for i in range(args.repeats):
        print(f"run {i + 1}/{args.repeats}: strata", flush=True)
        best(strata_best, parse(run(strata_cmd), args.np))
        print(f"run {i + 1}/{args.repeats}: gloo", flush=True)
        env = dict(os.environ, MASTER_PORT=str(free_port()))
        best(gloo_best, parse(run(gloo_cmd, env), args.np))

    rows = []
    print(f"\n{'op':15s} {'size':>9s} {'strata':>8s} {'gloo':>8s} {'ratio':>6s}   (busbw GB/s)")
    for op in args.ops.split(","):
        for (o, nbytes) in sorted(k for k in strata_best if k[0] == op):
            s, g = strata_best[(o, nbytes)], gloo_best.get((o, nbytes))
            target = ">= 1.5" if nbytes >= (1 << 20) else None
            rows.append({"case": f"{op} {human(nbytes)}", "metric": "busbw", "unit": "GB/s",
                         "strata": s, "peer": "torch.distributed gloo", "peer_value": g,
                         "target": target})
            ratio = s / g if g else float("nan")
            print(f"{op:15s} {human(nbytes):>9s} {s:8.3f} {g or 0:8.3f} {ratio:6.2f}")
    command = f"python3 benchmarks/run_busbw.py --np {args.np} --repeats {args.repeats}"
    notes = (f"{args.np} CPU ranks on one host under mpirun ({' '.join(MPI_FLAGS)}); fp32 sum; "
             "strata: comm_busbw (out of place, each op started and waited); gloo: "
             "benchmarks/gloo_busbw.py (torch.distributed, in place where gloo is). Best of "
             f"{args.repeats} alternating runs per side. busbw = bytes / time x the nccl-tests "
             "factor.")
    path = bench_util.write_results("busbw", command, rows, notes=notes)
    print("wrote", path)


SIDE_ROW = re.compile(ROW.pattern + r"\s+([\d.]+)\s+(\S+)\s*$")


def parse_sides(text, n):
    """{side: {(op, bytes): (best busbw, median busbw)}} from gloo_busbw.py
    run with several sides."""
    out = {}
    for line in text.splitlines():
        m = SIDE_ROW.match(line)
        if m:
            op, size = m.group(4), int(m.group(1))
            best_us, median_us, side = float(m.group(5)), float(m.group(9)), m.group(10)
            bw = lambda us: size / (us * 1e3) * bench_util.bus_factor(op, n)  # noqa: E731
            out.setdefault(side, {})[(op, size)] = (bw(best_us), bw(median_us))
    return out


def separate_sendrecv(args, env, sizes):
    """{bytes: (strata busbw, torch busbw)} of send/recv with each library
    alone in its job, the two jobs in turn args.repeats times, best per size."""
    best = {}
    for rep in range(args.repeats):
        for lib in ("strata", "torch"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(args.np), os.path.join(HERE, "gloo_busbw.py"), "--op",
                   "sendrecv", *sizes, "--lib", lib]
            print(f"separate job {rep + 1}/{args.repeats}: send/recv, {lib} alone", flush=True)
            for (op, nbytes), (bw, _) in parse_sides(run(cmd, env), args.np).get(lib, {}).items():
                side = best.setdefault(nbytes, {})
                side[lib] = max(side.get(lib, 0.0), bw)
    return {n: (v["strata"], v["torch"]) for n, v in best.items() if len(v) == 2}


def main_torchrun(args):
    load_before = os.getloadavg()[0]
    sizes = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes]
    sides = "strata,torch,strata-tcp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.np), os.path.join(HERE, "gloo_busbw.py"), "--op", args.ops, *sizes,
           "--lib", sides, "--rounds", str(args.repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(os.path.abspath(args.build), "python"), env.get("PYTHONPATH"))
        if p)
    env.pop("STRATA_STORE", None)  # strata uses torchrun's store, as torch does
    env.pop("STRATA_GLOO_CMA", None)  # the strata side takes host copies where it can
    print(f"one torchrun job, sides {sides}, {args.repeats} rounds in turn", flush=True)
    res = parse_sides(run(cmd, env), args.np)
    host, peer, tcp = res.get("strata", {}), res.get("torch", {}), res.get("strata-tcp", {})
    rows = []
    print(f"\n{'op':15s} {'size':>9s} {'strata':>8s} {'torch':>8s} {'ratio':>6s} {'median':>6s}"
          f" {'tcp':>8s} {'ratio':>6s}   (busbw GB/s, best round; median: ratio of medians)")
    for op in args.ops.split(","):
        for (o, nbytes) in sorted(k for k in host if k[0] == op):
            (s, s_med), (g, g_med) = host[(o, nbytes)], peer[(o, nbytes)]
            t, _ = tcp.get((o, nbytes), (None, None))
            rows.append({"case": f"{op} {human(nbytes)}", "metric": "busbw", "unit": "GB/s",
                         "strata": s, "peer": "torch.distributed gloo", "peer_value": g,
                         "target": ">= 1.0", "median_ratio": s_med / g_med})
            print(f"{op:15s} {human(nbytes):>9s} {s:8.3f} {g:8.3f} {s / g:6.2f} "
                  f"{s_med / g_med:6.2f} {t or 0:8.3f} {(t or 0) / g:6.2f}")
    for op in args.ops.split(","):
        for (o, nbytes) in sorted(k for k in tcp if k[0] == op):
            t, _ = tcp[(o, nbytes)]
            rows.append({"case": f"{op} {human(nbytes)}, STRATA_GLOO_CMA=0", "metric": "busbw",
                         "unit": "GB/s", "strata": t, "peer": "torch.distributed gloo",
                         "peer_value": peer[(o, nbytes)][0], "target": None})
    separate = separate_sendrecv(args, env, sizes) if "sendrecv" in args.ops.split(",") else {}
    if separate:
        print(f"\nsend/recv, each library alone in its job (best of {args.repeats} jobs each)")
        for nbytes, (s, g) in sorted(separate.items()):
            print(f"{'sendrecv':15s} {human(nbytes):>9s} {s:8.3f} {g:8.3f} {s / g:6.2f}")
    for nbytes, (s, g) in sorted(separate.items()):
        rows.append({"case": f"sendrecv {human(nbytes)}, separate jobs", "metric": "busbw",
                     "unit": "GB/s", "strata": s, "peer": "torch.distributed gloo",
                     "peer_value": g, "target": ">= 1.0"})
    command = (f"python3 benchmarks/run_busbw.py --launcher torchrun --np {args.np} "
               f"--repeats {args.repeats} --max-bytes {args.max_bytes}")
    load = os.getloadavg()[0]
    ratios = [r["strata"] / r["peer_value"] for r in rows if "median_ratio" in r]
    medians = [r["median_ratio"] for r in rows if "median_ratio" in r]
    apart = [s / g for s, g in separate.values()]
    torch_shift = [peer[("sendrecv", n)][0] / g for n, (s, g) in separate.items()]
    strata_shift = [host[("sendrecv", n)][0] / s for n, (s, g) in separate.items()]
    notes = (f"{args.np} CPU processes on one host in one job under torchrun --standalone; fp32 "
             "sum. benchmarks/gloo_busbw.py initialises three sides in every process and, for "
             f"each operation and size, runs them in turn, {args.repeats} rounds (each round "
             "starting with the next side), each side "
             "making the same Python call per operation: strata = strata.init(backend='gloo') "
             "through torchrun's TCPStore (the ranks share this host, so collectives and "
             "send/recv take strata's host copies, docs/launch.md); "
             "peer = torch.distributed.init_process_group('gloo'); the rows marked "
             "STRATA_GLOO_CMA=0 are strata again with host copies off (Gloo's transport, "
             "strata's algorithms over it where they pay, and strata's framing of send/recv "
             "messages over it, docs/launch.md), no target. "
             "busbw = bytes / time of the best round x the nccl-tests factor. Ratio of the "
             f"medians of the rounds over the targeted rows: {min(medians):.2f} to "
             f"{max(medians):.2f}; of the best rounds: {min(ratios):.2f} to {max(ratios):.2f}. "
             + (f"Rows marked 'separate jobs': send/recv again with each library alone in its "
                f"process (gloo_busbw.py --lib strata, then --lib torch, {args.repeats} pairs of "
                "jobs in turn, best job per size), because sharing a process changes each "
                "side's send/recv: torch's busbw in the shared job / alone "
                f"{min(torch_shift):.2f} to {max(torch_shift):.2f}, strata's "
                f"{min(strata_shift):.2f} to {max(strata_shift):.2f}; strata / torch alone "
                f"{min(apart):.2f} to {max(apart):.2f}. " if apart else "")
             + f"1-minute load average {load_before:.1f} before the run and {load:.1f} at the "
             f"end (this benchmark's own {args.np} processes included), on "
             f"{os.cpu_count()} cores.")
    for r in rows:
        r.pop("median_ratio", None)
    path = bench_util.write_results("busbw_torchrun", command, rows, notes=notes)
    print("wrote", path)


if __name__ == "__main__":
    main()
