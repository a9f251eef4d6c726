"""The strata exception hierarchy.

Every error strata raises is a :class:`strata.Error`. The C++ core reports
``absl::Status`` values; one mapper (``python/src/status_map.cc``) turns them
into these classes, and sets ``code`` to the canonical status code name
(``"INVALID_ARGUMENT"``, ``"DEADLINE_EXCEEDED"``, ...).
"""


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


class CheckpointError(Error, RuntimeError):
    """A checkpoint could not be saved, committed, verified or loaded."""


class PipelineError(Error, RuntimeError):
    """A pipeline schedule is invalid or its execution failed."""


class TopologyError(Error, RuntimeError):
    """The machine's topology could not be read or parsed."""


__all__ = [
    "Error",
    "InvalidArgument",
    "LaunchError",
    "MeshError",
    "CommError",
    "RankFailure",
    "CheckpointError",
    "PipelineError",
    "TopologyError",
]
