"""Under mpirun (2, 3, 4 and 8 ranks): every collective x dtype x size x
reduce op on torch tensors and numpy arrays against references computed
here with torch; the groups of an 8-rank dp2 x tp2 x pp2 world; async work
on several groups at once; send/recv rings; a deadline that expires.

Every rank runs every test in the same order. A test collects its
mismatches and the ranks agree on the verdict at its end (``agree``), so a
failure on one rank cannot leave the others waiting in a collective.
"""

import os
import time
import weakref

import numpy as np
import pytest
import torch

import strata

N = int(os.environ["STRATA_TEST_NP"])
SIZES = [0, 1, 1023, 1 << 20]
TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int32, torch.int64]
OPS = ["sum", "prod", "min", "max", "avg"]


@pytest.fixture(scope="module")
def world():
    w = strata.init(timeout=120)
    yield w
    w.destroy()


def agree(world, problems):
    """Fails on every rank if any rank found a problem."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int32)
    world.group().all_reduce(flag, op="max")
    assert not problems, problems[:5]
    assert flag.item() == 0, "failed on another rank (see its report)"


def inputs(rank, n, op, dtype):
    """Small integers (prod: +-1 and one 2) so every result is exact."""
    i = torch.arange(n, dtype=torch.int64)
    unsigned = dtype == torch.uint8
    if op in ("sum", "avg"):
        v = (rank * 7 + i * 13) % 7
        v = v % 4 if unsigned else v - 3
    elif op == "prod":
        v = torch.where((rank + i) % 3 == 0, -1, 1) if not unsigned else torch.ones_like(i)
        v = torch.where(i % N == rank, 2, v)
    else:
        v = (rank * 5 + i * 3) % 11
        v = v if unsigned else v - 5
    return v.to(dtype)


def reference(n, op, dtype, size=N):
    stack = torch.stack([inputs(r, n, op, dtype).to(torch.float64) for r in range(size)])
    if op == "sum":
        out = stack.sum(0)
    elif op == "avg":
        out = stack.sum(0) / size
        if dtype != torch.float64:
            out = out.to(torch.float32)  # the backend divides in fp32
    elif op == "prod":
        out = stack.prod(0)
    elif op == "min":
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out.to(dtype)


def runs(n, op, dtype):
    if n < (1 << 20):
        return True
    return op == "sum" and dtype in (torch.float32, torch.bfloat16, torch.int32)


def mismatch(what, got, want):
    if torch.equal(got, want):
        return []
    bad = (got != want).nonzero()[0].item()
    return [f"{what}: element {bad}: got {got[bad].item()} want {want[bad].item()}"]


def test_allreduce_reduce_every_dtype_size_op(world):
    g, r = world.group(), world.rank
    problems = []
    for dtype in TORCH_DTYPES:
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for n in SIZES:
                if not runs(n, op, dtype):
                    continue
                what = f"{dtype} {op} n={n}"
                want = reference(n, op, dtype)
                x = inputs(r, n, op, dtype)
                g.all_reduce(x, op=op)
                problems += mismatch("allreduce " + what, x, want)
                y = inputs(r, n, op, dtype)
                g.reduce(y, dst=N - 1, op=op)
                if r == N - 1:
                    problems += mismatch("reduce " + what, y, want)
    agree(world, problems)


def test_gather_scatter_alltoall_broadcast(world):
    g, r = world.group(), world.rank
    problems = []
    for dtype in TORCH_DTYPES:
        for n in SIZES[:3] + [1 << 16]:
            mine = (torch.arange(n) * 3 + r).to(dtype)
            out = torch.zeros(n * N, dtype=dtype)
            g.all_gather(out, mine)
            want = torch.cat([(torch.arange(n) * 3 + k).to(dtype) for k in range(N)])
            problems += mismatch(f"allgather {dtype} n={n}", out, want)

            full = inputs(r, n * N, "sum", dtype)
            part = torch.zeros(n, dtype=dtype)
            g.reduce_scatter(part, full, op="sum")
            problems += mismatch(f"reduce_scatter {dtype} n={n}", part,
                                 reference(n * N, "sum", dtype)[r * n:(r + 1) * n])

            send = torch.stack([(torch.arange(n) + 100 * r + j) for j in range(N)]).to(dtype)
            recv = torch.zeros_like(send)
            g.all_to_all_single(recv, send)
            want = torch.stack([(torch.arange(n) + 100 * j + r) for j in range(N)]).to(dtype)
            problems += mismatch(f"all_to_all {dtype} n={n}", recv.flatten(), want.flatten())

            b = torch.full((n,), r, dtype=torch.int64).to(dtype)
            g.broadcast(b, src=N - 1)
            problems += mismatch(f"broadcast {dtype} n={n}", b,
                                 torch.full((n,), N - 1, dtype=torch.int64).to(dtype))
    agree(world, problems)


def test_all_to_all_with_splits(world):
    g, r = world.group(), world.rank
    # rank r sends (r + j) % 3 rows of 4 to rank j.
    send_splits = [(r + j) % 3 for j in range(N)]
    recv_splits = [(j + r) % 3 for j in range(N)]
    send = torch.cat([torch.full((s, 4), 10 * r + j, dtype=torch.float32)
                      for j, s in enumerate(send_splits)])
    recv = torch.zeros(sum(recv_splits), 4)
    g.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    want = torch.cat([torch.full((s, 4), 10 * j + r, dtype=torch.float32)
                      for j, s in enumerate(recv_splits)])
    problems = mismatch("all_to_all splits", recv.flatten(), want.flatten())
    # Rows that do not split evenly need explicit splits (every rank raises,
    # before any communication).
    if N > 1 and 3 % N:
        with pytest.raises(strata.InvalidArgument, match="not divisible by the group size"):
            g.all_to_all_single(torch.zeros(3), torch.zeros(3), output_split_sizes=[0] * (N - 1) + [3])
    agree(world, problems)


def test_numpy_arrays(world):
    g, r = world.group(), world.rank
    problems = []
    for dtype in ["float32", "float64", "float16", "int8", "uint8", "int32", "int64"]:
        x = np.full((3, 5), r, dtype=dtype)
        g.all_reduce(x, op="max")
        if not (x == N - 1).all():
            problems.append(f"numpy allreduce {dtype}: {x.ravel()[:3]}")
        out = np.zeros((N, 3), dtype=dtype)
        g.all_gather(out, np.full(3, r, dtype=dtype))
        if not (out == np.arange(N, dtype=dtype)[:, None]).all():
            problems.append(f"numpy allgather {dtype}")
    agree(world, problems)


def test_send_recv_rings_both_directions(world):
    g, r = world.group(), world.rank
    nxt, prv = (r + 1) % N, (r - 1) % N
    problems = []
    for dtype in TORCH_DTYPES:
        out = (torch.arange(1000) + r).to(dtype)
        from_prev, from_next = torch.zeros_like(out), torch.zeros_like(out)
        works = [g.recv(from_prev, prv, async_op=True), g.recv(from_next, nxt, async_op=True),
                 g.send(out, nxt, async_op=True), g.send(out, prv, async_op=True)]
        for w in works:
            w.wait(timeout=60)
        problems += mismatch(f"ring from prev {dtype}", from_prev, (torch.arange(1000) + prv).to(dtype))
        problems += mismatch(f"ring from next {dtype}", from_next, (torch.arange(1000) + nxt).to(dtype))
    agree(world, problems)


def test_async_on_several_groups():
    if N != 8:
        pytest.skip("needs 8 ranks")
    with strata.init(strata.Mesh(8, tp=2, pp=2), timeout=120) as w:
        works, tensors = [], {}
        for axes in ["tp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp", "world"]:
            t = torch.full((1 << 12,), float(w.rank))
            tensors[axes] = t
            works.append(w.group(axes).all_reduce(t, async_op=True))
        for work in reversed(works):
            work.wait(timeout=60)
        problems = []
        for axes, t in tensors.items():
            members = list(range(8)) if axes == "world" else w.mesh.group_of(w.rank, axes)
            if not torch.all(t == float(sum(members))):
                problems.append(f"{axes}: {t[0].item()} != {sum(members)}")
            if axes != "world" and w.group(axes).size != len(members):
                problems.append(f"{axes}: size {w.group(axes).size} != {len(members)}")
        agree(w, problems)


def test_deadline_expires_with_a_clear_error(world):
    g, r = world.group(), world.rank
    sub = g.split(0, name="late")
    problems = []
    if r == 0:
        x = torch.zeros(1)
        work = sub.recv(x, 1, async_op=True)
        try:
            work.wait(timeout=0.1)
            problems.append("wait returned before the peer sent")
        except strata.CommError as e:
            if (e.code != "DEADLINE_EXCEEDED"
                    or "recv(peer 1, 1 x fp32) on group late (rank 0" not in str(e)):
                problems.append(f"unexpected error: {e}")
        sub.send(torch.zeros(1), 1)  # go ahead
        work.wait(timeout=60)
        if x.item() != 7.0:
            problems.append(f"received {x.item()}")
    elif r == 1:
        sub.recv(torch.zeros(1), 0)
        sub.send(torch.full((1,), 7.0), 0)
    agree(world, problems)


# ---- groups: every combination, names, lazy creation ----------------------


def _members(mesh, rank, name):
    """The ranks the mesh puts in `rank`'s group `name` (canonical)."""
    if name == "world":
        return list(range(mesh.world_size))
    axes = name.split("-")
    if any(a in ("ep", "etp", "edp") for a in axes):
        plain = "-".join({"etp": "tp", "edp": "dp"}.get(a, a) for a in axes)
        return list(mesh.expert_group_of(rank, plain))
    return list(mesh.group_of(rank, name))


def _check_group(w, g, name, problems):
    """`g` is `name`, holds the mesh's members in order and sums right."""
    members = _members(w.mesh, w.rank, name)
    if g.name != name:
        problems.append(f"{name}: named {g.name!r}")
    if g.size != len(members):
        problems.append(f"{name}: size {g.size} != {len(members)}")
        return
    got = torch.zeros(g.size, dtype=torch.int64)
    g.all_gather(got, torch.tensor([w.rank], dtype=torch.int64))
    if got.tolist() != members:
        problems.append(f"{name}: members {got.tolist()} != {members}")
    x = torch.tensor([1.0 + w.rank], dtype=torch.float64)
    g.all_reduce(x)
    if x.item() != sum(1.0 + r for r in members):
        problems.append(f"{name}: sum {x.item()}")


def _mesh_for(n):
    if n == 8:
        return strata.Mesh(8, tp=2, pp=2)
    if n % 2 == 0:
        return strata.Mesh(n, tp=2)
    return strata.Mesh(n)


def test_every_combination_of_axes_is_a_group(world):
    problems = []
    with strata.init(_mesh_for(N), timeout=120) as w:
        for name in strata.World.all_group_names():
            _check_group(w, w.group(name), name, problems)
        if len(w.group_names()) != 30:
            problems.append(f"group_names: {w.group_names()}")
    agree(world, problems)


def test_tp_dp_is_a_group(world):
    """Megatron-Core's tensor-and-data-parallel group; "no group 'tp-dp' in
    this world" at 3f6f648. With cp = 2 it is no standard group's copy and
    is created on request."""
    if N != 8:
        pytest.skip("needs 8 ranks")
    with strata.init(strata.Mesh(8, tp=2, cp=2), timeout=120) as w:
        g = w.group("tp-dp")
        members = list(w.mesh.group_of(w.rank, "tp-dp"))
        got = torch.zeros(4, dtype=torch.int64)
        g.all_gather(got, torch.tensor([w.rank], dtype=torch.int64))
        problems = [] if (g.name, got.tolist()) == ("tp-dp", members) else [
            f"tp-dp: {g.name} {got.tolist()} != {members}"]
    agree(world, problems)


def test_shared_groups_report_the_name_they_were_asked_by(world):
    """pp = cp = 1: pp, cp (and tp here) share one communicator; each says
    its own name (at 3f6f648 world.group("pp") printed as 'cp')."""
    problems = []
    with strata.init(strata.Mesh(N), timeout=120) as w:
        for name in ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp", "ep", "etp", "edp",
                     "etp-ep"]:
            g = w.group(name)
            if not repr(g).startswith(f"<strata.Group {name}: rank {g.rank} of {g.size} ("):
                problems.append(f"{name}: {g!r}")
            try:
                g.send(torch.ones(1), g.size)
                problems.append(f"{name}: send to rank {g.size} did not raise")
            except strata.InvalidArgument as e:
                if f"on group {name} (rank {g.rank} of {g.size}" not in str(e):
                    problems.append(f"{name}: {e}")
    agree(world, problems)


def test_ranks_that_ask_for_different_groups_are_told(world):
    if N < 4 or N % 2:
        pytest.skip("needs an even number of ranks >= 4")
    half, problems = N // 2, []
    with strata.init(strata.Mesh(N, pp=2), timeout=120) as w:
        mine = "dp-pp" if w.rank < half else "dp-cp-pp"
        try:
            w.group(mine)
            problems.append("no error")
        except strata.InvalidArgument as e:
            want = (f"ranks disagree on the group to create: ranks 0-{half - 1} asked for "
                    f"'dp-pp', ranks {half}-{N - 1} for 'dp-cp-pp'; every rank must request a "
                    "new group at the same point, as torch.distributed.new_group")
            if want not in str(e):
                problems.append(str(e))
        _check_group(w, w.group("dp-pp"), "dp-pp", problems)
    agree(world, problems)


def test_a_rank_that_never_asks_ends_the_creation_at_its_deadline(world):
    if N < 4 or N % 2:
        pytest.skip("needs an even number of ranks >= 4")
    problems = []
    w = strata.init(strata.Mesh(N, pp=2), timeout=120, group_timeout=2)
    if w.rank == 0:
        time.sleep(6)  # never asks, and keeps its world until the others gave up
        # Then joins the agreement the others abandoned (MPI cannot withdraw
        # a started collective; see world_test.cc); over gloo it times out.
        try:
            w.group().all_reduce(torch.zeros(2, dtype=torch.int64), op="max", timeout=2)
        except strata.CommError:
            pass
    else:
        start = time.monotonic()
        try:
            w.group("dp-pp")
            problems.append("no error")
        except strata.CommError as e:
            if e.code != "DEADLINE_EXCEEDED" or "creating group 'dp-pp' (world generation 1): " \
                    "not every rank requested it within 2s" not in str(e):
                problems.append(f"{e.code}: {e}")
        if time.monotonic() - start > 30:
            problems.append("took too long")
    w.destroy()
    agree(world, problems)


# ---- generations: the world rebuilt in place after ranks left -------------


def _pipeline(w, axes, size):
    """A 1F1B schedule of Linear stages over group `axes`."""
    from strata import pipeline
    torch.manual_seed(0)
    g = w.group(axes)
    stage = pipeline.PipelineStage(torch.nn.Linear(4, 4), g.rank, w, group=axes,
                                   num_stages=size)
    return pipeline.Schedule1F1B(stage, n_microbatches=2,
                                 loss_fn=lambda out, target: ((out - target) ** 2).mean(),
                                 timeout=60)


def _step(schedule):
    torch.manual_seed(1)
    return schedule.step(torch.randn(4, 4), torch.randn(4, 4))


def test_survivors_of_a_leaving_replica_rebuild_the_world(world):
    if N != 8:
        pytest.skip("needs 8 ranks")
    problems = []
    w = strata.init(strata.Mesh(8, tp=2), timeout=120)  # dp 4: replicas {0,1} {2,3} ...
    tp, dp, tp_dp, whole = w.group("tp"), w.group("dp"), w.group("tp-dp"), w.group()
    dp_pinned = dp._pinned("tensor-parallel layer")
    over_tp, over_dp = _pipeline(w, "tp", 2), _pipeline(w, "dp", 4)
    _step(over_tp)
    _step(over_dp)
    old_dp_rank = dp.rank
    if w.rank in (2, 3):
        w.destroy()  # this replica leaves
        try:
            tp.all_reduce(torch.ones(1))
            problems.append("a destroyed world's group worked")
        except strata.CommError:
            pass
    else:
        pending = dp.recv(torch.zeros(1), 1, async_op=True) if w.rank == 0 else None
        root = w.group().shrink([2, 3], name="world")
        w._rebuild(root, strata.Mesh(6, tp=2))
        new_rank = w.rank
        if (w.generation, w.size, new_rank) != (2, 6, world.rank - (2 if world.rank > 3 else 0)):
            problems.append(f"after rebuild: {w!r}")
        if pending is not None:
            try:
                pending.wait(timeout=30)
                problems.append("old work completed")
            except strata.CommError as e:
                if e.code != "ABORTED":
                    problems.append(f"old work: {e.code}: {e}")
        for g, name in ((tp, "tp"), (dp, "dp"), (tp_dp, "tp-dp"), (whole, "world")):
            _check_group(w, g, name, problems)
        for name in w.group_names()[1:]:
            _check_group(w, w.group(name), name, problems)
        try:
            dp_pinned.all_reduce(torch.ones(1))
            problems.append("a pinned group followed a layout change")
        except strata.CommError as e:
            want = (f"group 'dp' was rank {old_dp_rank} of 4 at world generation 1; at "
                    f"generation 2 this rank is rank {new_rank // 2} of 3: this tensor-parallel "
                    "layer was built for the old layout; build a new one")
            if want not in str(e):
                problems.append(str(e))
        _step(over_tp)  # the runner over tp follows (its layout did not change)
        try:
            _step(over_dp)
            problems.append("a runner built for 4 dp ranks ran on 3")
        except strata.PipelineError as e:
            if "this pipeline runner was built for the old layout" not in str(e):
                problems.append(str(e))
        _step(_pipeline(w, "dp", 3))
        w.destroy()
    agree(world, problems)


def _wait_released(ref, seconds=20.0):
    """Whether `ref`'s object is freed within `seconds` (a release from a
    backend thread reaches Python as a pending call, run between bytecodes)."""
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    return ref() is None


def test_tensors_of_a_failed_operation_are_released_with_their_world(world):
    """A receive that failed at its deadline keeps its tensor only as long
    as MPI may write into it: the world that ran it holds it (nothing
    process-wide), and once the message has arrived and the world is
    destroyed, it is freed."""
    if world.group().backend != "mpi":
        pytest.skip("MPI's pending receives (Gloo's are released with their communicator)")
    problems = []
    side = strata.init(timeout=120)  # its root fails at the deadline; `world` stays usable
    t = torch.zeros(4)
    ref = weakref.ref(t)
    if world.rank == 0:
        try:
            side.group().recv(t, src=1, timeout=0.3)
            problems.append("a receive nobody sent to completed")
        except strata.CommError as e:
            if e.code != "DEADLINE_EXCEEDED":
                problems.append(f"{e.code}: {e}")
        del t
        if ref() is None or side._raw._kept() != 1:
            problems.append(f"after the failure: alive {ref() is not None}, kept "
                            f"{side._raw._kept()} (want the world to keep it)")
    world.group().barrier()
    if world.rank == 1:  # the message the failed receive still waits for
        side.group().send(torch.ones(4), dst=0, timeout=30)
    world.group().barrier()
    if world.rank == 0:
        time.sleep(1.0)  # the progress engine completes the orphaned receive
        side.destroy()
        if not _wait_released(ref):
            problems.append("the tensor of a failed receive outlived its world")
    else:
        side.destroy()
    agree(world, problems)


def test_a_dropped_work_keeps_its_tensor_until_the_operation_ends(world):
    """A receive whose Work is dropped while it is in flight keeps its
    tensor (MPI writes into it later): freed once the receive completed;
    when it never completes, kept until its world is destroyed, which
    cancels the receive (MPI_Cancel: MPI then no longer writes into it),
    and freed then."""
    if world.group().backend != "mpi":
        pytest.skip("MPI's pending receives (Gloo's are released with their communicator)")
    problems = []
    side = strata.init(timeout=120)
    t, never = torch.zeros(4), torch.zeros(4)
    ref, never_ref = weakref.ref(t), weakref.ref(never)
    if world.rank == 0:
        side.group().recv(t, src=1, async_op=True)  # the Works are dropped at once
        side.group().recv(never, src=1, async_op=True)
        del t, never
        if ref() is None or never_ref() is None or side._raw._kept() != 2:
            problems.append(f"tensors of receives in flight: alive {ref() is not None}, "
                            f"{never_ref() is not None}; kept {side._raw._kept()}")
    world.group().barrier()
    if world.rank == 1:
        side.group().send(torch.full((4,), 7.0), dst=0, timeout=30)
    world.group().barrier()
    if world.rank == 0:
        deadline = time.monotonic() + 20
        while side._raw._kept() > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        if ref() is not None:
            problems.append("the tensor of a completed receive is still kept")
        if never_ref() is None:
            problems.append("the tensor of a receive in flight was freed before its world")
        side.destroy()
        deadline = time.monotonic() + 10  # released on the main thread (a pending call)
        while never_ref() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        if never_ref() is not None:
            problems.append("the tensor of a receive cancelled with its world is still kept")
    else:
        side.destroy()
    agree(world, problems)
