"""strata.metrics in one process: a sleep-based step has the step time it
slept, tokens/s and MFU follow from it, the .prom file is written where
STRATA_METRICS_FILE says, the HTTP endpoint serves the same text, the
registry mounts into prometheus_client, and bad input is refused."""

import os
import time
import urllib.request

import pytest
import torch

import strata
import strata.metrics as sm

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def samples(text):
    """{(name, frozenset(labels)): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text, name, **labels):
    return samples(text)[(name, frozenset(labels.items()))]


def test_sleep_step_has_the_time_it_slept():
    m = sm.Metrics(job="t", rank=0)
    slept = []
    for i in range(3):
        t0 = time.perf_counter()
        with sm.step(tokens=100, metrics=m):
            time.sleep(0.05 * (i + 1))
        slept.append(time.perf_counter() - t0)
    text = m.text()
    assert value(text, "strata_step_duration_seconds_count", job="t", rank="0") == 3
    total = value(text, "strata_step_duration_seconds_sum", job="t", rank="0")
    # The step is inside the interval measured around it, and at least the sleep.
    assert sum(0.05 * (i + 1) for i in range(3)) <= total <= sum(slept)
    last = m.totals()["last_step_seconds"]
    assert value(text, "strata_tokens_per_second", job="t", rank="0") == pytest.approx(100 / last)
    # Buckets are cumulative: a 0.15 s step is above the 0.128 bucket.
    assert value(text, "strata_step_duration_seconds_bucket", job="t", rank="0", le="0.128") == 2


def test_module_step_uses_the_latest_metrics_and_nests():
    m = sm.Metrics(job="nest", rank=0)
    assert sm.current() is m
    with sm.step() as outer:
        with sm.step(tokens=7):  # a user's marker inside strata's own: lends its tokens
            with outer.data_wait():
                time.sleep(0.01)
    t = m.totals()
    assert t["steps"] == 1
    assert t["tokens_per_second"] == pytest.approx(7 / t["last_step_seconds"])
    assert value(m.text(), "strata_data_wait_seconds_count", job="nest", rank="0") == 1
    # A step that raised is not recorded.
    with pytest.raises(RuntimeError):
        with sm.step(tokens=1):
            raise RuntimeError("boom")
    assert m.totals()["steps"] == 1


def test_mfu_from_declared_and_computed_flops():
    model = strata.nn.ParallelGPT(vocab_size=64, hidden_size=32, num_heads=4, num_layers=2,
                                  max_seq_len=16, group=None)
    seq = 16
    fpt = sm.flops_per_token(model, seq)
    embeds = sum(p.numel() for p in model.embed.parameters()) + model.pos.weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embeds
    assert fpt == 6 * n + 12 * 2 * 4 * 8 * seq
    m = sm.Metrics(rank=0, flops_per_token=fpt, peak_flops=1e12)
    with m.step(tokens=seq * 4):
        time.sleep(0.02)
    t = m.totals()
    assert t["mfu"] == pytest.approx(seq * 4 / t["last_step_seconds"] * fpt / 1e12)
    assert value(m.text(), "strata_mfu_ratio", job="strata", rank="0") == pytest.approx(t["mfu"])
    assert 0 < sm.peak_flops("cpu")  # measured GEMM rate
    with pytest.raises(strata.InvalidArgument, match="seq_len"):
        sm.flops_per_token(num_params=1, num_layers=1, num_heads=1, head_dim=1)


def test_prom_file_from_the_setting(tmp_path):
    env = dict(os.environ, STRATA_METRICS_FILE=str(tmp_path / "rank-{rank}.prom"))
    m = sm.Metrics(rank=3, env=env, write_interval=0)
    assert m.file == str(tmp_path / "rank-3.prom")
    with m.step(tokens=1):
        pass
    text = open(m.file).read()
    assert value(text, "strata_step_duration_seconds_count", job="strata", rank="3") == 1
    assert os.listdir(tmp_path) == ["rank-3.prom"]  # the temporary file was renamed


def test_bad_settings_and_arguments():
    env = dict(os.environ, STRATA_METRICS_PORT="web")
    with pytest.raises(strata.InvalidArgument, match="STRATA_METRICS_PORT='web'"):
        sm.Metrics(env=env)
    with pytest.raises(strata.InvalidArgument, match="cluster_every"):
        sm.Metrics(cluster_every=0)
    m = sm.Metrics()
    with pytest.raises(strata.InvalidArgument, match="only go up"):
        m.counter("c_total").inc(-1)
    m.gauge("g").set(1)
    with pytest.raises(strata.InvalidArgument, match="is a gauge"):
        m.counter("g").inc()
    with pytest.raises(strata.InvalidArgument, match="publish_cluster needs a group"):
        m.publish_cluster()


def test_http_endpoint_serves_the_registry():
    m = sm.Metrics(job="web", rank=0, port=0)
    assert m.url.startswith("http://127.0.0.1:")
    m.counter("my_batches_total", "batches").inc(4)
    body = urllib.request.urlopen(m.url, timeout=10).read().decode()
    assert value(body, "my_batches_total", job="web", rank="0") == 4
    assert value(body, "strata_build_info", job="web", rank="0", version=strata.__version__,
                 cuda=str(int(strata.build_info()["cuda"])),
                 nccl=str(int(strata.build_info()["nccl"])),
                 mpi=str(int(strata.build_info()["mpi"])),
                 gloo=str(int(strata.build_info()["gloo"]))) == 1


def test_prometheus_client_mount():
    m = sm.Metrics(job="mount", rank=0)
    with m.step(tokens=10):
        time.sleep(0.01)
    m.histogram("my_loss_hist", [0.5, 1.0]).observe(0.7)
    registry = CollectorRegistry()
    registry.register(m.collector())
    assert registry.get_sample_value("strata_step_duration_seconds_count",
                                     {"job": "mount", "rank": "0"}) == 1
    assert registry.get_sample_value("my_loss_hist_bucket",
                                     {"job": "mount", "rank": "0", "le": "1"}) == 1
    # Later steps show in later scrapes: the collector reads the live registry.
    with m.step():
        pass
    out = generate_latest(registry).decode()
    assert value(out, "strata_step_duration_seconds_count", job="mount", rank="0") == 2


def test_strata_loops_mark_their_steps():
    # A pipeline schedule's step() marks one step on its World's metrics;
    # a user's marker around it adds its tokens instead of a second step.
    from strata import pipeline

    world = strata.init(timeout=60)
    try:
        m = world.metrics
        assert isinstance(m, sm.Metrics) and sm.current() is m
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        schedule = pipeline.ScheduleGPipe(pipeline.PipelineStage(model, 0, world), 2,
                                          lambda out, t: ((out - t) ** 2).mean())
        x, t = torch.randn(4, 4), torch.randn(4, 4)
        schedule.step(x, t)
        assert m.totals()["steps"] == 1
        with strata.metrics.step(tokens=4):
            schedule.step(x, t)
        totals = m.totals()
        assert totals["steps"] == 2
        assert totals["tokens_per_second"] == pytest.approx(4 / totals["last_step_seconds"])
    finally:
        world.destroy()
    bare = strata.init(timeout=60, metrics=False)
    assert bare.metrics is None
    bare.destroy()


def test_init_serves_on_the_settings_port_and_frees_it(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, STRATA_METRICS_PORT=str(port),
               STRATA_METRICS_FILE=str(tmp_path / "m-{rank}.prom"))
    for _ in range(2):  # the second init gets the port the first world freed
        world = strata.init(timeout=60, env=env)
        assert world.metrics.url == f"http://127.0.0.1:{port}/metrics"
        world.group().all_reduce(torch.ones(3))
        body = urllib.request.urlopen(world.metrics.url, timeout=10).read().decode()
        assert value(body, "strata_collective_bytes_total", job="strata", rank="0",
                     group="world", op="all_reduce") == 12
        world.destroy()
        assert world.metrics.port == -1
        text = open(tmp_path / "m-0.prom").read()  # written when the world went
        assert "strata_collective_bytes_total" in text


def test_checkpoint_saves_are_measured(tmp_path):
    from strata import checkpoint

    world = strata.init(timeout=60)
    try:
        m = world.metrics
        model = torch.nn.Linear(64, 64)
        with checkpoint.AsyncCheckpointer(tmp_path, world=world) as ckpt:
            t0 = time.perf_counter()
            ckpt.save({"model": model.state_dict()}, step=1)
            blocked_at_most = time.perf_counter() - t0
            ckpt.wait()
            written = ckpt.status()["bytes_written"]
        text = m.text()
        assert written > 64 * 64 * 4
        assert value(text, "strata_checkpoint_write_bytes_total", job="strata", rank="0") == written
        assert value(text, "strata_checkpoint_blocked_seconds_count", job="strata", rank="0") == 1
        assert 0 < value(text, "strata_checkpoint_blocked_seconds_sum", job="strata",
                         rank="0") <= blocked_at_most
    finally:
        world.destroy()


def test_elastic_run_marks_steps_and_counts_recoveries():
    # A world of one going through a planned regroup (as test_elastic does):
    # the abandoned step is not a step; the recovery is counted; the
    # rebuilt world's communicators still record into the same registry.
    from strata import elastic

    world = strata.init()
    try:
        m = world.metrics
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = elastic.State(model=model, optimizer=opt,
                              sampler=elastic.ElasticSampler(64, 8, seed=1))
        x = torch.randn(64, 3)
        calls = []

        def train_step(ctx):
            calls.append(ctx.step)
            if ctx.step == 2 and ctx.epoch == 1:
                ctx.request_change([], "test: regroup onto the same members")
            opt.zero_grad()
            model(x[ctx.samples]).pow(2).sum().backward()
            world.group().all_reduce(torch.ones(5))
            opt.step()  # step 2 of epoch 1 is abandoned here
            return torch.zeros(())

        result = elastic.run(train_step, state, world, elastic.Options(heartbeat_interval=0.05),
                             steps=5)
        assert result.steps == 5 and world.generation == 2
        assert len(calls) == 6  # five steps and the abandoned one
        text = m.text()
        assert value(text, "strata_step_duration_seconds_count", job="strata", rank="0") == 5
        assert value(text, "strata_recoveries_total", job="strata", rank="0") == 1
        # The all-reduces of the five committed steps were recorded, across
        # the rebuild (the abandoned step's one may have been cut short by
        # the regroup's abort).
        done = value(text, "strata_collective_bytes_total", job="strata", rank="0",
                     group="world", op="all_reduce")
        assert done in (5 * 20, 6 * 20), text
    finally:
        world.destroy()


def test_straggler_analysis_thresholds_and_edge_cases():
    from strata import _stragglers as st
    names = sm.cluster_figure_names()

    def sample(compute, wait):
        s = [0.0] * len(names)
        s[names.index("step_duration_seconds")] = compute + wait
        s[names.index("compute_seconds")] = compute
        s[names.index("collective_wait_seconds")] = wait
        return s

    # 20 ranks computing 0.10 .. 0.119 s; rank 7 at 2.5x the P95 of the others, then at 1.9x.
    base = [0.10 + 0.001 * r for r in range(20)]
    p95_others = sorted(base[:7] + base[8:])[18]  # nearest rank: ceil(0.95 * 19) = 19th
    for factor, flagged in ((2.5, [7]), (1.9, [])):
        compute = list(base)
        compute[7] = factor * p95_others
        r = st.analyze([sample(c, 0.3 - c) for c in compute], names, factor=2.0)
        assert r["stragglers"] == flagged
        assert r["ranks"][7]["compute_vs_p95_of_others"] == pytest.approx(factor)
        text = st.format_report(r)
        assert ("rank 7 is a straggler" in text) == bool(flagged)
        # The slowest by compute waits least: it is listed first and last.
        assert text.split("slowest by compute time:\n")[1].lstrip().startswith("rank 7")
    # One rank, or nothing measured yet: no ratios, no division by zero, no straggler.
    for samples in ([sample(1.0, 0.0)], [sample(0.0, 0.0)] * 3):
        r = st.analyze(samples, names)
        assert r["stragglers"] == []
        assert "no straggler" in st.format_report(r)
    with pytest.raises(ValueError, match="compute_seconds"):
        st.analyze([[1.0]], ["step_duration_seconds"])
