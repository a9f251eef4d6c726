"""Under mpirun (4 ranks, pp=2 x dp=2): strata.timeline records the selected
steps of a real job and nothing else: the user's spans, every collective of
the world's groups (from the flight recorder, with the bytes it moved), the
pipeline schedule's forward and backward of each microbatch inside the
step, and a checkpoint's staging, write and commit; every lane nests; the
per-rank files merge into one trace with a process per rank.

Every rank runs every test in the same order; verdicts are agreed so a
failure on one rank cannot leave the others waiting.
"""

import json
import os
import time

import pytest
import torch

import strata
import strata.timeline as stl
from strata import pipeline
from dp_models import agree
from pipeline_models import copy_of, loss_fn, make_batch, make_stages

N = int(os.environ["STRATA_TEST_NP"])


@pytest.fixture(scope="module")
def world():
    w = strata.init(strata.Mesh(N, pp=2), timeout=120)
    yield w
    w.destroy()


@pytest.fixture(scope="module")
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0's temp dir, broadcast)."""
    path = str(tmp_path_factory.mktemp("timeline")) if world.rank == 0 else ""
    data = torch.zeros(512, dtype=torch.uint8)
    raw = path.encode()
    data[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    world.group("world").broadcast(data, src=0)
    return bytes(data[data != 0].tolist()).decode()


def spans(trace, lane=None, cat=None):
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    return [dict(e, lane=names[e["tid"]]) for e in trace["traceEvents"]
            if e.get("ph") == "X" and (lane is None or names[e["tid"]] == lane)
            and (cat is None or e["cat"] == cat)]


def inside(e, outer):
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]


def test_selected_steps_their_spans_and_collectives(world, shared_dir):
    problems = []
    d = os.path.join(shared_dir, "dp")
    tl = stl.Timeline(d, world=world, steps={1, 2})
    assert world.timeline is tl
    g = world.group("dp")
    sizes = {}
    for step in range(4):
        count = 1000 * (step + 1)
        sizes[step] = count * 4
        with tl.step(step), tl.step(step):  # a marker inside another counts once
            with tl.span("forward", step=step):
                time.sleep(0.01)
            with tl.span("backward"):
                x = torch.ones(count, dtype=torch.float32)
                work = g.all_reduce(x, async_op=True)
                y = torch.ones(count, dtype=torch.float32)
                work2 = g.all_reduce(y, async_op=True)
                work.wait()
                work2.wait()
            world.group("world").barrier()
    path = tl.close()
    assert world.timeline is None
    with open(path) as f:
        trace = json.load(f)
    problems += stl.check_nesting(trace)
    steps = spans(trace, cat="step")
    if sorted(e["args"]["step"] for e in steps) != [1, 2]:
        problems.append(f"recorded steps {[e['name'] for e in steps]}, want steps 1 and 2")
    for s in steps:
        step = s["args"]["step"]
        mine = [e for e in spans(trace) if inside(e, s) and e is not s]
        user = sorted(e["name"] for e in mine if e["cat"] == "compute")
        if user != ["backward", "forward"]:
            problems.append(f"step {step}: user spans {user}")
        reduces = [e for e in mine if e["cat"] == "comm" and e["name"] == "all_reduce"
                   and e["args"]["group"] == "dp"]
        if len(reduces) != 2 or any(e["args"]["bytes"] != sizes[step] for e in reduces):
            problems.append(f"step {step}: dp all_reduces {[e['args'] for e in reduces]}, want "
                            f"two of {sizes[step]} bytes")
        if not any(e["name"] == "barrier" and e["args"]["group"] == "world" for e in mine):
            problems.append(f"step {step}: no world barrier recorded")
        if not all(e["lane"].startswith("comm dp") for e in reduces):
            problems.append(f"step {step}: lanes {[e['lane'] for e in reduces]}")
    # Nothing of steps 0 and 3: every comm span lies in a recorded step.
    stray = [e for e in spans(trace, cat="comm") if not any(inside(e, s) for s in steps)]
    if stray:
        problems.append(f"{len(stray)} operations outside the selected steps: {stray[:2]}")
    agree(world, problems)
    world.group("world").barrier()
    if world.rank == 0:
        out, ranks = stl.merge(d)
        with open(out) as f:
            merged = json.load(f)
        assert ranks == list(range(N))
        assert stl.check_nesting(merged) == []
        pids = {e["pid"] for e in merged["traceEvents"] if e.get("ph") == "X"}
        assert pids == set(range(N))


def test_pipeline_actions_and_checkpoint_phases(world, shared_dir):
    problems = []
    d = os.path.join(shared_dir, "pp")
    tl = stl.Timeline(d, world=world, steps=[0])
    pp = world.group("pp")
    reference = make_stages(2, seed=3)
    piped = copy_of(reference)
    stage = pipeline.PipelineStage(piped[pp.rank], pp.rank, world, num_stages=2)
    m = 4
    schedule = pipeline.Schedule1F1B(stage, m, loss_fn, timeout=60)
    x, y = make_batch(8, seed=1)
    ckpt = strata.checkpoint.AsyncCheckpointer(os.path.join(shared_dir, "ckpt"), world=world)
    with tl.step(0):
        schedule.step(x if pp.rank == 0 else None, y if pp.rank == 1 else None)
        ckpt.save(piped[pp.rank].state_dict(), step=0)
    ckpt.wait()
    ckpt.close()
    with open(tl.close()) as f:
        trace = json.load(f)
    problems += stl.check_nesting(trace)
    (step,) = spans(trace, cat="step")
    actions = spans(trace, cat="pipeline")
    got = sorted(e["name"] for e in actions)
    want = sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    if got != want:
        problems.append(f"pipeline actions {got}, want {want}")
    if any(e["args"]["stage"] != pp.rank or not inside(e, step) for e in actions):
        problems.append("a pipeline action outside its step or of another stage")
    if any(e["lane"] != "compute" for e in actions):
        problems.append("pipeline actions outside the compute lane")
    # The forwards of one rank run in microbatch order, without overlap.
    fwd = sorted((e for e in actions if e["name"].startswith("F")), key=lambda e: e["ts"])
    if [e["name"] for e in fwd] != [f"F{i}" for i in range(m)]:
        problems.append(f"forwards in order {[e['name'] for e in fwd]}")
    p2p = [e for e in spans(trace, cat="comm") if e["name"] in ("send", "recv")]
    if not p2p or any(e["args"]["group"] != "pp" or e["args"].get("peer") != 1 - pp.rank
                      for e in p2p):
        problems.append(f"pipeline send/recv spans {[e['args'] for e in p2p][:3]}")
    if any(e["lane"] != f"comm pp {e['name']}" and not e["lane"].startswith(
            f"comm pp {e['name']} #") for e in p2p):
        problems.append(f"p2p lanes {sorted({e['lane'] for e in p2p})}")
    # What one stage sent, the other received (the bytes of the spans).
    mine = torch.tensor([sum(e["args"]["bytes"] for e in p2p if e["name"] == "send"),
                         sum(e["args"]["bytes"] for e in p2p if e["name"] == "recv")],
                        dtype=torch.int64)
    both = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    pp.all_gather(both, mine)
    if both[0][0] != both[1][1] or both[1][0] != both[0][1] or both[0][0] == 0:
        problems.append(f"bytes sent/received by stage 0 {both[0].tolist()} and stage 1 "
                        f"{both[1].tolist()} do not match")
    ck = {e["name"].split(" (")[0]: e for e in spans(trace, cat="checkpoint")}
    if set(ck) != {"checkpoint staging", "checkpoint write", "checkpoint commit"}:
        problems.append(f"checkpoint spans {sorted(ck)}")
    else:
        if not inside(ck["checkpoint staging"], step):
            problems.append("checkpoint staging outside the step")
        if ck["checkpoint write"]["ts"] < ck["checkpoint staging"]["ts"] + \
                ck["checkpoint staging"]["dur"]:
            problems.append("checkpoint write starts before staging ended")
    agree(world, problems)


def test_a_recovery_event_becomes_its_phases(world, tmp_path):
    # The event as strata.elastic.run hands it over (RecoveryEvent::ToJson).
    t = time.time()
    event = {"epoch": 2, "failed": [3], "cause": {"failed_at": t, "detail": "a peer failed"},
             "known_by_all_at": t + 0.1, "decided_at": t + 0.15, "rebuilt_at": t + 0.3,
             "restored_at": t + 0.35, "mesh_after": {"describe": "dp1 x pp2"}}
    tl = stl.Timeline(str(tmp_path), steps=[], rank=world.rank)
    tl._recovery(event)  # recorded though no step is selected
    trace = tl.trace()
    got = [(e["name"], round(e["dur"] / 1000.0)) for e in spans(trace, lane="recovery")]
    assert got == [("recovery (epoch 2)", 350), ("detect", 100), ("agree", 50),
                   ("rebuild", 150), ("restore", 50)]
    assert stl.check_nesting(trace) == []


def test_bad_arguments_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_TIMELINE_DIR", raising=False)
    with pytest.raises(strata.InvalidArgument, match="needs a directory"):
        stl.Timeline()
    with pytest.raises(strata.InvalidArgument, match="steps must be ints >= 0"):
        stl.Timeline(str(tmp_path), steps=[1, -2])
    with pytest.raises(strata.InvalidArgument, match="max_events"):
        stl.Timeline(str(tmp_path), max_events=0)
    with pytest.raises(strata.InvalidArgument, match="no timeline_rank"):
        stl.merge(str(tmp_path))
