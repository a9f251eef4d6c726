"""A real network partition: examples/elastic/train.py on 4 ranks (dp4),
each rank in a network namespace of its own (and a UTS namespace with its
own host name, as on a host of its own), joined by a bridge on which this
test serves the job's TCPStore (as torchrun's agent would:
TORCHELASTIC_USE_AGENT_STORE=True; tests/python/env_launch.py --netns).
After a few steps one rank's link is cut (``ip link set ... down``): it
reaches neither its peers nor the store, and no reset tells anyone.

Checked:
- the majority (3 of the 4 members) finds the cut rank by its heartbeat,
  drops it and trains on: each exits 0, one recovery event naming it, and
  the final parameters equal a reference run's (one process, the same
  global batches, no failure);
- the cut rank stops by itself (the job runs with --no-fence: as across
  hosts, nobody can kill it) with a non-zero status and an error naming
  the store, within STOP seconds of the cut (measured: about 15 s, mostly
  TCP's own detection of a silent server, 8 s, and the heartbeat timeout,
  2 s; before keepalives on the store client it was still waiting after
  140 s).

A second case cuts only the network between the ranks: each namespace
has a second link (``eth1``, on a bridge of its own) that Gloo uses, as a
cluster's data network beside the one its store is reached on; the cut
rank's data link goes down while its store link stays up. Its heartbeat
goes on, so only the ranks' own regroup can tell: the first recovery
(an operation's timeout) regroups all four, their shrinks give up on each
other and report whom they waited for (kUnreachablePayload), and the next
agreement takes the rank every report touches as failed. Checked: the
majority trains on like the reference run; the cut rank stops, status 1,
saying it was taken as failed because it and the others could not
connect; within STOP_CUT seconds (the operation timeout, 8 s, plus a
regroup timeout, 12 s, and their margins; before, every rank stopped
after five attempts, about 5 minutes with the defaults).

Needs root, iproute2 and unshare (skipped otherwise).
"""

import datetime
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_driver as D  # noqa: E402


NP = 4
STEPS = 30
LR = 0.05
BATCH = 48
STOP = 45.0
STOP_CUT = 80.0
ARGS = ["--hidden", "32", "--layers", "2", "--batch", str(BATCH), "--lr", str(LR), "--tp", "1"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="needs root, iproute2 and unshare to make network namespaces")


def ip(*args, ns=None, check=True):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip"] + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Network:
    """A bridge (the store's side, .254) and one namespace per rank (.r+1,
    ``eth0``), in a 10.213.x.0/24 of this process; with ``data``, a second
    bridge and link per namespace (``eth1``, 10.214.x.r+1) for the ranks'
    own traffic. Removed by close()."""

    made = 0  # networks made by this process: each gets names of its own

    def __init__(self, n, data=False):
        Network.made += 1
        tag = f"{os.getpid() % 100000}{Network.made % 10}"
        x = (os.getpid() + 7 * Network.made) % 200 + 20
        self.ns = [f"strata{tag}-{r}" for r in range(n)]
        self.store_addr = f"10.213.{x}.254"
        self.bridges = [f"stb{tag}"] + ([f"sdb{tag}"] if data else [])
        # The bridges' ends of rank r's links: veth[r] (eth0), data_veth[r] (eth1).
        self.veth = [f"st{tag}r{r}" for r in range(n)]
        self.data_veth = [f"sd{tag}r{r}" for r in range(n)]
        try:
            for b in self.bridges:
                ip("link", "add", b, "type", "bridge")
                ip("link", "set", b, "up")
            ip("addr", "add", f"{self.store_addr}/24", "dev", self.bridges[0])
            for r in range(n):
                ip("netns", "add", self.ns[r])
                ip("link", "set", "lo", "up", ns=self.ns[r])
                links = [(self.veth[r], "eth0", f"10.213.{x}")]
                if data:
                    links.append((self.data_veth[r], "eth1", f"10.214.{x}"))
                for (outside, inside, subnet), bridge in zip(links, self.bridges):
                    ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns",
                       self.ns[r])
                    ip("link", "set", outside, "master", bridge)
                    ip("link", "set", outside, "up")
                    ip("addr", "add", f"{subnet}.{r + 1}/24", "dev", inside, ns=self.ns[r])
                    ip("link", "set", inside, "up", ns=self.ns[r])
        except Exception:
            self.close()
            raise

    def cut(self, r):
        """Rank r's only link (or, with a data network, its store link)."""
        ip("link", "set", self.veth[r], "down")

    def cut_data(self, r):
        ip("link", "set", self.data_veth[r], "down")

    def close(self):
        # The links first: a namespace's deletion frees them only later.
        for link in self.veth + self.data_veth:
            ip("link", "del", link, check=False)
        for ns in self.ns:
            ip("netns", "del", ns, check=False)
        for b in self.bridges:
            ip("link", "del", b, check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return D.reference_model(str(tmp_path_factory.mktemp("reference")), STEPS, ARGS)


def run_cut(tmp_path, what, data, extra_args):
    """Runs the example on NP ranks in namespaces (``data``: with a data
    network for Gloo), cuts a random rank's store link (or, with ``data``,
    its data link) after a few steps, and waits for the job, which must end
    with the cut rank's status 1 and the others' 0. Returns (the job, the
    cut rank, when it was cut, the other ranks)."""
    import torch.distributed as dist
    seed = int(os.environ.get("STRATA_ELASTIC_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    cut = rng.randrange(NP)
    print(f"{what}: seed {seed}, rank {cut} cut off", flush=True)
    net = Network(NP, data=data)
    job = None
    try:
        store = dist.TCPStore("0.0.0.0", 0, NP, True, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        args = ["--steps", str(STEPS), "--step-sleep", "0.1", "--heartbeat-timeout", "2",
                "--no-fence"] + extra_args + ARGS
        launch = ["--netns", ",".join(net.ns), "--master-addr", net.store_addr,
                  "--master-port", str(store.port)]
        if data:
            launch += ["--gloo-iface", "eth1"]
        job = D.Job("env", NP, args, str(tmp_path), timeout=240, launch_args=launch)
        job.wait_pids(120)
        job.wait_for(lambda: len(job.steps()) >= 4, "4 steps", 120)
        time.sleep(rng.uniform(0.0, 0.5))
        cut_at = time.time()
        (net.cut_data if data else net.cut)(cut)
        rc = job.finish()
    finally:
        if job is not None and job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        net.close()
    print(job.tail(12))
    status = {ln["rank"]: ln["status"] for ln in job.lines if ln.get("event") == "exit"}
    assert rc == 1 and status == {r: (1 if r == cut else 0) for r in range(NP)}, \
        (status, job.tail(80))
    return job, cut, cut_at, sorted(set(range(NP)) - {cut})


def test_a_cut_rank_stops_while_the_majority_trains_on(tmp_path, reference):
    job, cut, cut_at, majority = run_cut(tmp_path, "partition", False, [])

    # The cut rank stopped by itself, naming the store.
    at = job.stderr_first(f"rank {cut} stops: it cannot reach the elastic store torch TCPStore")
    assert at is not None, job.tail(80)
    stopped = at - cut_at
    assert stopped < STOP, (stopped, job.tail(80))

    # The majority dropped it once and finished like the reference.
    lines = job.recoveries()
    assert len(lines) == 1 and lines[0]["failed"] == [cut], job.tail(80)
    assert lines[0]["cause"]["source"] == "heartbeat", lines[0]["cause"]
    known = lines[0]["known_by_all_at"] - cut_at
    D.check_survivors(job, majority, STEPS, LR, BATCH, reference)
    print(f"partition: rank {cut} cut at {cut_at:.3f}; the majority knew after {known:.2f} s "
          f"and trained on (dp3); the cut rank stopped naming the store after "
          f"{stopped:.2f} s", flush=True)


def test_a_rank_cut_from_its_peers_but_not_from_the_store_is_dropped(tmp_path, reference):
    job, cut, cut_at, majority = run_cut(tmp_path, "partition (data network only)", True,
                                         ["--timeout", "8", "--rebuild-timeout", "12"])

    # The cut rank learnt the decision through the store, and why.
    at = job.stderr_first(f"rank {cut} was taken as failed by the agreement")
    assert at is not None, job.tail(80)
    assert job.stderr_first("could not connect to each other") is not None, job.tail(80)
    stopped = at - cut_at
    assert stopped < STOP_CUT, (stopped, job.tail(80))

    # The majority dropped it (in one recovery of two attempts: the shrink
    # of all four failed first) and finished like the reference.
    lines = job.recoveries()
    assert len(lines) == 1 and lines[0]["failed"] == [cut], job.tail(80)
    assert lines[0]["attempts"] >= 2, lines[0]
    assert "could not connect to each other" in lines[0]["failed_why"][0], lines[0]
    D.check_survivors(job, majority, STEPS, LR, BATCH, reference)
    print(f"partition (data network only): rank {cut} cut at {cut_at:.3f}; the majority "
          f"trained on (dp3), {lines[0].get('attempts')} attempts; the cut rank stopped "
          f"after {stopped:.2f} s", flush=True)
