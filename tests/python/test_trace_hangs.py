"""The four usual hangs, each a real 4-rank mpirun job (trace_hang_worker.py)
with the flight recorder on by default: the ranks whose operation times out
(or fails) dump and ask every rank to, and strata-trace, run on the
directory as a user runs it, names the rank and the operation. PyTorch's
own analyzer (fr_trace) reads the same dumps."""

import json
import os
import pickle
import subprocess
import sys
import sysconfig

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "trace_hang_worker.py")


def mpirun():
    return os.environ.get("STRATA_MPIRUN") or os.path.join(sysconfig.get_paths()["data"], "bin",
                                                          "mpirun")


def run_job(scenario, trace_dir, ft=False):
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ([mpirun()] + (["--with-ft", "ulfm"] if ft else []) + root
           + ["--oversubscribe", "-np", "4", sys.executable, WORKER, scenario])
    env = dict(os.environ, STRATA_TRACE_DIR=str(trace_dir))
    env.pop("STRATA_TRACE", None)  # the default: on
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    return proc.stdout + proc.stderr


def strata_trace(trace_dir, *extra):
    out = subprocess.run([sys.executable, "-m", "strata.trace", str(trace_dir), *extra],
                         capture_output=True, text=True, check=True).stdout
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Each scenario run once: {scenario: (trace dir, launcher output)}."""
    out = {}
    for scenario in ("skip", "size", "die", "p2p"):
        d = tmp_path_factory.mktemp(f"trace-{scenario}")
        out[scenario] = (d, run_job(scenario, d, ft=scenario == "die"))
    return out


def report(jobs, scenario):
    d, log = jobs[scenario]
    text = strata_trace(d)
    merged = json.loads(strata_trace(d, "--json"))
    [world] = [g for g in merged["groups"] if g["group"] == "world"]
    return merged, world, text, log


def fourth_all_reduce(trace_dir, rank=0):
    """The collective number of the fourth all-reduce in `rank`'s dump (the
    World's group splits come first on the same communicator)."""
    with open(os.path.join(trace_dir, f"strata_trace_rank_{rank}.json")) as f:
        entries = json.load(f)["entries"]
    seqs = [e["collective_seq_id"] for e in entries
            if e["profiling_name"] == "mpi:all_reduce" and e["process_group"][0] == "world"]
    return seqs[3]


def test_rank_that_skips_a_collective(jobs):
    merged, world, text, log = report(jobs, "skip")
    # The stalled rank never timed out itself: its dump came from the others' request.
    assert merged["dumps"] == [0, 1, 2, 3], log
    assert "asked by rank" in merged["reasons"]["3"]
    [f] = world["findings"]
    assert f["kind"] == "not_entered", text
    assert (f["seq"], f["op"], f["input_sizes"]) == (fourth_all_reduce(jobs["skip"][0]),
                                                     "all_reduce", [[16]])
    assert f["not_entered"] == [3] and f["entered"] == [0, 1, 2]
    assert "never entered by rank 3" in text


def test_rank_that_calls_another_size(jobs):
    merged, world, text, log = report(jobs, "size")
    assert merged["dumps"] == [0, 1, 2, 3], log
    [f] = world["findings"]
    assert f["kind"] == "mismatch" and f["op"] == "all_reduce", text
    assert f["seq"] == fourth_all_reduce(jobs["size"][0])
    assert [(v["ranks"], v["input_sizes"]) for v in f["variants"]] == [([0, 1, 3], [[16]]),
                                                                        ([2], [[32]])]
    assert "rank 2: all_reduce [[32]]" in text


def test_rank_that_dies(jobs):
    merged, world, text, log = report(jobs, "die")
    assert merged["dumps"] == [0, 1, 2] and merged["missing_dumps"] == [3], log
    [f] = world["findings"]
    assert f["kind"] == "stuck" and f["op"] == "all_reduce", text
    assert (f["seq"], f["input_sizes"]) == (fourth_all_reduce(jobs["die"][0]), [[16]])
    assert f["no_dump"] == [3] and f["entered"] == [0, 1, 2]
    assert "no dump from rank 3" in text


def test_recv_whose_partner_never_sends(jobs):
    merged, world, text, log = report(jobs, "p2p")
    assert merged["dumps"] == [0, 1, 2, 3], log
    [f] = world["findings"]
    assert f["kind"] == "p2p_unmatched", text
    assert (f["op"], f["rank"], f["peer"], f["input_sizes"]) == ("recv", 1, 0, [[8]])
    assert "rank 0 never posted it" in text


def test_dumps_follow_pytorchs_format_and_fr_trace_reads_them(jobs, tmp_path):
    d, _ = jobs["skip"]
    with open(os.path.join(d, "strata_trace_rank_0.json")) as f:
        dump = json.load(f)
    assert dump["version"] == "2.10"
    assert json.loads(dump["pg_config"]["world"]["ranks"]) == [0, 1, 2, 3]
    fourth = fourth_all_reduce(d)
    assert dump["pg_status"]["world"]["last_enqueued_collective"] == fourth
    assert dump["pg_status"]["world"]["last_completed_collective"] == fourth  # failed: completed
    e = dump["entries"][-1]
    assert (e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["state"]) == (
        fourth, "mpi:all_reduce", [[16]], "completed")
    assert "DEADLINE_EXCEEDED" in e["strata"]["error"]
    # fr_trace reads only pickles: strata-trace writes them.
    pickles = tmp_path / "pickles"
    strata_trace(d, "--torch-pickle", str(pickles))
    db_path = tmp_path / "db.pkl"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                        str(pickles), "-o", str(db_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    with open(db_path, "rb") as f:
        _, db = pickle.load(f)
    # The splits and the three all-reduces every rank completed matched
    # across the ranks; the fourth, which rank 3 never entered, did not.
    names = [c.collective_name for c in db.collectives]
    assert names.count("mpi:all_reduce") >= 3 and "mpi:split" in names, names
    assert {m.global_rank for m in db.memberships} == {0, 1, 2, 3}
    assert "Not all ranks joining collective" in r.stdout + r.stderr
    assert f"sequence number: {fourth}" in r.stdout + r.stderr
    assert "{3}" in r.stdout + r.stderr
