"""Under mpirun (4 ranks): the metrics of a real job. Byte counters equal
the bytes the test's collectives moved; the busbw gauge matches the busbw
the communication benchmark's method (time a loop, divide) gives for the
same loop; rank 0 serves, over HTTP on loopback, the cluster view of the
ranks' step times, with the slowest rank named.

Every rank runs every test in the same order; verdicts are agreed so a
failure on one rank cannot leave the others waiting.
"""

import os
import time
import urllib.request

import pytest
import torch

import strata
import strata.metrics as sm
from prometheus_client.parser import text_string_to_metric_families

N = int(os.environ["STRATA_TEST_NP"])


def value(text, name, **labels):
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


@pytest.fixture(scope="module")
def world():
    # cluster_every=5: the view is published by the step markers themselves.
    w = strata.init(timeout=120, metrics=sm.Metrics(job="mr", port=0, cluster_every=5))
    yield w
    w.destroy()


def agree(world, ok):
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    return flag.item() == 0


def labels(world, group, op):
    return dict(job="mr", rank=str(world.rank), group=group, op=op)


def test_byte_counters_equal_the_bytes_sent(world):
    m = world.metrics
    g = world.group("world")
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"]
    before = {op: value(m.text(), "strata_collective_bytes_total", **labels(world, "world", op))
              or 0.0 for op in ops}
    sent = dict.fromkeys(ops, 0)
    for count in (1, 1000, 4097):
        x = torch.ones(count, dtype=torch.float32)
        g.all_reduce(x)
        sent["all_reduce"] += x.nbytes
        out = torch.empty(count * N, dtype=torch.float64)
        g.all_gather(out, torch.ones(count, dtype=torch.float64))
        sent["all_gather"] += out.nbytes  # nccl-tests' size: the gathered buffer
        big = torch.ones(count * N, dtype=torch.bfloat16)
        g.reduce_scatter(torch.empty(count, dtype=torch.bfloat16), big)
        sent["reduce_scatter"] += big.nbytes  # the buffer that is reduced
        y = torch.zeros(count, dtype=torch.int64)
        g.broadcast(y, src=0)
        sent["broadcast"] += y.nbytes
        z = torch.zeros(count, dtype=torch.int32)
        if world.rank % 2 == 0:
            g.send(z, dst=world.rank + 1)
            sent["send"] += z.nbytes
        else:
            g.recv(z, src=world.rank - 1)
            sent["recv"] += z.nbytes
    text = m.text()
    got = {op: (value(text, "strata_collective_bytes_total", **labels(world, "world", op)) or 0.0)
           - before[op] for op in ops}
    assert agree(world, got == sent), (got, sent)


def test_busbw_matches_the_benchmarks_method(world):
    # The communication benchmark (benchmarks/comm_busbw.cc) times a loop of
    # one size after a barrier and reports size / (time / iters) x factor.
    # The "dp" group (the same ranks as the world, its own name) sees only
    # this loop.
    g = world.group("dp")
    x = torch.ones(1 << 18, dtype=torch.float32)  # 1 MiB
    for _ in range(3):
        g.all_reduce(x)  # warm-up, as the benchmark does; counted by the gauge too
    results = []
    for _ in range(2):
        iters = 20
        g.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            g.all_reduce(x)
        elapsed = time.perf_counter() - t0
        results.append(x.nbytes / (elapsed / iters) * 2 * (N - 1) / N)
    gauge = value(world.metrics.text(), "strata_collective_busbw_bytes_per_second",
                  **labels(world, "dp", "all_reduce"))
    bench = sum(results) / len(results)
    spread = max(results) / min(results)
    # Within the benchmark's own noise (the spread of its two runs), with a
    # floor for a loaded machine; the gauge leaves out the Python time
    # between operations, so it may only be higher.
    tol = max(spread, 1.5)
    ok = gauge is not None and bench / tol <= gauge <= bench * tol
    print(f"rank {world.rank}: busbw gauge {gauge / 1e6:.1f} MB/s, benchmark method "
          f"{bench / 1e6:.1f} MB/s (runs {[round(r / 1e6, 1) for r in results]})")
    assert agree(world, ok), (gauge, results)


def test_cluster_view_on_rank_zero_over_http(world):
    m = world.metrics
    m.publish_cluster()  # start a fresh window on every rank
    # Each rank's steps take (rank + 1) x 20 ms; the last rank is the slowest.
    for _ in range(10):  # cluster_every=5: published at steps 5 and 10
        with sm.step(tokens=64):
            time.sleep(0.02 * (world.rank + 1))
    ok = True
    if world.rank == 0:
        body = urllib.request.urlopen(m.url, timeout=30).read().decode()
        name = "strata_cluster_step_duration_seconds"
        mx = value(body, name, job="mr", rank="0", stat="max")
        mn = value(body, name, job="mr", rank="0", stat="min")
        who = value(body, name + "_max_rank", job="mr", rank="0")
        tps_max = value(body, "strata_cluster_tokens_per_second", job="mr", rank="0",
                        stat="max")
        ok = (who == N - 1 and mx >= 0.02 * N and 0.02 <= mn < mx and tps_max is not None
              and tps_max <= 64 / 0.02)
        print(f"cluster view: step min {mn:.3f} s max {mx:.3f} s on rank {who}")
    assert agree(world, ok)


def test_other_ranks_are_not_scraped(world):
    # Only rank 0 holds the cluster families; the others serve their own.
    text = world.metrics.text()
    has = "strata_cluster_step_duration_seconds" in text
    assert agree(world, has == (world.rank == 0))
