"""strata-trace's merge logic on dumps built in the test (one process): the
first operation some rank never entered, entered with other sizes or ops,
or that did not complete; send/recv whose partner never posted; missing
dumps and rings that no longer hold what to compare; the CLI and its JSON."""

import json
import os
import subprocess
import sys

import pytest

from strata import trace


class Rank:
    """Builds one rank's dump as the flight recorder writes it."""

    def __init__(self, rank, world_size, capacity=2000):
        self.rank = rank
        self.world_size = world_size
        self.capacity = capacity
        self.entries = []
        self.seq = {}
        self.p2p = {}
        self.groups = {}

    def group(self, name, members):
        self.groups[name] = members
        return self

    def op(self, group, kind, count, state="completed", peer=-1, error=None):
        members = self.groups[group]
        grank = members.index(self.rank)
        p2p = kind in ("send", "recv")
        if p2p:
            self.p2p[group] = self.p2p.get(group, 0) + 1
        else:
            self.seq[group] = self.seq.get(group, 0) + 1
        name = {"send": f"mpi:send {grank}->{peer}",
                "recv": f"mpi:recv {grank}<-{peer}"}.get(kind, f"mpi:{kind}")
        self.entries.append({
            "record_id": len(self.entries), "pg_id": 0, "process_group": [group, group],
            "collective_seq_id": self.seq.get(group, 0), "p2p_seq_id": self.p2p.get(group, 0),
            "op_id": len(self.entries) + 1, "profiling_name": name, "time_created_ns": 1,
            "input_sizes": [[count]], "input_dtypes": ["Float"], "output_sizes": [[count]],
            "output_dtypes": ["Float"], "state": state, "is_p2p": p2p,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "retired": state == "completed", "frames": [], "timeout_ms": 1000,
            "strata": {"peer": peer, "root": -1, "reduce_op": None, "group_rank": grank,
                       "group_size": len(members), "error": error},
        })
        return self

    def dump(self):
        kept = self.entries[-self.capacity:]
        return {
            "version": "2.10",
            "pg_config": {g: {"name": g, "desc": g, "ranks": str(m)}
                          for g, m in self.groups.items()},
            "pg_status": {},
            "entries": kept,
            "strata": {"rank": self.rank, "world_size": self.world_size, "reason": "test",
                       "capacity": self.capacity, "recorded": len(self.entries)},
        }


def job(n=4, steps=3, capacity=2000):
    ranks = [Rank(r, n, capacity).group("world", list(range(n))) for r in range(n)]
    for r in ranks:
        for _ in range(steps):
            r.op("world", "all_reduce", 8)
    return ranks


def only(report, group="world"):
    [g] = [g for g in report["groups"] if g["group"] == group]
    return g["findings"]


def test_consistent_job_has_no_findings():
    ranks = job()
    report = trace.analyze({r.rank: r.dump() for r in ranks})
    assert only(report) == []
    assert report["missing_dumps"] == []
    assert "consistent" in trace.format_report(report)


def test_rank_that_skipped_a_collective_is_named():
    ranks = job()
    for r in ranks:
        if r.rank != 2:
            r.op("world", "all_reduce", 16, state="started")
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks}))
    assert f["kind"] == "not_entered"
    assert (f["seq"], f["op"], f["input_sizes"]) == (4, "all_reduce", [[16]])
    assert f["not_entered"] == [2] and f["entered"] == [0, 1, 3]


def test_rank_with_another_size_is_named():
    ranks = job()
    for r in ranks:
        r.op("world", "all_reduce", 32 if r.rank == 1 else 16, state="started")
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks}))
    assert f["kind"] == "mismatch" and f["seq"] == 4
    assert [(v["ranks"], v["input_sizes"]) for v in f["variants"]] == [([0, 2, 3], [[16]]),
                                                                        ([1], [[32]])]


def test_rank_with_another_op_is_named():
    ranks = job()
    for r in ranks:
        r.op("world", "broadcast" if r.rank == 3 else "all_reduce", 16, state="started")
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks}))
    assert f["kind"] == "mismatch"
    assert [(v["op"], v["ranks"]) for v in f["variants"]] == [("all_reduce", [0, 1, 2]),
                                                              ("broadcast", [3])]


def test_dead_rank_is_named_and_what_cannot_be_decided_is_said():
    ranks = job()
    for r in ranks[:3]:
        r.op("world", "all_reduce", 16, state="started", error="UNAVAILABLE: rank 3 failed")
    report = trace.analyze({r.rank: r.dump() for r in ranks[:3]})
    assert report["missing_dumps"] == [3]
    [f] = only(report)
    assert f["kind"] == "stuck" and f["seq"] == 4 and f["no_dump"] == [3]
    assert f["entered"] == [0, 1, 2]
    assert "whether it entered it cannot be decided" in f["message"]
    text = trace.format_report(report)
    assert "missing: rank 3" in text and "cannot decide: no dump from rank 3" in text


def test_recv_whose_sender_never_posts():
    ranks = job()
    ranks[1].op("world", "recv", 8, state="scheduled", peer=0)
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks}))
    assert f["kind"] == "p2p_unmatched"
    assert (f["op"], f["rank"], f["peer"]) == ("recv", 1, 0)
    assert "rank 0 never posted it" in f["message"]


def test_recv_that_timed_out_counts_as_pending():
    # A deadline completes the operation with its error: still the one stuck.
    ranks = job()
    ranks[2].op("world", "recv", 8, state="completed", peer=3,
                error="DEADLINE_EXCEEDED: recv did not complete within its timeout")
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks}))
    assert (f["kind"], f["rank"], f["peer"]) == ("p2p_unmatched", 2, 3)


def test_send_and_recv_of_different_sizes():
    ranks = job()
    ranks[1].op("world", "recv", 8, state="started", peer=0)
    ranks[0].op("world", "send", 4, state="started", peer=1)
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks}))
    assert f["kind"] == "p2p_mismatch" and f["peer_sizes"] == [[4]]


def test_pending_recv_from_a_rank_without_dump_is_undecided():
    ranks = job()
    ranks[1].op("world", "recv", 8, state="started", peer=0)
    [f] = only(trace.analyze({r.rank: r.dump() for r in ranks[1:]}))
    assert f["kind"] == "p2p_undecided" and f["peer"] == 0


def test_wrapped_rings_compare_only_what_every_rank_still_holds():
    # Rank 0's ring holds 2 entries, the others all 6: the mismatch at #2,
    # which rank 0's ring lost, cannot be seen; #6 (rank 3 never entered) is.
    ranks = [Rank(r, 4, capacity=2 if r == 0 else 100).group("world", [0, 1, 2, 3])
             for r in range(4)]
    for r in ranks:
        for i in range(5):
            r.op("world", "all_reduce", 99 if (i == 1 and r.rank == 0) else 8)
        if r.rank != 3:
            r.op("world", "all_reduce", 8, state="started")
    report = trace.analyze({r.rank: r.dump() for r in ranks})
    [f] = only(report)
    assert f["kind"] == "not_entered" and f["seq"] == 6 and f["not_entered"] == [3]
    [g] = report["groups"]
    assert g["ring_wrapped"] == [0]


def test_groups_are_told_apart_by_members():
    ranks = [Rank(r, 4).group("tp", [0, 1] if r < 2 else [2, 3]) for r in range(4)]
    for r in ranks:
        r.op("tp", "all_reduce", 8)
    ranks[2].op("tp", "all_reduce", 8, state="started")  # rank 3 never enters it
    report = trace.analyze({r.rank: r.dump() for r in ranks})
    findings = {tuple(g["ranks"]): g["findings"] for g in report["groups"]}
    assert findings[(0, 1)] == []
    [f] = findings[(2, 3)]
    assert f["not_entered"] == [3]


def test_cli_text_json_and_errors(tmp_path):
    ranks = job()
    for r in ranks:
        if r.rank != 2:
            r.op("world", "all_reduce", 16, state="started")
    for r in ranks:
        (tmp_path / f"strata_trace_rank_{r.rank}.json").write_text(json.dumps(r.dump()))
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "strata.trace", str(tmp_path)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "never entered by rank 2" in out
    out = subprocess.run([sys.executable, "-m", "strata.trace", str(tmp_path), "--json"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["groups"][0]["findings"][0]["not_entered"] == [2]
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "strata.trace", str(empty)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no strata_trace_rank_<rank>.json in" in r.stderr
    (empty / "strata_trace_rank_0.json").write_text("{")
    with pytest.raises(trace.TraceError, match="cannot read"):
        trace.load_dumps(str(empty))
