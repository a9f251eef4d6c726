#!/usr/bin/env python3
"""Checkpoint benchmark driver: strata's async checkpoints next to torch.save,
torch.distributed.checkpoint.async_save, torch.load and dd, on the same state
(at least 1 GiB) in the same run.

    python3 benchmarks/run_checkpoint.py [--build build] [--gib 1.0] [--repeats 5]

Figures (median of --repeats runs each):
  * time training is blocked by a save: strata AsyncCheckpointer.save (staging
    buffers warm, i.e. the second and later saves; the first save, which also
    allocates them, is reported on its own row) vs torch.save (target <= 0.1x)
    and vs DCP async_save (target <= 1x);
  * background write throughput (bytes / (write + commit time), files fsynced)
    vs `dd bs=64M conv=fdatasync` of the same size (target >= 0.7x);
  * load with checksum verification vs torch.load of the same state, both
    from a cold page cache (files fsynced, then POSIX_FADV_DONTNEED).
Every save is flushed (sync) before the next measurement starts. The GiB files
are deleted at the end.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_util  # noqa: E402


def make_state(gib):
    """A transformer-like state: per layer four square fp32 matrices plus
    norms and biases, enough layers for `gib` GiB."""
    import torch
    g = torch.Generator().manual_seed(0)
    dim = 2048
    per_layer = 4 * dim * dim * 4
    layers = max(1, round(gib * 2**30 / per_layer))
    state = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{i}.{name}.weight"] = torch.randn(dim, dim, generator=g)
        state[f"layers.{i}.norm.weight"] = torch.ones(dim)
        state[f"layers.{i}.o.bias"] = torch.zeros(dim)
    state["step"] = torch.tensor(1000)
    return state


def state_bytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def quiesce():
    """Flush dirty pages so one measurement does not pay for the last."""
    os.sync()
    time.sleep(1.0)


def drop_cache(paths):
    """Fsync and drop the page cache of the files under `paths`."""
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(r, f) for r, _, fs in os.walk(p) for f in fs]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd_throughput(work, nbytes):
    path = os.path.join(work, "dd.bin")
    count = max(1, nbytes // (64 << 20))
    quiesce()
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}",
                    "conv=fdatasync"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    os.remove(path)
    return count * (64 << 20) / seconds


def torch_save_blocked(state, path):
    import torch
    quiesce()
    start = time.perf_counter()
    torch.save(state, path)
    return time.perf_counter() - start


def dcp_async_blocked(state, path):
    import torch.distributed.checkpoint as dcp
    quiesce()
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=path)
    blocked = time.perf_counter() - start
    future.result()
    shutil.rmtree(path)
    return blocked


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: under --build)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(args.build), "python"))
    import torch
    import strata.checkpoint as ckpt

    torch.set_num_threads(os.cpu_count() or 1)
    state = make_state(args.gib)
    nbytes = state_bytes(state)
    print(f"state: {len(state)} tensors, {nbytes / 2**30:.2f} GiB")
    base = args.dir or os.path.join(os.path.abspath(args.build), "bench-checkpoint")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(dir=base)
    rows = []
    try:
        dd = [dd_throughput(work, nbytes) for _ in range(args.repeats)]
        print(f"dd: {[f'{x / 1e6:.0f} MB/s' for x in dd]}")

        torch_path = os.path.join(work, "state.pt")
        torch_save = [torch_save_blocked(state, torch_path) for _ in range(args.repeats)]
        print(f"torch.save blocked: {[f'{x:.3f}' for x in torch_save]} s")

        dcp_blocked = [dcp_async_blocked(state, os.path.join(work, f"dcp{i}"))
                       for i in range(args.repeats)]
        print(f"DCP async_save blocked: {[f'{x:.3f}' for x in dcp_blocked]} s")

        root = os.path.join(work, "strata")
        saver = ckpt.AsyncCheckpointer(root, keep_last=1)
        blocked, throughput = [], []
        first_blocked = None
        for i in range(args.repeats + 1):
            quiesce()
            start = time.perf_counter()
            saver.save(state, step=i + 1)
            b = time.perf_counter() - start
            saver.wait()
            st = saver.status()
            tput = st["bytes_written"] / (st["write_seconds"] + st["commit_seconds"])
            if i == 0:
                first_blocked = b
            else:
                blocked.append(b)
            throughput.append(tput)
            print(f"strata save {i + 1}: blocked {b:.3f} s (staging {st['staging_seconds']:.3f} s), "
                  f"write {st['write_seconds']:.2f} s + commit {st['commit_seconds']:.3f} s "
                  f"= {tput / 1e6:.0f} MB/s")
        saver.close()

        # Loads from a cold page cache.
        load_strata, load_torch = [], []
        for _ in range(args.repeats):
            drop_cache([torch_path, root])
            quiesce()
            start = time.perf_counter()
            loaded = ckpt.load(root, verify=True)
            load_strata.append(time.perf_counter() - start)
            del loaded
            drop_cache([torch_path, root])
            quiesce()
            start = time.perf_counter()
            loaded = torch.load(torch_path)
            load_torch.append(time.perf_counter() - start)
            del loaded
        print(f"load: strata (verified) {[f'{x:.3f}' for x in load_strata]} s, "
              f"torch.load {[f'{x:.3f}' for x in load_torch]} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not os.listdir(base):
            os.rmdir(base)

    med = statistics.median
    gib = f"{nbytes / 2**30:.2f} GiB"
    rows = [
        {"case": f"save, {gib}", "metric": "training blocked", "unit": "s", "strata": med(blocked),
         "peer": "torch.save", "peer_value": med(torch_save), "target": "<= 0.1"},
        {"case": f"save, {gib}", "metric": "training blocked", "unit": "s", "strata": med(blocked),
         "peer": "DCP async_save", "peer_value": med(dcp_blocked), "target": "<= 1.0"},
        {"case": f"first save, {gib} (allocates staging)", "metric": "training blocked", "unit": "s",
         "strata": first_blocked, "peer": "DCP async_save", "peer_value": med(dcp_blocked),
         "target": None},
        {"case": f"background write, {gib}", "metric": "throughput", "unit": "MB/s",
         "strata": med(throughput) / 1e6, "peer": "dd bs=64M conv=fdatasync",
         "peer_value": med(dd) / 1e6, "target": ">= 0.7"},
        {"case": f"load (checksums verified), {gib}, cold cache", "metric": "time", "unit": "s",
         "strata": med(load_strata), "peer": "torch.load", "peer_value": med(load_torch),
         "target": None},
    ]
    notes = (f"Median of {args.repeats} runs each. State: {len(state)} fp32 tensors "
             "(16 MiB matrices, norms, biases). strata blocked time is for saves 2+ (staging "
             "buffers reused); torch.save blocks for its whole (unsynced) write; DCP async_save "
             "blocks while it copies to CPU. Throughput counts files written, fsynced and "
             "committed. GPU-to-pinned staging is not measured by this driver yet (the issue's "
             "device-machine figure).")
    path = bench_util.write_results("checkpoint", "python3 benchmarks/run_checkpoint.py", rows, notes)
    for r in rows:
        print(f"{r['case']:50s} {r['metric']:18s} strata {bench_util._fmt(r['strata']):>8s} "
              f"{r['peer']:26s} {bench_util._fmt(r['peer_value']):>8s} ratio "
              f"{bench_util._fmt(bench_util.ratio(r['strata'], r['peer_value']))}")
    print("wrote", path)


if __name__ == "__main__":
    main()
