"""The strata exception hierarchy.

Every error strata raises is a :class:`strata.Error`. The C++ core reports
``absl::Status`` values; one mapper (``python/src/status_map.cc``) turns them
into these classes, and sets ``code`` to the canonical status code name
(``"INVALID_ARGUMENT"``, ``"DEADLINE_EXCEEDED"``, ...).

The class is chosen by what happened first: a peer rank that failed is a
:class:`RankFailure`, a deadline that passed a :class:`TimeoutError` (a
collective, a group's creation, a checkpoint's agreement alike), a revoked
or aborted communicator an :class:`Aborted`, misuse of a communicator an
:class:`InvalidArgument`. Where such an error surfaces in an area with its
own class, it is an instance of both: a checkpoint agreement that timed
out is a ``strata.TimeoutError`` that ``except strata.CheckpointError``
also catches. Anything else is the error of its area
(:class:`CheckpointError`, :class:`PipelineError`, ...).
"""

import builtins


class Error(Exception):
    """Base class of every strata error."""

    code = "UNKNOWN"


class InvalidArgument(Error, ValueError):
    """A value given to strata is not valid."""

    code = "INVALID_ARGUMENT"


class LaunchError(Error, ValueError):
    """The launcher's environment is inconsistent or incomplete."""


class MeshError(Error, ValueError):
    """A mesh specification is invalid (sizes, order, expert layout)."""


class CommError(Error, RuntimeError):
    """A collective or point-to-point operation failed or timed out."""


class RankFailure(CommError):
    """A peer rank failed; the communicator must be shrunk or rebuilt."""

    code = "UNAVAILABLE"


class TimeoutError(CommError, builtins.TimeoutError):  # noqa: A001 (strata.TimeoutError)
    """A deadline passed: an operation, a group's creation, a store wait or a
    checkpoint's agreement did not complete in time (some rank never took
    part, or is stuck). The message names the rank, the group and the
    operation."""

    code = "DEADLINE_EXCEEDED"


class Aborted(CommError):
    """The communicator was aborted or revoked (by this rank, a peer, or the
    elastic layer) while the operation ran or before it started."""

    code = "ABORTED"


class CheckpointError(Error, RuntimeError):
    """A checkpoint could not be saved, committed, verified or loaded."""


class PipelineError(Error, RuntimeError):
    """A pipeline schedule is invalid or its execution failed."""


class TopologyError(Error, RuntimeError):
    """The machine's topology could not be read or parsed."""


class ElasticError(Error, RuntimeError):
    """A recovery could not go on: this rank's partition is a minority, no
    complete model replica is left, this rank was taken as failed by the
    others, or the agreement's deadline passed. The message says which."""


_COMBINED = {}


def _error_class(kind, area):
    """The class the status mapper raises for an error of ``kind`` (chosen by
    what happened) surfacing in ``area``: a subclass of both, made once."""
    if issubclass(kind, area):
        return kind
    cls = _COMBINED.get((kind, area))
    if cls is None:
        cls = type(kind.__name__, (kind, area), {
            "__module__": __name__,
            "__doc__": f"A {kind.__name__} in the area of {area.__name__}: an instance of both.",
            "code": kind.code,
        })
        _COMBINED[(kind, area)] = cls
    return cls


__all__ = [
    "Error",
    "InvalidArgument",
    "LaunchError",
    "MeshError",
    "CommError",
    "RankFailure",
    "TimeoutError",
    "Aborted",
    "CheckpointError",
    "PipelineError",
    "TopologyError",
    "ElasticError",
]
