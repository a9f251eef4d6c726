"""The World's flight recorder in one process (a world of one rank): on by
default, nothing written until a dump, dumps on a call and on SIGUSR1, the
settings and options and their errors."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import strata


def run(code, **env):
    full = dict(os.environ, **env)
    for k, v in env.items():
        if v is None:
            full.pop(k)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=120)


def test_on_by_default_and_dumps_when_called(tmp_path):
    with strata.init(trace_dir=str(tmp_path / "t")) as world:
        g = world.group()
        for _ in range(3):
            g.all_reduce(torch.ones(5))
        g.broadcast(torch.ones(2, dtype=torch.float64), src=0)
        assert world.trace_dir == str(tmp_path / "t")
        assert not (tmp_path / "t").exists()  # nothing until a dump
        path = world.dump_trace("from the test")
    assert path == str(tmp_path / "t" / "strata_trace_rank_0.json")
    dump = json.load(open(path))
    assert dump["version"] == "2.10"
    assert dump["strata"]["reason"] == "from the test"
    ours = [e for e in dump["entries"] if e["process_group"][0] == "world"]
    assert [(e["profiling_name"], e["input_sizes"], e["input_dtypes"], e["state"])
            for e in ours[-4:]] == [("mpi:all_reduce", [[5]], ["Float"], "completed")] * 3 + [
                ("mpi:broadcast", [[2]], ["Double"], "completed")]
    assert [e["collective_seq_id"] for e in ours[-4:]] == list(
        range(ours[-4]["collective_seq_id"], ours[-4]["collective_seq_id"] + 4))
    assert json.loads(dump["pg_config"]["world"]["ranks"]) == [0]


def test_default_dir_is_under_tmpdir_and_named_after_the_job(tmp_path):
    r = run("""
        import strata
        with strata.init() as world:
            print(world.trace_dir)
        """, TMPDIR=str(tmp_path), STRATA_TRACE_DIR=None)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert os.path.dirname(out) == str(tmp_path)
    assert os.path.basename(out).startswith("strata-trace-")


def test_sigusr1_dumps(tmp_path):
    with strata.init(trace_dir=str(tmp_path)) as world:
        world.group().all_reduce(torch.ones(3))
        os.kill(os.getpid(), signal.SIGUSR1)
        path = tmp_path / "strata_trace_rank_0.json"
        end = time.time() + 20
        while not path.exists() and time.time() < end:
            time.sleep(0.05)
        assert json.load(open(path))["strata"]["reason"] == "SIGUSR1"
    # The World put the default disposition back.
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_request_reaches_this_rank_too(tmp_path):
    with strata.init(trace_dir=str(tmp_path)) as world:
        path = world.request_trace_dump("rank 0 saw a hang")
        assert json.load(open(path))["strata"]["reason"] == "rank 0 saw a hang"


def test_off(tmp_path):
    with strata.init(trace=False) as world:
        assert world.trace_dir is None
        with pytest.raises(strata.Error, match="no flight recorder"):
            world.dump_trace()
    r = run("""
        import strata
        with strata.init() as world:
            print(world.trace_dir)
        """, STRATA_TRACE="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"


def test_bad_values_are_rejected():
    with pytest.raises(strata.InvalidArgument, match="trace_buffer must be a positive int"):
        strata.init(trace_buffer=0)
    with pytest.raises(strata.InvalidArgument, match="trace must be True, False or None"):
        strata.init(trace="yes")
    r = run("""
        import strata
        strata.init()
        """, STRATA_TRACE="maybe")
    assert r.returncode != 0
    assert "STRATA_TRACE='maybe' is not a boolean" in r.stderr
