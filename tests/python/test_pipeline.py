"""strata.pipeline from Python: generate, parse, validate, simulate, grid,
layouts, and the errors each raises. References are closed forms computed
here."""

import re

import pytest

import strata
from strata import pipeline

P2 = ("0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1\n"
      "1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0\n")


def test_generate_and_text_round_trip():
    s = pipeline.generate("1f1b", num_ranks=2, num_microbatches=2)
    assert isinstance(s, pipeline.Schedule)
    assert s.to_text() == P2 and str(s) == P2
    assert (s.num_ranks, s.num_stages, s.num_microbatches) == (2, 2, 2)
    assert s.stage_ranks == [0, 1]
    assert s.name == "1F1B p=2 m=2"
    assert s.activation_limit == [2, 1]
    assert s.has_communication and len(s) == 16
    assert s.actions(1)[:2] == ["1RECV_F0<0", "1F0"]
    assert pipeline.parse(s.to_text()) == s
    assert repr(s) == "Schedule('1F1B p=2 m=2', num_ranks=2, num_stages=2, num_microbatches=2)"
    with pytest.raises(IndexError):
        s.actions(2)


def test_compute_order_then_communication():
    order = pipeline.generate("interleaved-1f1b", num_ranks=4, num_microbatches=8,
                              virtual_stages=2, compute_only=True)
    assert not order.has_communication
    assert order.num_stages == 8 and order.stage_ranks == [0, 1, 2, 3] * 2
    full = order.insert_communication()
    assert full == pipeline.generate("interleaved", num_ranks=4, num_microbatches=8,
                                     virtual_stages=2)
    full.validate(communication="required")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 8), (8, 3), (16, 64)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_bubble_of_gpipe_and_1f1b(kind, p, m, backward):
    s = pipeline.generate(kind, num_ranks=p, num_microbatches=m, backward=backward)
    s.validate()
    r = s.simulate(backward=backward)
    assert r.makespan == (m + p - 1) * (1 + backward)
    want = (p - 1) / (m + p - 1)
    assert r.bubble_fraction == pytest.approx([want] * p, abs=1e-12)
    assert r.mean_bubble_fraction == pytest.approx(want, abs=1e-12)
    assert pipeline.bubble_fraction(kind, num_ranks=p, num_microbatches=m) == pytest.approx(want)
    held = [m] * p if kind == "gpipe" else [min(p - r, m) for r in range(p)]
    assert r.peak_in_flight == held == s.peak_in_flight()


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3)])
def test_interleaving_reduces_the_bubble(p, m, v):
    s = pipeline.generate("interleaved-1f1b", num_ranks=p, num_microbatches=m, virtual_stages=v)
    r = s.simulate()
    assert r.makespan == 2 * (v * m + p - 1)
    assert r.mean_bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    plain = pipeline.generate("1f1b", num_ranks=p, num_microbatches=m).simulate()
    assert r.mean_bubble_fraction < plain.mean_bubble_fraction


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_zero_bubble_takes_two_thirds_of_the_bubble_away(p, m):
    equal = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    s = pipeline.generate("zb-h1", num_ranks=p, num_microbatches=m, **equal)
    s.validate()
    assert s.name == f"ZB-H1 p={p} m={m}"
    r = s.simulate(**equal)
    assert r.makespan == 3 * m + p - 1
    assert r.mean_bubble_fraction == pytest.approx(
        pipeline.bubble_fraction("zb-h1", num_ranks=p, num_microbatches=m), abs=1e-12)
    plain = pipeline.generate("1f1b", num_ranks=p, num_microbatches=m).simulate(backward=2.0)
    # Idle time per rank: p - 1 against 1F1B's 3 (p - 1) (B = I + W = 2).
    assert r.makespan - 3 * m == p - 1
    assert plain.makespan - 3 * m == 3 * (p - 1)
    # No rank holds more than 1F1B's rank 0.
    assert max(r.peak_in_flight) == max(plain.peak_in_flight) == min(p, m)
    with pytest.raises(ValueError, match="no closed-form bubble for m = 2 < p = 4"):
        pipeline.bubble_fraction("zb-h1", num_ranks=4, num_microbatches=2)


def test_timeline_and_grid():
    s = pipeline.parse(P2)
    r = s.simulate()
    assert r.timeline[0][0] == (0.0, 1.0)
    assert len(r.timeline[1]) == len(s.actions(1))
    assert s.grid() == ("time   0   1   2   3   4   5\n"
                        "rank 0 0F0 0F1 .   0B0 .   0B1\n"
                        "rank 1 .   1F0 1B0 1F1 1B1 .\n")
    assert pipeline.render_grid(s, r, begin=3, end=5) == ("time   3   4\n"
                                                          "rank 0 0B0 .\n"
                                                          "rank 1 1F1 1B1\n")
    assert "0B0 ~" in s.grid(backward=2.0)


def test_broken_schedules_are_rejected_with_the_reason():
    missing_recv = pipeline.parse(P2.replace("1RECV_F1<0 ", ""))
    with pytest.raises(strata.PipelineError) as e:
        missing_recv.validate()
    assert "but rank 1 has no 1RECV_F1<0 before it" in str(e.value)
    assert e.value.code == "INVALID_ARGUMENT"

    b_before_f = pipeline.parse(P2.replace("1F1 1B1", "1B1 1F1"))
    with pytest.raises(strata.PipelineError, match="comes before its forward"):
        b_before_f.validate()

    # Rank 0 waits for a gradient before sending the forward it depends on.
    crossed = pipeline.parse("0F0 0RECV_B0<1 0SEND_F0>1 0B0\n1RECV_F0<0 1F0 1B0 1SEND_B0>0\n")
    with pytest.raises(strata.PipelineError) as e:
        crossed.validate()
    message = str(e.value)
    assert "deadlock" in message and "the last timesteps:" in message and "rank 1" in message
    with pytest.raises(strata.PipelineError, match="deadlock"):
        crossed.simulate(comm_model="rendezvous")
    crossed.simulate(comm_model="async")  # a receive that never blocks lets it through

    with pytest.raises(strata.PipelineError, match="more than its limit of 1"):
        pipeline.parse(P2).validate(max_in_flight=[1, 1])


def naive(order):
    """Communication inserted the way many hand-written runners do it: each
    receive right before its consumer, each send right after its producer."""
    p = order.num_ranks
    lines = []
    for rank in range(p):
        out = []
        for token in order.actions(rank):
            stage, kind, mb = re.fullmatch(r"(\d+)([FB])(\d+)", token).groups()
            stage = int(stage)
            if kind == "F" and stage > 0:
                out.append(f"{stage}RECV_F{mb}<{stage - 1}")
            if kind == "B" and stage < p - 1:
                out.append(f"{stage}RECV_B{mb}<{stage + 1}")
            out.append(token)
            if kind == "F" and stage < p - 1:
                out.append(f"{stage}SEND_F{mb}>{stage + 1}")
            if kind == "B" and stage > 0:
                out.append(f"{stage}SEND_B{mb}>{stage - 1}")
        lines.append(" ".join(out))
    return pipeline.parse("\n".join(lines) + "\n")


def test_comm_models():
    # Naive 1F1B deadlocks when sends block until received (rank 0 sends
    # microbatch 1 while rank 1 sends gradient 0), runs when they do not.
    s = naive(pipeline.generate("1f1b", num_ranks=2, num_microbatches=3, compute_only=True))
    with pytest.raises(strata.PipelineError) as e:
        s.validate()
    assert "rank 0 action #3 0SEND_F1>1 waits for rank 1 to reach 1RECV_F1<0" in str(e.value)
    s.validate(comm_model="async")
    # GPipe's transfers never cross, so even naive GPipe is fine.
    naive(pipeline.generate("gpipe", num_ranks=3, num_microbatches=3, compute_only=True)).validate()
    with pytest.raises(strata.PipelineError, match="unknown comm model 'eager'"):
        s.validate(comm_model="eager")
    with pytest.raises(strata.PipelineError, match="unknown communication 'maybe'"):
        s.validate(communication="maybe")


def test_generator_refusals():
    with pytest.raises(strata.PipelineError) as e:
        pipeline.generate("interleaved-1f1b", num_ranks=4, num_microbatches=10, virtual_stages=2)
    assert "dependency bubble" in str(e.value)
    assert "microbatch_group_size 5, 6, 10 would work for m = 10" in str(e.value)
    s = pipeline.generate("interleaved-1f1b", num_ranks=4, num_microbatches=10, virtual_stages=2,
                          microbatch_group_size=5)
    s.validate()
    with pytest.raises(strata.PipelineError, match="needs at least p = 4 microbatches"):
        pipeline.generate("interleaved-1f1b", num_ranks=4, num_microbatches=2, virtual_stages=2)
    with pytest.raises(strata.PipelineError, match="unknown schedule kind 'zb-v'"):
        pipeline.generate("zb-v", num_ranks=2, num_microbatches=2)
    with pytest.raises(strata.PipelineError, match="microbatch_group_size is 0"):
        pipeline.generate("interleaved-1f1b", num_ranks=2, num_microbatches=4, virtual_stages=2,
                          microbatch_group_size=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'speed'"):
        pipeline.generate("1f1b", num_ranks=2, num_microbatches=2, speed=3)
    with pytest.raises(strata.PipelineError, match="cost of backward is -1"):
        pipeline.parse(P2).simulate(backward=-1)
    with pytest.raises(ValueError, match="unknown schedule kind"):
        pipeline.bubble_fraction("zb", num_ranks=2, num_microbatches=2)


def test_parse_errors_name_line_and_token():
    with pytest.raises(strata.PipelineError) as e:
        pipeline.parse("0F0 0B0\n1F0 1X0\n")
    assert "line 2 (rank 1), token 2: '1X0': unknown action" in str(e.value)
    assert isinstance(e.value, strata.Error)


def test_layouts():
    layout = pipeline.StageLayout.parse("E t*3 | t*4 | t*4 | t*3 L")
    assert layout.layer_counts == [3, 4, 4, 3] and layout.num_layers == 14
    assert layout.first_layer(2) == 7
    assert str(layout) == "E t*3|t*4|t*4|t*3 L"
    assert layout.describe(2).splitlines()[3] == "stage 3 (rank 1): layers 11-13, loss"
    assert pipeline.StageLayout.balanced(num_layers=16, num_stages=4, embedding_weight=1,
                                         loss_weight=1).layer_counts == [3, 5, 4, 4]
    assert pipeline.StageLayout.from_counts([1, 2, 0]) == pipeline.StageLayout.parse("E t|t*2|L")
    with pytest.raises(strata.PipelineError, match="the embedding E belongs at the start"):
        pipeline.StageLayout.parse("E t | E t L")
    with pytest.raises(IndexError):
        layout.first_layer(4)

    # An uneven layout drives the simulator: GPipe's makespan is the
    # flow-shop sum + (m - 1) max per direction.
    uneven = pipeline.StageLayout.parse("E t*2 | t*3 | t*3 L")
    weights = uneven.stage_weights(embedding=1.0, loss=2.0)
    assert weights == [3.0, 3.0, 5.0]
    s = pipeline.generate("gpipe", num_ranks=3, num_microbatches=4)
    uneven.check_fits(s)
    assert s.simulate(stage_scale=weights).makespan == 2 * (11 + 3 * 5)
    with pytest.raises(strata.PipelineError, match="the layout has 3 stages"):
        uneven.check_fits(pipeline.generate("gpipe", num_ranks=2, num_microbatches=4))
