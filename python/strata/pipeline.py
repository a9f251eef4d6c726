"""Pipeline schedules as data: generate, validate, simulate, draw and parse.

A schedule lists, for each pipeline rank, the actions of one training step:
``F`` (forward), ``B`` (backward), ``I``/``W`` (split backward),
``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` (transfers, with their peer).
Its text form has one line per rank::

    0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1
    1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0

>>> from strata import pipeline
>>> s = pipeline.generate("1f1b", num_ranks=4, num_microbatches=8)
>>> s.validate()                      # raises strata.PipelineError if not
>>> r = s.simulate(backward=2.0)      # F costs 1, B costs 2
>>> r.makespan, r.bubble_fraction[0]  # (33.0, 3/11)
>>> print(s.grid())                   # rank x timestep picture
>>> pipeline.save_picture(s, "1f1b.png")   # the same as a PNG
>>> pipeline.parse(s.to_text()) == s
True

Simulating and validating calls take the costs as keywords: ``forward``,
``backward``, ``backward_input``, ``backward_weight`` (compute costs, > 0),
``transfer`` (>= 0) and ``stage_scale`` (one multiplier per stage, e.g.
``StageLayout.stage_weights()`` for uneven layouts). See docs/pipeline.md.

Training pipelined (``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleZeroBubble``) is in :mod:`strata.pipeline_exec`, re-exported
here; it imports torch on first use.
"""

from ._strata import pipeline as _core

Schedule = _core.Schedule
SimulationResult = _core.SimulationResult
StageLayout = _core.StageLayout

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
COMM_MODELS = ("rendezvous", "async")


def generate(kind="1f1b", *, num_ranks, num_microbatches, virtual_stages=1,
             microbatch_group_size=None, compute_only=False, **costs):
    """A generated schedule.

    ``kind`` is ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (with
    ``virtual_stages`` stages per rank and ``microbatch_group_size``
    defaulting to ``num_ranks``) or ``"zb-h1"`` (zero bubble: I and W
    placed by simulating the given ``forward``, ``backward_input`` and
    ``backward_weight`` costs). Communication is inserted in a
    deadlock-free order, ordered by the given costs, unless
    ``compute_only``. Options no generator accepts raise
    :class:`strata.PipelineError` saying why.
    """
    return _core.generate(kind, num_ranks=num_ranks, num_microbatches=num_microbatches,
                          virtual_stages=virtual_stages,
                          microbatch_group_size=microbatch_group_size,
                          compute_only=compute_only, **costs)


def parse(text):
    """The schedule in ``text`` (one line per rank; ``#`` starts a comment line)."""
    return _core.parse(text)


def validate(schedule, **kwargs):
    """``schedule.validate(**kwargs)``: raises PipelineError listing every problem."""
    schedule.validate(**kwargs)


def simulate(schedule, **kwargs):
    """``schedule.simulate(**kwargs)``: a :class:`SimulationResult`."""
    return schedule.simulate(**kwargs)


def render_grid(schedule, result, *, unit=None, begin=0.0, end=None):
    """The rank x timestep grid of a simulation result."""
    return _core.render_grid(schedule, result, unit=unit, begin=begin, end=end)


def save_picture(schedule, path, *, result=None, rows=None, title=None, unit=None, **costs):
    """Draws one step of ``schedule`` as a PNG picture at ``path`` (one row
    per rank, a box per forward / backward action labeled with its
    microbatch, idle time left blank) and returns ``path``.

    By default the step is simulated (``costs`` as for :func:`simulate`;
    time in cost units); pass a :class:`SimulationResult` as ``result``, or
    measured ``rows`` (``rows[r]``: rank r's ``(token, start, end)`` in
    seconds, e.g. ``StepStats.timings`` gathered from the ranks).
    Pure Python: no plotting library is needed."""
    from ._picture import render_schedule_png
    if rows is None:
        if result is None:
            result = schedule.simulate(**costs)
        rows = [list(zip(schedule.actions(r), (t[0] for t in result.timeline[r]),
                         (t[1] for t in result.timeline[r])))
                for r in range(schedule.num_ranks)]
        unit = unit or "steps"
    name = getattr(schedule, "name", "pipeline")
    return render_schedule_png(rows, str(path), title=title or name, unit=unit or "s")


def bubble_fraction(kind, *, num_ranks, num_microbatches, virtual_stages=1):
    """The closed-form bubble of a generated schedule with free transfers:
    ``(p - 1) / (v m + p - 1)`` (v = 1 for GPipe and 1F1B), and for zb-h1
    with F, I and W of equal cost and m >= p, ``(p - 1) / (3 m + p - 1)``.
    The simulator measures exactly this; see docs/pipeline.md for when it
    holds."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r} (expected one of {KINDS})")
    p, m = num_ranks, num_microbatches
    if kind == "zb-h1":
        if m < p:
            raise ValueError(f"zb-h1 has no closed-form bubble for m = {m} < p = {p}; "
                             "simulate the schedule")
        return (p - 1) / (3 * m + p - 1)
    v = virtual_stages if kind == "interleaved-1f1b" else 1
    return (p - 1) / (v * m + p - 1)


_EXEC = ("PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
         "ScheduleZeroBubble", "StepStats")


def __getattr__(name):
    # The execution API needs torch; schedules alone do not.
    if name in _EXEC:
        if name == "StepStats":
            return _core.StepStats
        from . import pipeline_exec
        return getattr(pipeline_exec, name)
    raise AttributeError(f"module 'strata.pipeline' has no attribute {name!r}")


__all__ = [
    *_EXEC,
    "Schedule",
    "SimulationResult",
    "StageLayout",
    "KINDS",
    "COMM_MODELS",
    "generate",
    "parse",
    "validate",
    "simulate",
    "render_grid",
    "bubble_fraction",
]
