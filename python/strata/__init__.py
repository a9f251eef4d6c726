"""strata: an embeddable distributed-training runtime.

Process-group meshes for DP/TP/PP/CP/EP, communicators on MPI and NCCL,
tensor- and pipeline-parallel building blocks, async sharded checkpoints and
in-process recovery from failed ranks. See README.md and docs/.
"""

from . import errors, pipeline
from ._strata import LaunchEnv, Mesh, available_backends, launch_env
from ._strata import build_info as _build_info
from .comm import Group, Work, World, init
from .errors import (
    CheckpointError,
    CommError,
    Error,
    InvalidArgument,
    LaunchError,
    MeshError,
    PipelineError,
    RankFailure,
    TopologyError,
)
from . import topology  # noqa: E402  (needs _strata loaded)
from . import store  # noqa: E402  (needs _strata loaded)

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
    "errors",
    "pipeline",
    "topology",
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


def __getattr__(name):
    # strata.nn and strata.optim import torch, so they are loaded on first
    # use rather than by `import strata`.
    if name in ("nn", "optim"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
