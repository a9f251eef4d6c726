"""strata.pipeline's schedules in one process (a world of one rank, so the
pipeline group has one rank and interleaving puts every stage on it):
results against the unpipelined reference computed here, step statistics,
and every misuse with the error it raises. The multi-rank behaviour is in
mr_pipeline*.py."""

import time

import pytest
import torch

import strata
from strata import pipeline
from pipeline_models import copy_of, loss_fn, make_batch, make_stages, reference_step


@pytest.fixture
def world():
    w = strata.init(timeout=60)
    yield w
    w.destroy()


def grads_equal(a, b, tol=1e-12):
    return all(torch.allclose(x.grad, y.grad, rtol=tol, atol=tol)
               for s, t in zip(a, b) for x, y in zip(s.parameters(), t.parameters()))


@pytest.mark.parametrize("kind,v,m", [("gpipe", 1, 3), ("1f1b", 1, 5), ("interleaved", 3, 4),
                                     ("zb", 1, 4)])
def test_one_rank_equals_unpipelined(world, kind, v, m):
    reference = make_stages(v)
    piped = copy_of(reference)
    stages = [pipeline.PipelineStage(piped[s], s, world) for s in range(v)]
    if kind == "gpipe":
        schedule = pipeline.ScheduleGPipe(stages[0], m, loss_fn)
    elif kind == "1f1b":
        schedule = pipeline.Schedule1F1B(stages[0], m, loss_fn)
    elif kind == "zb":
        schedule = pipeline.ScheduleZeroBubble(stages[0], m, loss_fn)
    else:
        schedule = pipeline.ScheduleInterleaved1F1B(stages, m, loss_fn)
    inputs, targets = make_batch(11)
    before = time.time()
    with torch.no_grad():  # the schedule turns autograd on for its stages
        losses = schedule.step(inputs, targets)
    after = time.time()
    want = reference_step(reference, inputs, targets, m)
    assert len(losses) == m
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(losses, want))
    assert grads_equal(piped, reference)
    stats = schedule.stats
    assert stats.peak_in_flight == schedule.schedule.peak_in_flight()[0]
    assert schedule.peak_live_activations == stats.peak_in_flight
    assert len(stats.timings) == (3 if kind == "zb" else 2) * m * v
    assert [t[0] for t in stats.timings] == [a for a in schedule.schedule.actions(0)]
    assert 0 <= stats.busy_seconds <= stats.step_seconds
    # The wall-clock start puts the ranks' timings on one timeline.
    assert before <= stats.start_time <= stats.start_time + stats.step_seconds <= after
    assert all(0 <= start <= end <= stats.step_seconds for _, start, end in stats.timings)
    assert stats.bubble_fraction == pytest.approx(1 - stats.busy_seconds / stats.step_seconds)
    assert list(stats.losses) == [l.item() for l in losses]


class Tricky(torch.nn.Module):
    """Parameters used in every way the split backward must tell apart."""

    def __init__(self, d=5):
        super().__init__()
        torch.manual_seed(7)
        lin = lambda: torch.nn.Linear(d, d, dtype=torch.float64)  # noqa: E731
        self.a, self.b, self.twice, self.tied = lin(), lin(), lin(), lin()
        self.head = torch.nn.Linear(d, 2, dtype=torch.float64)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = h + self.b(h)                                   # a residual around b
        h = self.twice(torch.tanh(self.twice(h)))           # one module run twice
        t = torch.tanh(self.tied(h))
        # tied.weight again, outside its module and not behind its output.
        return self.head(t + torch.nn.functional.linear(h, self.tied.weight))


def test_zero_bubble_defers_only_what_its_module_output_determines():
    from strata import pipeline_exec as pe
    model = Tricky()
    pe._hook(model)
    pe._RECORDER.records = records = []
    try:
        out = model(torch.randn(4, 5, dtype=torch.float64))
    finally:
        pe._RECORDER.records = None
    names = {id(p): n for n, p in model.named_parameters()}
    deferred = pe._deferrable(records, pe._graph([out.sum()]), list(model.parameters()))
    assert sorted(names[id(p)] for _, ps in deferred for p in ps) == [
        "a.bias", "a.weight", "b.bias", "b.weight", "head.bias", "head.weight", "tied.bias"]


@pytest.mark.parametrize("plain_function", [False, True])
def test_zero_bubble_gradients_equal_the_whole_backward(world, plain_function):
    reference, piped = Tricky(), Tricky()
    # Parameters outside the stage's module: the loss_fn's, and with a plain
    # function as the stage, all of them (nothing is deferred then).
    ref_scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    stage = (lambda x: piped(x)) if plain_function else piped  # noqa: E731
    schedule = pipeline.ScheduleZeroBubble(pipeline.PipelineStage(stage, 0, world), 3,
                                           lambda out, y: ((scale * out - y) ** 2).mean())
    x = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.randn(7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for _ in range(2):  # gradients accumulate over steps too
        losses = schedule.step(x, y)
        for i, (xi, yi) in enumerate(zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3))):
            loss = ((ref_scale * reference(xi) - yi) ** 2).mean()
            (loss / 3).backward()
            assert torch.allclose(losses[i], loss.detach(), rtol=1e-12, atol=1e-12)
    # The step ran split backwards: F, I and W of each of the 3 microbatches.
    assert sorted(token[1] for token, _, _ in schedule.stats.timings) == sorted("FIW" * 3)
    for (name, a), b in zip(piped.named_parameters(), reference.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12), name
    assert torch.allclose(scale.grad, ref_scale.grad, rtol=1e-12, atol=1e-12)


def test_scale_grads_false_sums_and_steps_accumulate(world):
    reference = make_stages(1)
    piped = copy_of(reference)
    schedule = pipeline.Schedule1F1B(pipeline.PipelineStage(piped[0], 0, world), 4, loss_fn,
                                     scale_grads=False)
    inputs, targets = make_batch(9)
    for _ in range(2):
        schedule.step(inputs, targets)
        reference_step(reference, inputs, targets, 4, scale_grads=False)
    assert grads_equal(piped, reference)


def test_stage_and_schedule_arguments_are_checked(world):
    module = make_stages(1)[0]
    with pytest.raises(strata.InvalidArgument, match="module must be a torch.nn.Module"):
        pipeline.PipelineStage("not a module", 0, world)
    with pytest.raises(strata.InvalidArgument, match="stage_index must be an int >= 0, got -1"):
        pipeline.PipelineStage(module, -1, world)
    with pytest.raises(strata.InvalidArgument, match="stage_index must be an int >= 0, got True"):
        pipeline.PipelineStage(module, True, world)
    with pytest.raises(strata.InvalidArgument, match="stage_index 2 is not a stage of 2"):
        pipeline.PipelineStage(module, 2, world, num_stages=2)
    with pytest.raises(strata.InvalidArgument, match="world must be a strata.World"):
        pipeline.PipelineStage(module, 0, object())
    with pytest.raises(strata.InvalidArgument, match="group 'nope' is not a combination"):
        pipeline.PipelineStage(module, 0, world, group="nope")

    stage = pipeline.PipelineStage(module, 0, world)
    with pytest.raises(strata.InvalidArgument, match="n_microbatches must be an int >= 1, got 0"):
        pipeline.Schedule1F1B(stage, 0, loss_fn)
    with pytest.raises(strata.InvalidArgument, match="loss_fn must be callable"):
        pipeline.Schedule1F1B(stage, 2, "mse")
    with pytest.raises(strata.InvalidArgument, match="timeout must be > 0 seconds, got 0"):
        pipeline.Schedule1F1B(stage, 2, loss_fn, timeout=0)
    with pytest.raises(strata.InvalidArgument, match="needs PipelineStage objects"):
        pipeline.ScheduleInterleaved1F1B([module], 2, loss_fn)
    # In a world of one rank every group is the same communicator, named 'tp'.
    name = world.group("pp").name
    with pytest.raises(strata.PipelineError,
                       match=f"rank 0 of pipeline group '{name}' holds stage 0; it was given "
                       "stage 1"):
        pipeline.Schedule1F1B(pipeline.PipelineStage(module, 1, world), 2, loss_fn)
    with pytest.raises(strata.PipelineError,
                       match="holds stages 0, 1; it was given stages 0, 2"):
        pipeline.ScheduleInterleaved1F1B(
            [stage, pipeline.PipelineStage(module, 2, world)], 2, loss_fn)
    with pytest.raises(strata.PipelineError, match="stage 0 was built for 3 stages but "
                       "1F1B p=1 m=2 has 1"):
        pipeline.Schedule1F1B(pipeline.PipelineStage(module, 0, world, num_stages=3), 2, loss_fn)
    # The runner moves host tensors only: a group on CUDA memory is refused
    # before anything is set up.
    class NcclGroup:
        name, backend, memory, rank, size, _raw = "pp", "nccl", "cuda", 0, 1, None
    on_gpu = pipeline.PipelineStage(module, 0, NcclGroup())
    with pytest.raises(strata.InvalidArgument,
                       match="strata.pipeline runs over the host backends \\(mpi, gloo\\); "
                       "pipeline group 'pp' uses nccl \\(cuda memory\\)"):
        pipeline.Schedule1F1B(on_gpu, 2, loss_fn)
    # The generator's refusals come through as they are.
    with pytest.raises(strata.PipelineError, match="microbatch_group_size N = 5 is larger than the number of "
                       "microbatches m = 2"):
        pipeline.ScheduleInterleaved1F1B([stage, pipeline.PipelineStage(module, 1, world)], 2,
                                         loss_fn, microbatch_group_size=5)


def test_step_arguments_are_checked(world):
    schedule = pipeline.Schedule1F1B(pipeline.PipelineStage(make_stages(1)[0], 0, world), 4,
                                     loss_fn)
    inputs, targets = make_batch(6)
    with pytest.raises(strata.InvalidArgument, match="rank 0 holds stage 0: step.. needs inputs"):
        schedule.step(None, targets)
    with pytest.raises(strata.InvalidArgument,
                       match=r"inputs\[0\] has 3 rows along dim 0, fewer than the 4 microbatches"):
        schedule.step((inputs[0][:3], inputs[1]), targets)
    with pytest.raises(strata.InvalidArgument, match=r"inputs\[1\] must be a torch.Tensor"):
        schedule.step((inputs[0], [1, 2, 3, 4]), targets)
    with pytest.raises(strata.InvalidArgument,
                       match="targets has 2 rows along dim 0, fewer than the 4 microbatches"):
        schedule.step(inputs, targets[:2])
    schedule.step(inputs, targets)  # nothing was broken by the refusals


def failing_step(world, module, loss=loss_fn, num_stages=1):
    stages = [pipeline.PipelineStage(module if s == 0 else make_stages(1)[0], s, world)
              for s in range(num_stages)]
    schedule = pipeline.ScheduleInterleaved1F1B(stages, 2, loss)
    inputs, targets = make_batch(4)
    with pytest.raises(strata.PipelineError) as e:
        schedule.step(inputs, targets)
    return e.value


def test_an_exception_in_a_stage_is_the_errors_cause(world):
    class Boom(torch.nn.Module):
        def forward(self, *args):
            raise ZeroDivisionError("boom")

    e = failing_step(world, Boom())
    assert isinstance(e.__cause__, ZeroDivisionError)
    assert e.code == "UNKNOWN"
    assert (f"pipeline rank 0 (world rank 0, group '{world.group('pp').name}') at action #0 0F0 "
            "(stage 0, microbatch 0): forward failed: ZeroDivisionError: boom") in str(e)


def test_what_a_stage_returns_is_checked():
    class Text(torch.nn.Module):
        def forward(self, *args):
            return "text"

    class Complex(torch.nn.Module):
        def forward(self, x, ids):
            return x.to(torch.complex64)

    # A failed step leaves its pipeline group unusable: a world each.
    with strata.init() as w:
        e = failing_step(w, Text(), num_stages=2)
    assert "stage 0 returned str as output 0; stages must return tensors" in str(e)
    assert e.code == "INVALID_ARGUMENT"
    with strata.init() as w:
        e = failing_step(w, Complex(), num_stages=2)
    assert "stage 0's output 0 has dtype torch.complex64, which strata cannot send" in str(e)
    class Elsewhere(torch.nn.Module):  # a device the host backend cannot send from
        def forward(self, x, ids):
            return x.to("meta")

    with strata.init() as w:
        e = failing_step(w, Elsewhere(), num_stages=2)
    assert "stage 0's output 0 is on meta; the mpi backend sends cpu tensors" in str(e)
    with strata.init() as w:
        e = failing_step(w, make_stages(1)[0], loss=lambda out, y: out - y)
    assert "loss_fn must return a tensor of one element" in str(e)


def test_keyboard_interrupt_goes_through(world):
    class Interrupted(torch.nn.Module):
        def forward(self, *args):
            raise KeyboardInterrupt

    schedule = pipeline.Schedule1F1B(pipeline.PipelineStage(Interrupted(), 0, world), 2, loss_fn)
    inputs, targets = make_batch(4)
    with pytest.raises(KeyboardInterrupt):
        schedule.step(inputs, targets)


def test_a_destroyed_world_is_refused():
    w = strata.init()
    schedule = pipeline.Schedule1F1B(pipeline.PipelineStage(make_stages(1)[0], 0, w), 2, loss_fn)
    w.destroy()
    inputs, targets = make_batch(4)
    with pytest.raises(strata.PipelineError, match="world was destroyed"):
        schedule.step(inputs, targets)


def test_lazy_exports():
    assert pipeline.StepStats is strata._strata.pipeline.StepStats
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pipeline.Nope
