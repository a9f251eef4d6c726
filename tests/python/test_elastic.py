"""strata.elastic in one process: the sampler hands every sample of an
epoch out exactly once across changes of dp; Options reject bad values by
name; State puts back what a failed step touched; run() on a world of one
goes through a whole recovery (a planned regroup: alarm, abort, agreement,
shrink, rebuild, restore) and redoes the step; supervise() turns a killed
child into exit status 0 and passes an exit status through; the regroup
plan from Python."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import strata
import strata.elastic as elastic


# ---- the sampler -------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_is_used_once_per_epoch_across_changes_of_dp(shuffle):
    rng = random.Random(5)
    n, batch = 1000, 48
    s = elastic.ElasticSampler(n, batch, shuffle=shuffle, seed=11, record=True)
    dp = 4
    seen = []
    step = 0
    while s.position < 3 * n:
        # A step may fail and be redone with a smaller dp (a recovery).
        if dp > 1 and rng.random() < 0.1:
            for d in range(dp):
                s.batch(d, dp)  # handed out, never committed
            dp -= 1
        parts = [s.batch(d, dp) for d in range(dp)]
        sizes = [len(p) for p in parts]
        assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1
        for p in parts:
            seen.extend(p)
        s.advance(batch)
        step += 1
        if dp < 4 and rng.random() < 0.05:
            dp += 1  # a replica joins (issue 25); the split follows
    for epoch in range(3):
        chunk = seen[epoch * n:(epoch + 1) * n]
        assert sorted(chunk) == list(range(n)), f"epoch {epoch}"
    if shuffle:
        assert seen[:n] != list(range(n))
    assert s.epoch == s.position // n
    assert len(s.records) > step  # the abandoned hand-outs are recorded too


def test_sampler_errors_name_the_value():
    with pytest.raises(strata.InvalidArgument, match="num_samples must be an int >= 1, got 0"):
        elastic.ElasticSampler(0, 4)
    with pytest.raises(strata.InvalidArgument, match="global_batch must be an int >= 1"):
        elastic.ElasticSampler(10, -1)
    with pytest.raises(strata.InvalidArgument, match=r"replica 3 is not in \[0, 3\)"):
        elastic.ElasticSampler(10, 4).batch(3, 3)


# ---- options --------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,message", [
    ("heartbeat_interval", 0, "heartbeat_interval must be a positive number"),
    ("settle_timeout", "2", "settle_timeout must be a positive number"),
    ("batch", "double", "batch must be one of 'keep', 'scale'"),
    ("leave", "stay", "leave must be one of 'exit', 'return'"),
    ("restore", "disk", "restore must be one of"),
    ("max_attempts", -1, "max_attempts must be an int >= 0"),
    ("checkpoint_every", 5, "checkpoint_every is 5 but checkpoint_dir is not set"),
    ("checkpoint_options", ["keep_last", 3], "checkpoint_options must be a dict of"),
    ("config", 3, "config must be a str, got int"),
    ("grow", "yes", "grow must be True or False, got 'yes'"),
    ("join_timeout", 0, "join_timeout must be a positive number"),
])
def test_bad_options_are_named(field, value, message):
    o = elastic.Options()
    setattr(o, field, value)
    with pytest.raises(strata.InvalidArgument, match=message):
        o._validate()


def test_the_core_checks_what_python_does_not():
    world = strata.init()
    try:
        o = elastic.Options(heartbeat_interval=1.0, heartbeat_timeout=2.0)
        with pytest.raises(strata.ElasticError, match="less than 3 heartbeat intervals"):
            elastic.Controller(world, elastic.State(), o)
    finally:
        world.destroy()


# ---- state --------------------------------------------------------------------------


def test_state_restores_what_a_failed_step_touched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sampler = elastic.ElasticSampler(100, 10)
    state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                          seen=[1, 2])
    state.commit()
    bn = model[1].running_mean.clone()
    lr = sched.get_last_lr()
    draw = torch.rand(3)
    torch.manual_seed(0)
    state.commit()
    # A step that fails half-way: forward (BatchNorm statistics), backward,
    # user values, the RNG, a scheduler step it should not have taken.
    model(torch.randn(8, 4)).sum().backward()
    state.seen.append(3)
    sampler.advance(10)
    sched.step()
    assert not torch.equal(model[1].running_mean, bn)
    state.restore()
    assert torch.equal(model[1].running_mean, bn)
    assert all(p.grad is None for p in model.parameters())
    assert state.seen == [1, 2]
    assert sampler.position == 0
    assert sched.get_last_lr() == lr
    torch.manual_seed(0)
    again = torch.rand(3)
    state.restore()
    assert torch.equal(torch.rand(3), again)
    assert "seen" in repr(state)
    with pytest.raises(AttributeError, match="has no value 'missing'"):
        state.missing


# ---- run() on a world of one ------------------------------------------------------------


def test_run_recovers_in_process_and_redoes_the_step(capsys):
    world = strata.init()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = elastic.ElasticSampler(64, 8, seed=1)
        state = elastic.State(model=model, optimizer=opt, sampler=sampler, log=[])
        x = torch.randn(64, 3)
        ref = torch.nn.Linear(3, 1)
        ref.load_state_dict(model.state_dict())
        changed = []

        def train_step(ctx):
            if ctx.step == 2 and ctx.epoch == 1:
                ctx.request_change([], "test: regroup onto the same members")
            opt.zero_grad()
            loss = model(x[ctx.samples]).pow(2).sum() * (ctx.loss_scale / len(ctx.samples))
            loss.backward()
            state.log.append(ctx.step)
            opt.step()  # step 2 of epoch 1 is abandoned here
            return loss

        result = elastic.run(train_step, state, world, elastic.Options(heartbeat_interval=0.05),
                             steps=5, on_world_changed=lambda e, w: changed.append(e))
        assert result.steps == 5 and result.epoch == 2 and not result.left
        assert state.log == [0, 1, 2, 3, 4]  # the abandoned step's entry was rolled back
        assert len(changed) == 1 and changed[0]["failed"] == [] and changed[0]["epoch"] == 2
        assert changed[0]["cause"]["source"] == "request"
        assert world.generation == 2
        # The same updates as a plain loop over the same batches.
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        s = elastic.ElasticSampler(64, 8, seed=1)
        for _ in range(5):
            ref_opt.zero_grad()
            idx = s.batch(0, 1)
            ref(x[idx]).pow(2).sum().div(8).backward()
            ref_opt.step()
            s.advance(8)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b)
        out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
        steps = [o for o in out if o["event"] == "step"]
        recoveries = [o for o in out if o["event"] == "recovery"]
        assert [o["step"] for o in steps] == [1, 2, 3, 4, 5]
        assert set(steps[0]) >= {"step", "loss", "world", "dp", "time"}
        assert len(recoveries) == 1
        assert set(recoveries[0]) >= {"failed", "detect_s", "agree_s", "rebuild_s", "restore_s",
                                      "world", "dp", "first_step_s"}
    finally:
        world.destroy()


def test_run_checks_its_arguments():
    world = strata.init()
    try:
        with pytest.raises(strata.InvalidArgument, match="steps must be an int >= 0"):
            elastic.run(lambda c: None, elastic.State(), world, steps=-1)
        with pytest.raises(strata.InvalidArgument, match="state must be a strata.elastic.State"):
            elastic.run(lambda c: None, {}, world, steps=1)
    finally:
        world.destroy()


def test_run_builds_the_state_from_a_function_and_spares_are_checked():
    world = strata.init()
    try:
        made = []

        def build(w):
            model = torch.nn.Linear(2, 1)
            made.append(w)
            return elastic.State(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1))

        result = elastic.run(lambda ctx: None, build, world, steps=2)
        assert made == [world] and result.steps == 2 and not result.stood_by
        assert world.spares == 0 and not world.is_spare
    finally:
        world.destroy()
    for bad in (-1, True, 1.5):
        with pytest.raises(strata.InvalidArgument, match="spares must be an int >= 0"):
            strata.init(spares=bad)
    with pytest.raises(strata.MeshError, match="the mesh is for 1 ranks and 1 spares but the "
                       "job has 1"):
        strata.init(strata.Mesh(1), spares=1)


def test_plan_regroup_from_python():
    mesh = strata.Mesh(8, tp=2)
    plan = strata._strata._elastic_plan_regroup(mesh, [5])
    assert plan["leaving"] == [4] and plan["mesh"]["dp"] == 3
    with pytest.raises(strata.ElasticError, match="no complete model replica"):
        strata._strata._elastic_plan_regroup(strata.Mesh(4, tp=2), [0, 3])


def _process_record(pid):
    """The process identity a heartbeat carries: host, boot id, pid, start time."""
    import socket
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    with open(f"/proc/{pid}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    return f"{socket.gethostname()} {boot} {pid} {start}"


def test_the_heartbeat_process_probe_tells_alive_stopped_and_gone():
    probe = strata._strata._elastic_probe_process
    assert probe(_process_record(os.getpid())) == "alive"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = _process_record(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(200):  # the signal is delivered asynchronously
            if probe(record) == "stopped":
                break
            time.sleep(0.01)
        assert probe(record) == "stopped"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert probe(record) == "gone"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    host, boot, pid, start = _process_record(os.getpid()).split()
    assert probe(f"{host} {boot} {pid} {int(start) + 1}") == "gone"  # the pid reused
    assert probe(f"{host} another-boot {pid} {start}") == "on another host"
    with pytest.raises(strata.ElasticError, match="bad process record 'not a record'"):
        probe("not a record")


# ---- supervise() ----------------------------------------------------------------------------


def _supervised(body, env_extra, restarts=0):
    script = textwrap.dedent(f"""
        import os, signal, sys
        import strata.elastic as elastic
        elastic.supervise(restarts={restarts})
        joining = os.environ.get("STRATA_ELASTIC_JOIN")
        print("child", os.getpid(), os.environ.get("STRATA_ELASTIC_SUPERVISED"), joining,
              flush=True)
        {body}
    """)
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test", RANK="3", **env_extra)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=60)


def test_supervise_turns_a_killed_rank_into_exit_0():
    p = _supervised("os.kill(os.getpid(), signal.SIGKILL)", {})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("child ")
    assert "rank 3's training process" in p.stderr and "killed by SIGKILL" in p.stderr


def test_supervise_restarts_a_killed_rank_as_a_joiner():
    # The first child dies; the second (STRATA_ELASTIC_JOIN=1) exits 0.
    p = _supervised("if not joining: os.kill(os.getpid(), signal.SIGKILL)", {}, restarts=1)
    assert p.returncode == 0, p.stderr
    children = [line.split() for line in p.stdout.splitlines() if line.startswith("child ")]
    assert [c[3] for c in children] == ["None", "1"], p.stdout
    assert "killed by SIGKILL; starting a new one that joins the running job (restart 1 of 1)" \
        in p.stderr
    # With the restarts used up, a second death ends the supervisor with 0.
    p = _supervised("os.kill(os.getpid(), signal.SIGKILL)", {}, restarts=1)
    assert p.returncode == 0 and p.stdout.count("child ") == 2, (p.stdout, p.stderr)
    assert "exiting with status 0" in p.stderr


def test_supervise_restarts_a_rank_that_left_and_checks_restarts():
    p = _supervised("if not joining: os._exit(elastic._LEFT)", {}, restarts=1)
    assert p.returncode == 0 and p.stdout.count("child ") == 2, (p.stdout, p.stderr)
    assert "left the job (evicted, or its replica was dropped); starting a new one" in p.stderr
    p = _supervised("os._exit(elastic._LEFT)", {}, restarts=0)
    assert p.returncode == 0 and p.stdout.count("child ") == 1, (p.stdout, p.stderr)
    with pytest.raises(strata.ElasticError, match="restarts must be an int >= 0, got -1"):
        elastic.supervise(restarts=-1)


def test_a_joiner_with_another_config_is_refused_naming_both(tmp_path):
    # A job of one rank (config "model-a") over a file store, and a process
    # that joins it (STRATA_ELASTIC_JOIN) with config "model-b".
    # An MPI job refuses any joiner, saying why.
    from strata import store as _store

    def options(job, config):
        return elastic.Options(store=_store.file_store(str(tmp_path)), job=job, config=config,
                               log=False)

    joiner = strata.init(env=dict(os.environ, STRATA_ELASTIC_JOIN="1"))
    assert joiner.joining and "joining a running job" in repr(joiner)
    with pytest.raises(strata.CommError, match="exists once strata.elastic.run"):
        joiner.rank
    with pytest.raises(strata.InvalidArgument, match="joins a running job"):
        elastic.run(lambda ctx: 0.0, elastic.State(), joiner, steps=1)
    for backend, config, message in [
            ("mpi", "model-a", "does not admit joiners: it runs on the mpi backend"),
            ("gloo", "model-b", "config 'model-b' is not the job's 'model-a'")]:
        world = strata.init(backend=backend)
        member = elastic.Controller(world, elastic.State(), options(backend, "model-a"))
        try:
            joiner = strata.init(env=dict(os.environ, STRATA_ELASTIC_JOIN="1"))
            with pytest.raises(strata.ElasticError, match=message):
                elastic.Controller(joiner, None, options(backend, config))
        finally:
            member.close()
            world.destroy()


def test_a_joiner_that_finds_the_job_finished_exits_0_saying_so(tmp_path):
    # A job of one rank runs its steps to the end; a process that then asks
    # to join it (a restart slower than the rest of the run) has nothing to
    # join: it exits with status 0 and says why, at once (not after
    # join_timeout, as when the request was left unanswered).
    script = textwrap.dedent(f"""
        import os, time
        import strata, strata.elastic as elastic
        from strata import store as _store
        def options():
            return elastic.Options(store=_store.file_store({str(tmp_path)!r}), job="done",
                                   log=False, join_timeout=60.0)
        world = strata.init(backend="gloo")
        elastic.run(lambda ctx: 0.0, elastic.State(), world, steps=2, options=options())
        world.destroy()
        joiner = strata.init(env=dict(os.environ, STRATA_ELASTIC_JOIN="1"))
        start = time.time()
        try:
            elastic.Controller(joiner, None, options())
        finally:
            print("returned after", time.time() - start, flush=True)
    """)
    start = time.time()
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "found job 'done' finished before it was admitted" in p.stderr, p.stderr
    assert "returned after" not in p.stdout, p.stdout  # it exited
    assert time.time() - start < 50, "the joiner waited for an answer"


def test_supervise_passes_an_exit_status_through():
    p = _supervised("sys.exit(7)", {})
    assert p.returncode == 7, p.stderr


def test_supervise_does_nothing_outside_torchrun():
    script = ("import os, strata.elastic as e; e.supervise(); "
              "print(os.environ.get('STRATA_ELASTIC_SUPERVISED'))")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "None", p.stderr


def test_plain_mpirun_gets_a_warning_naming_the_flag():
    w = elastic._launcher_warning("mpirun", {})
    assert "without --with-ft ulfm" in w and "mpirun --with-ft ulfm" in w
    assert elastic._launcher_warning("mpirun", {"OMPI_MCA_mpi_ft_enable": "1"}) is None
    assert elastic._launcher_warning("torchrun", {}) is None


# ---- many recoveries in one process --------------------------------------------------------


def _threads_fds_rss():
    """(threads, open file descriptors, resident KiB) of this process."""
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return threads, fds, rss


def _recovering_run(steps):
    """run() on a new world of one over a DataParallel model where every
    step is abandoned once (a planned regroup onto the same members: alarm,
    abort, agreement, shrink, rebuild of the World and of DataParallel,
    restore) and redone: ``steps`` recoveries. Returns the Result and the
    World's last generation."""
    import strata.nn as snn
    world = strata.init()
    torch.manual_seed(0)
    model = snn.DataParallel(torch.nn.Linear(16, 16), world, reduce_op="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = elastic.ElasticSampler(256, 8, seed=1)
    state = elastic.State(model=model, optimizer=opt, sampler=sampler)
    x = torch.randn(256, 16)

    def train_step(ctx):
        if ctx.epoch == ctx.step + 1:  # the first try of every step
            ctx.request_change([], "test: a regroup per step")
        opt.zero_grad()
        model(x[ctx.samples]).pow(2).sum().backward()
        opt.step()
        return None

    try:
        result = elastic.run(train_step, state, world,
                             elastic.Options(heartbeat_interval=0.05, log=False), steps=steps)
        return result, world.generation
    finally:
        world.destroy()


def test_fifty_recoveries_in_one_process_leak_no_threads_fds_or_memory():
    """50 recoveries through the Python layer (Controller, State, optimizer
    hooks, DataParallel's rebuild) on a world of one: the threads, file
    descriptors and resident memory of the process are where they were,
    and the job's temporary file store is removed when each run ends.
    (tests/cpp/elastic/loop_test.cc does the same for the C++ loop on 4
    Gloo ranks.)"""
    from strata._elastic_launch import _local_store_dir
    store_dir = _local_store_dir()  # where a world of one keeps its store
    # Warm up: the plugin, torch's thread pools, allocator arenas. A second
    # run in the same process must not find the first one's keys.
    for _ in range(2):
        result, generation = _recovering_run(2)
        assert result.epoch == 3 and len(result.events) == 2 and generation == 3
        assert not os.path.exists(store_dir), os.listdir(store_dir)
    threads0, fds0, rss0 = _threads_fds_rss()
    result, generation = _recovering_run(50)
    threads1, fds1, rss1 = _threads_fds_rss()
    assert result.steps == 50 and len(result.events) == 50 and result.epoch == 51
    assert [e["step"] for e in result.events] == list(range(50))
    assert generation == 51
    print(f"50 recoveries: threads {threads0} -> {threads1}, fds {fds0} -> {fds1}, "
          f"RSS {rss0} -> {rss1} KiB")
    assert threads1 == threads0, (threads0, threads1)
    assert fds1 <= fds0, (fds0, fds1, os.listdir("/proc/self/fd"))
    # What one recovery makes (a communicator, a World generation, the
    # State's copies, a DataParallel) leaked 50 times would pass this bound.
    assert rss1 - rss0 < 8 * 1024, f"RSS grew by {rss1 - rss0} KiB over 50 recoveries"
    assert not os.path.exists(store_dir), os.listdir(store_dir)
