"""strata.init and the communicators in one process (a world of one rank):
every operation on torch tensors and numpy arrays, and every error a user
can cause from Python."""

import pkgutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import strata


@pytest.fixture(scope="module")
def world():
    w = strata.init(timeout=30)
    yield w
    w.destroy()


def test_import_needs_no_launcher():
    assert "mpi" in strata.available_backends()
    assert strata.build_info()["mpi"]


def test_world_of_one(world):
    assert (world.rank, world.size) == (0, 1)
    assert world.mesh.world_size == 1
    assert world.group_names()[:3] == ["world", "tp", "cp"]
    g = world.group("tp")
    assert (g.rank, g.size, g.name, g.backend) == (0, 1, "tp", "mpi")
    assert g.transport == "mpi"
    assert world.group("cp-dp") is not None
    assert "rank 0 of 1" in repr(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.uint8, torch.int32, torch.int64])
def test_every_operation_on_torch(world, dtype):
    g = world.group()
    x = torch.arange(8).to(dtype)
    g.all_reduce(x, op="max")
    g.broadcast(x, src=0)
    g.reduce(x, dst=0, op="sum")
    out = torch.zeros(8, dtype=dtype)
    g.all_gather(out, x)
    assert torch.equal(out, x)
    rs = torch.zeros(8, dtype=dtype)
    g.reduce_scatter(rs, x, op="min")
    assert torch.equal(rs, x)
    a2a = torch.zeros(8, dtype=dtype)
    g.all_to_all_single(a2a, x)
    assert torch.equal(a2a, x)
    g.all_to_all_single(a2a, x, output_split_sizes=[8], input_split_sizes=[8])
    g.barrier()
    assert torch.equal(x, torch.arange(8).to(dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "uint8", "int32",
                                   "int64"])
def test_every_operation_on_numpy(world, dtype):
    g = world.group("dp")
    x = np.arange(6).astype(dtype).reshape(2, 3)
    g.all_reduce(x, op="sum")
    out = np.zeros_like(x)
    g.all_gather(out, x)
    np.testing.assert_array_equal(out, x)
    work = g.recv(out, 0, async_op=True)
    g.send(x * 2, 0)
    assert work.wait(timeout=10)
    np.testing.assert_array_equal(out, x * 2)


def test_async_work_and_deadline(world):
    g = world.group()
    r = torch.zeros(3)
    work = g.recv(r, 0, async_op=True)
    assert not work.is_completed()
    with pytest.raises(strata.CommError) as e:
        work.wait(timeout=0.05)
    assert e.value.code == "DEADLINE_EXCEEDED"
    assert "recv(peer 0, 3 x fp32) on group world (rank 0 of 1" in str(e.value)
    g.send(torch.tensor([1.0, 2.0, 3.0]), 0)
    assert work.wait()
    assert work.is_completed()
    assert r.tolist() == [1.0, 2.0, 3.0]


def test_user_errors_are_named(world):
    g = world.group()
    with pytest.raises(strata.InvalidArgument, match="must be contiguous"):
        g.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(strata.InvalidArgument, match="C-contiguous"):
        g.all_reduce(np.ones((4, 4))[:, ::2])
    with pytest.raises(strata.InvalidArgument, match="read-only"):
        a = np.ones(4)
        a.flags.writeable = False
        g.all_reduce(a)
    with pytest.raises(strata.InvalidArgument, match="expected a torch CPU tensor or a numpy"):
        g.all_reduce([1.0, 2.0])
    with pytest.raises(strata.InvalidArgument, match="avg is not defined for integer dtype int32"):
        g.all_reduce(torch.ones(4, dtype=torch.int32), op="avg")
    with pytest.raises(strata.InvalidArgument, match="unknown reduce op 'median'"):
        g.all_reduce(torch.ones(4), op="median")
    with pytest.raises(strata.InvalidArgument, match="peer 3 is out of range"):
        g.send(torch.ones(1), 3)
    with pytest.raises(strata.InvalidArgument, match="must hold 1 x 4 = 4 elements"):
        g.all_gather(torch.zeros(5), torch.ones(4))
    with pytest.raises(strata.InvalidArgument, match="requires grad"):
        g.all_reduce(torch.ones(2, requires_grad=True))
    with pytest.raises(strata.InvalidArgument, match="send_counts has 2 entries"):
        world.group().all_to_all_single(torch.zeros(3), torch.zeros(3), input_split_sizes=[1, 2])
    with pytest.raises(strata.InvalidArgument, match="at least one dimension"):
        world.group().all_to_all_single(torch.zeros(()), torch.zeros(()), input_split_sizes=[1])
    with pytest.raises(strata.InvalidArgument, match="names axis tp twice"):
        world.group("tp-tp")
    with pytest.raises(strata.InvalidArgument, match="cannot be mixed"):
        world.group("ep-dp")
    assert issubclass(strata.InvalidArgument, ValueError)


def test_init_errors():
    with pytest.raises(strata.MeshError, match="the mesh is for 2 ranks but the job has 1"):
        strata.init(strata.Mesh(2))
    # No GPU here: the nccl backend says so (or that it is not built).
    with pytest.raises(strata.CommError, match="no CUDA device|not in this build"):
        strata.init(backend="nccl")
    with pytest.raises(strata.InvalidArgument, match="unknown backend 'tcp'"):
        strata.init(backend="tcp")
    with pytest.raises(strata.InvalidArgument, match="mesh must be a strata.Mesh"):
        strata.init(mesh={"tp": 2})


def test_worlds_are_rebuilt_and_destroyed():
    for _ in range(3):
        with strata.init() as w:
            x = torch.ones(4)
            w.group("dp").all_reduce(x)
            g = w.group("dp")
        with pytest.raises(strata.CommError, match="destroyed"):
            g.all_reduce(x)
        w.destroy()  # idempotent


def test_abort_revoke_shrink_split(world):
    g = world.group()
    part = g.split(0, name="part")
    assert part.size == 1 and part.name == "part"
    assert g.split(-1) is None
    shrunk = part.shrink([], name="copy")
    assert shrunk.size == 1
    shrunk.revoke()
    with pytest.raises(strata.CommError) as e:
        shrunk.barrier()
    assert e.value.code == "ABORTED"
    r = torch.zeros(1)
    work = part.recv(r, 0, async_op=True)
    part.abort()
    with pytest.raises(strata.CommError, match="aborted"):
        work.wait(timeout=10)
    with pytest.raises(strata.CommError, match="was aborted"):
        part.check()


# ---- torch.distributed's conventions ------------------------------------------


def test_reduce_ops_from_torch_and_strata(world):
    import torch.distributed as dist

    g = world.group()
    for op, want in [(dist.ReduceOp.SUM, 5.0), (dist.ReduceOp.MAX, 5.0),
                     (dist.ReduceOp.AVG, 5.0), (strata.ReduceOp.PRODUCT, 5.0), ("min", 5.0)]:
        x = torch.full((4,), 5.0)
        g.all_reduce(x, op=op)
        assert torch.equal(x, torch.full((4,), want)), op
    with pytest.raises(strata.InvalidArgument, match=r"ReduceOp.BAND is not supported"):
        g.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
    with pytest.raises(strata.InvalidArgument, match="op must be a strata.ReduceOp.*builtins.int"):
        g.all_reduce(torch.ones(2), op=3)
    with pytest.raises(strata.InvalidArgument, match="unknown reduce op 'median'"):
        g.all_reduce(torch.ones(2), op="median")


def test_timeouts_take_timedelta_or_seconds_and_expire_as_timeout_error(world):
    import datetime

    r = torch.zeros(1)
    # Nothing is sent, so the receive can only end at its deadline; a passed
    # operation deadline breaks the communicator, so each part has its own.
    doomed = world.group().split(0, name="doomed")
    with pytest.raises(strata.TimeoutError, match="recv") as e:
        doomed.recv(r, src=0, timeout=datetime.timedelta(milliseconds=200))
    assert e.value.code == "DEADLINE_EXCEEDED"
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, strata.CommError)
    g = world.group().split(0, name="waits")
    # A wait's own timeout leaves the operation in flight.
    work = g.recv(r, src=0, async_op=True)
    with pytest.raises(strata.TimeoutError):
        work.wait(timeout=0.2)
    g.send(torch.ones(1), dst=0)
    assert work.wait(timeout=datetime.timedelta(seconds=10))
    assert r.item() == 1.0
    with pytest.raises(strata.InvalidArgument, match="timeout must be a datetime.timedelta"):
        g.barrier(timeout="soon")
    with pytest.raises(strata.InvalidArgument, match="timeout must be positive"):
        g.barrier(timeout=datetime.timedelta(0))


def test_all_gather_and_reduce_scatter_take_lists_as_torch_does(world):
    g = world.group()
    x = torch.arange(6.0).reshape(2, 3)
    outs = [torch.zeros(2, 3)]
    g.all_gather(outs, x)
    assert torch.equal(outs[0], x)
    out = torch.zeros(2, 3)
    work = g.reduce_scatter(out, [x], op=strata.ReduceOp.SUM, async_op=True)
    work.wait()
    assert torch.equal(out, x)
    transposed = [torch.zeros(3, 2).t()]  # not contiguous: filled through copy_
    g.all_gather(transposed, x)
    assert torch.equal(transposed[0], x)
    with pytest.raises(strata.InvalidArgument, match="output has 2 tensors, the group world has 1"):
        g.all_gather([torch.zeros(6), torch.zeros(6)], x)
    with pytest.raises(strata.InvalidArgument, match=r"output\[0\] has 4 elements, input has 6"):
        g.all_gather([torch.zeros(4)], x)


# ---- first contacts -------------------------------------------------------


def test_every_combination_of_axes_is_a_group():
    """world.group("tp-dp") (Megatron-Core's tensor-and-data-parallel group)
    failed with "no group 'tp-dp' in this world" at 3f6f648."""
    with strata.init(timeout=30) as w:
        g = w.group("tp-dp")
        assert (g.name, g.rank, g.size) == ("tp-dp", 0, 1)
        x = torch.ones(3)
        g.all_reduce(x)
        assert x.tolist() == [1.0, 1.0, 1.0]
        assert w.group("dp-tp").name == "tp-dp"


STANDARD = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp", "ep", "etp", "edp", "etp-ep"]


def test_a_group_reports_the_name_it_was_asked_by():
    """In a world of one every group shares one communicator; at 3f6f648
    world.group("pp") printed as <strata.Group cp: rank 0 of 1 (mpi)>."""
    with strata.init(timeout=30) as w:
        spellings = {n: n for n in STANDARD}
        spellings.update({"cp-dp": "dp-cp", "pp-tp": "tp-pp", "ep-etp": "etp-ep",
                          "pp-cp-tp": "tp-cp-pp"})
        for asked, want in spellings.items():
            g = w.group(asked)
            assert g.name == want, asked
            assert repr(g) == f"<strata.Group {want}: rank 0 of 1 (mpi)>"
            # ... and in the errors of its operations.
            with pytest.raises(strata.InvalidArgument) as e:
                g.send(torch.ones(1), 5)
            assert f"on group {want} (rank 0 of 1, world rank 0)" in str(e.value), str(e.value)
            work = g.recv(torch.zeros(1), 0, async_op=True)
            with pytest.raises(strata.CommError) as e:
                work.wait(timeout=0.01)
            assert f"on group {want} (rank 0 of 1" in str(e.value), str(e.value)
            g.send(torch.ones(1), 0)
            work.wait()


SUBMODULES = ["checkpoint", "nn", "pipeline", "topology", "store", "nccl"]


def _fresh(code):
    """Runs `code` in a fresh interpreter (the package's state as a user
    finds it after `import strata`)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_import_strata_does_not_import_torch():
    _fresh("import strata, sys; assert 'torch' not in sys.modules, 'torch imported'")


@pytest.mark.parametrize("name", SUBMODULES)
def test_submodules_are_attributes_after_import_strata(name):
    """`import strata` then `strata.checkpoint.save(...)` raised
    AttributeError at 3f6f648."""
    _fresh(f"import strata; m = strata.{name}; assert m.__name__ == 'strata.{name}', m")


def test_every_public_submodule_is_reached_lazily():
    # The mechanism has no list: every public module of the package (those
    # to come too) is an attribute, loaded on first use.
    found = sorted(m.name for m in pkgutil.iter_modules(strata.__path__)
                   if not m.name.startswith("_"))
    assert set(SUBMODULES) <= set(found)
    _fresh("import strata, sys\n"
           f"for n in {found!r}:\n"
           "    assert f'strata.{n}' not in sys.modules or n in ('comm', 'errors', 'axes'), n\n"
           "    assert getattr(strata, n).__name__ == f'strata.{n}'\n"
           "assert callable(strata.checkpoint.save)\n"
           "assert set(dir(strata)) >= set(" + repr(found) + ")\n")
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        strata.no_such_module


# ---- generations ------------------------------------------------------------


def test_rebuild_in_one_process():
    with strata.init(timeout=30) as w:
        assert w.generation == 1
        tp, tp_dp, whole = w.group("tp"), w.group("tp-dp"), w.group()
        pinned = tp._pinned("tensor-parallel layer")
        pending = tp.recv(torch.zeros(1), 0, async_op=True)
        root = w.group().shrink([], name="world")
        w._rebuild(root, w.mesh)
        assert w.generation == 2
        with pytest.raises(strata.CommError) as e:
            pending.wait(timeout=10)
        assert e.value.code == "ABORTED" and "on group tp (" in str(e.value)
        # The groups taken before follow.
        for g in (tp, tp_dp, whole, pinned):
            x = torch.ones(2)
            g.all_reduce(x)
            assert x.tolist() == [1.0, 1.0] and g.size == 1
        assert tp.name == "tp" and whole.name == "world"
        # The root's Group object was taken over.
        with pytest.raises(strata.CommError, match="became the root of world generation 2"):
            root.barrier()
        with pytest.raises(strata.InvalidArgument, match="made by shrink or split"):
            w._rebuild(w.group("dp"), w.mesh)
        with pytest.raises(strata.InvalidArgument, match="mesh must be a strata.Mesh"):
            w._rebuild(w.group().shrink([]), None)

        # A rebuild that fails leaves the world saying so; groups cannot
        # follow it and name both generations.
        broken = w.group().shrink([], name="world")
        broken.abort()
        with pytest.raises(strata.CommError, match="rebuilding the World to generation 3"):
            w._rebuild(broken, w.mesh)
        assert w.generation == 3
        with pytest.raises(strata.CommError) as e:
            tp.all_reduce(torch.ones(1))
        assert "group 'tp' (last used at world generation 2) cannot follow the world to " \
            "generation 3" in str(e.value), str(e.value)
        assert "its rebuild failed" in str(e.value)
        w._abort_all()  # from any thread; here, on a broken world, it does nothing harmful


def test_groups_of_a_destroyed_world_say_so():
    w = strata.init(timeout=30)
    g = w.group("tp")
    w.destroy()
    with pytest.raises(strata.CommError, match="group 'tp': its world was destroyed"):
        g.all_reduce(torch.ones(1))
    assert "unusable" in repr(g) and "destroyed" in repr(w)


def test_axes_are_one_constant_set(world):
    assert strata.Axis.TP == "tp" and f"{strata.Axis.DP}" == "dp" and str(strata.Axis.PP) == "pp"
    assert world.group(strata.Axis.PP).name == "pp"
    assert world.group((strata.Axis.TP, strata.Axis.DP)).name == "tp-dp"
    assert world.group([strata.Axis.CP, "dp"]).name == "dp-cp"
    with pytest.raises(AttributeError):
        strata.Axis.TPP  # a typo fails where it is written
    with pytest.raises(strata.InvalidArgument, match="axes must be a group name"):
        world.group(3)
    with pytest.raises(strata.InvalidArgument, match="'tpp'"):
        world.group("tpp")


def test_errors_are_chosen_by_what_happened_and_keep_their_area():
    from strata.errors import _error_class

    cls = _error_class(strata.TimeoutError, strata.CheckpointError)
    e = cls("checkpoint agreement (write): allreduce ... did not complete")
    assert isinstance(e, strata.TimeoutError) and isinstance(e, TimeoutError)
    assert isinstance(e, strata.CheckpointError) and isinstance(e, strata.CommError)
    assert e.code == "DEADLINE_EXCEEDED"
    assert _error_class(strata.TimeoutError, strata.CheckpointError) is cls
    assert _error_class(strata.Aborted, strata.CommError) is strata.Aborted
    assert isinstance(_error_class(strata.Aborted, strata.PipelineError)("x"), strata.PipelineError)
