"""strata: an embeddable distributed-training runtime.

Process-group meshes for DP/TP/PP/CP/EP, communicators on MPI and NCCL,
tensor- and pipeline-parallel building blocks, async sharded checkpoints and
in-process recovery from failed ranks. See README.md and docs/.
"""

from . import errors
from ._strata import LaunchEnv, Mesh, available_backends, launch_env
from ._strata import build_info as _build_info
from ._settings import Setting, settings
from .axes import Axis
from .comm import Group, ReduceOp, Work, World, init
from .errors import (
    CheckpointError,
    CommError,
    Error,
    InvalidArgument,
    LaunchError,
    MeshError,
    PipelineError,
    RankFailure,
    TimeoutError,
    Aborted,
    TopologyError,
    ElasticError,
)

__version__ = _build_info()["version"]


def build_info():
    """What this build of strata contains: ``version`` and the compiled-in
    backends (``cuda``, ``nccl``, ``mpi``, ``ulfm``, ``gloo``: bools). With
    the NCCL backend, ``nccl_library`` is the libnccl this process uses (or
    would load) as :func:`strata.nccl.find` returns it (``path``,
    ``version``, ``source``, ``reason``), or ``{"error": ...}`` when none
    loads; None without the backend."""
    info = dict(_build_info())
    info["nccl_library"] = None
    if info["nccl"]:
        from . import nccl

        try:
            info["nccl_library"] = nccl.find()
        except CommError as e:
            info["nccl_library"] = {"error": str(e)}
    return info

__all__ = [
    "init",
    "World",
    "Group",
    "Work",
    "available_backends",
    "LaunchEnv",
    "Mesh",
    "build_info",
    "launch_env",
    "settings",
    "Setting",
    "errors",
    "metrics",
    "pipeline",
    "timeline",
    "topology",
    "Error",
    "InvalidArgument",
    "LaunchError",
    "MeshError",
    "CommError",
    "RankFailure",
    "TimeoutError",
    "Aborted",
    "ReduceOp",
    "Axis",
    "CheckpointError",
    "PipelineError",
    "TopologyError",
    "ElasticError",
]


def _submodules():
    """The public submodules of the package (strata.checkpoint, strata.nn,
    ...), found on disk, so that a new one needs no entry here."""
    import pkgutil

    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def __getattr__(name):
    # Submodules load on first use, as numpy and scipy load theirs:
    # `import strata` stays cheap and does not import torch (strata.nn,
    # strata.checkpoint and strata.pipeline's executor do), yet
    # `strata.checkpoint.save(...)` works after a plain `import strata`.
    if not name.startswith("_"):
        import importlib.util

        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_submodules()))
