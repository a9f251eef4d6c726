"""strata.store in one process: the adapter over torch.distributed's
TCPStore (every operation, deadlines, many concurrent clients), the file
store, and strata.init's errors when the rendezvous store is missing or
unreachable (clear, and within the deadline)."""

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

import strata
from strata import store as sstore


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30),
                      wait_for_workers=False)
    yield s


def client(server):
    return dist.TCPStore("127.0.0.1", server.port, 1, False,
                         timeout=datetime.timedelta(seconds=30))


# Each test below runs with torch's client behind from_torch and with
# strata's own client of the same server (tcp_store).
CLIENTS = ["torch", "native"]


def connect(server, kind):
    if kind == "torch":
        return sstore.from_torch(client(server))
    return sstore.tcp_store("127.0.0.1", server.port, timeout=10)


@pytest.mark.parametrize("kind", CLIENTS)
def test_every_operation_round_trips(server, kind):
    s = connect(server, kind)
    assert "TCPStore 127.0.0.1" in repr(s)
    s.set("k", b"\x00\xffbinary")
    assert s.get("k", timeout=5) == b"\x00\xffbinary"
    s.wait(["k"], timeout=5)
    assert s.add("n", 5) == 5 and s.add("n", -7) == -2
    assert s.compare_set("c", b"", b"one") == b"one"          # absent + empty expected: set
    assert s.compare_set("c", b"one", b"two") == b"two"       # match: swapped
    assert s.compare_set("c", b"zzz", b"three") == b"two"     # mismatch: unchanged
    with pytest.raises(strata.CommError) as e:
        s.compare_set("absent", b"x", b"y")
    assert e.value.code == "NOT_FOUND" and "absent" in str(e.value)
    # strata's keys live under a prefix: torch's own keys are untouched.
    assert server.get("strata/k") == b"\x00\xffbinary"
    assert not server.check(["k"])


@pytest.mark.parametrize("kind", CLIENTS)
def test_get_and_wait_fail_at_their_deadline_naming_the_keys(server, kind):
    s = connect(server, kind)
    for timeout in (0.3, 0.0):
        t0 = time.monotonic()
        with pytest.raises(strata.CommError) as e:
            s.get("never", timeout=timeout)
        took = time.monotonic() - t0
        assert e.value.code == "DEADLINE_EXCEEDED" and "never" in str(e.value)
        assert took < timeout + 2.0, took
    with pytest.raises(strata.CommError) as e:
        s.wait(["a", "b"], timeout=0.2)
    named = "strata/b" if kind == "torch" else "'a, b'"  # each client's way of naming the keys
    assert e.value.code == "DEADLINE_EXCEEDED" and named in str(e.value), str(e.value)
    # A wait given up is cancelled on the server: the client goes on.
    s.set("after", b"ok")
    assert s.get("after", timeout=5) == b"ok"


@pytest.mark.parametrize("kind", CLIENTS)
def test_get_waits_for_a_key_set_later(server, kind):
    s = connect(server, kind)
    other = connect(server, kind)
    threading.Timer(0.3, lambda: other.set("late", b"v")).start()
    assert s.get("late", timeout=10) == b"v"


@pytest.mark.parametrize("kind", CLIENTS)
def test_many_clients_add_and_race_on_compare_set(server, kind):
    """16 clients (threads, each its own TCP connection): every add counted
    once, exactly one compare_set winner per round."""
    clients = [connect(server, kind) for _ in range(16)]
    rounds = 20
    wins = [0] * len(clients)
    errors = []

    def run(i):
        try:
            for r in range(rounds):
                clients[i].add("counter", 1)
                if clients[i].compare_set(f"round{r}", b"", str(i).encode()) == str(i).encode():
                    wins[i] += 1
            clients[i].add("done", 1)
            clients[i].wait([f"round{rounds - 1}"], timeout=30)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    s = sstore.from_torch(server)
    assert s.add("counter", 0) == len(clients) * rounds
    assert s.add("done", 0) == len(clients)
    assert sum(wins) == rounds


def test_the_native_client_shares_keys_with_torchs_and_serves_threads(server):
    native = sstore.tcp_store("127.0.0.1", server.port, timeout=10)
    via_torch = sstore.from_torch(client(server))
    native.set("from-native", b"1")
    via_torch.set("from-torch", b"2")
    assert via_torch.get("from-native", timeout=5) == b"1"
    assert native.get("from-torch", timeout=5) == b"2"
    assert server.get("strata/from-native") == b"1"  # torch's own view of the key
    # Threads share one client (their requests take turns; a wait holds
    # the connection until it ends, so threads that wait long should each
    # have their own, as the elastic monitor has).
    errors = []

    def adder():
        try:
            for _ in range(50):
                native.add("shared", 1)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    adders = [threading.Thread(target=adder) for _ in range(4)]
    for t in adders:
        t.start()
    for t in adders:
        t.join(30)
    assert not errors, errors
    threading.Timer(0.3, lambda: via_torch.set("go", b"x")).start()
    assert native.get("go", timeout=10) == b"x"
    assert native.add("shared", 0) == 200


def test_the_native_client_names_the_address_when_it_cannot_reach_it():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(strata.CommError) as e:
        sstore.tcp_store("127.0.0.1", port, timeout=0.5)
    assert e.value.code == "UNAVAILABLE" and f"127.0.0.1:{port}" in str(e.value)
    assert time.monotonic() - t0 < 5
    with pytest.raises(strata.InvalidArgument, match="port in 1..65535"):
        sstore.tcp_store("127.0.0.1", 0)
    s = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    native = sstore.tcp_store("127.0.0.1", s.port, timeout=5)
    native.set("k", b"v")
    del s  # the server goes away
    with pytest.raises(strata.CommError) as e:
        for _ in range(3):
            native.get("k", timeout=1)
            time.sleep(0.2)
    assert e.value.code == "UNAVAILABLE" and "TCPStore 127.0.0.1" in str(e.value)


def test_file_store_and_a_bad_store_argument(tmp_path):
    s = sstore.file_store(tmp_path / "st")
    s.set("a", b"1")
    assert s.get("a", timeout=1) == b"1"
    fine = sstore.file_store(tmp_path / "st", max_poll=0.001)
    assert fine.get("a", timeout=1) == b"1"
    finest = sstore.file_store(tmp_path / "st", max_poll=0.002, min_poll=5e-5)
    assert finest.get("a", timeout=1) == b"1"
    for bad in (0, -1, 11):
        with pytest.raises(strata.InvalidArgument,
                           match=rf"max_poll must be in \(0, 10\] seconds .* got max_poll {bad} "):
            sstore.file_store(tmp_path / "st", max_poll=bad)
    for bad in (0, -1e-3, 0.01):
        with pytest.raises(strata.InvalidArgument,
                           match=rf"min_poll in \(0, max_poll\], got max_poll 0.002 and "
                                 rf"min_poll {bad}"):
            sstore.file_store(tmp_path / "st", max_poll=0.002, min_poll=bad)
    with pytest.raises(strata.InvalidArgument, match="torch.distributed.Store"):
        sstore.from_torch(object())


def torchrun_env(port, rank=1, world=2, agent=True):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}
    if agent:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


@pytest.mark.parametrize("agent", [True, False])
def test_an_unreachable_store_fails_clearly_within_its_deadline(agent):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(strata.CommError) as e:
        strata.init(backend="gloo", env=torchrun_env(port, agent=agent), store_timeout=2)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "MASTER_ADDR:MASTER_PORT" in msg, msg
    assert "rank 1 of 2" in msg and "within 2s" in msg, msg
    # torch retries the connection once inside the timeout; allow slack for
    # a loaded machine, but not a hang.
    assert took < 2 * 2 + 5, took


def test_a_store_that_never_sees_the_peers_fails_within_the_deadline(server):
    """The store answers but rank 1 never comes: the bootstrap's wait fails
    at the operation timeout, naming the store."""
    env = torchrun_env(server.port, rank=0, world=2)
    t0 = time.monotonic()
    with pytest.raises(strata.CommError) as e:
        strata.init(backend="gloo", env=env, timeout=2, store=server)
    took = time.monotonic() - t0
    assert e.value.code == "DEADLINE_EXCEEDED", e.value
    assert "TCPStore" in str(e.value), e.value
    assert took < 2 + 5, took


def test_init_rejects_bad_store_arguments():
    env = torchrun_env(free_port())
    with pytest.raises(strata.InvalidArgument, match="store_timeout must be positive, got -1"):
        strata.init(backend="gloo", env=env, store_timeout=-1)
    with pytest.raises(strata.InvalidArgument, match="torch.distributed.Store"):
        strata.init(backend="gloo", env=env, store="file:/tmp/x")


def test_auto_picks_mpi_under_mpirun_and_gloo_under_torchrun():
    if "gloo" not in strata.available_backends() or "mpi" not in strata.available_backends():
        pytest.skip(f"needs mpi and gloo; built: {strata.available_backends()}")
    mpirun = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
              "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    resolve = strata._strata.resolve_backend
    gpu = "nccl" in strata.available_backends() and strata.topology.detect().gpus
    host = "nccl" if gpu else None  # with a visible GPU, auto picks NCCL first
    assert resolve(strata.launch_env(mpirun), "auto") == (host or "mpi")
    assert resolve(strata.launch_env(torchrun_env(29500)), "auto") == (host or "gloo")
    assert resolve(strata.launch_env(torchrun_env(29500)), "mpi") == "mpi"
    with pytest.raises(strata.InvalidArgument, match="unknown backend .tcp."):
        resolve(strata.launch_env(mpirun), "tcp")
