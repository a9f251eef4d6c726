"""strata: an embeddable distributed-training runtime.

Process-group meshes for DP/TP/PP/CP/EP, communicators on MPI and NCCL,
tensor- and pipeline-parallel building blocks, async sharded checkpoints and
in-process recovery from failed ranks. See README.md and docs/.
"""

from . import errors, pipeline
from ._strata import LaunchEnv, Mesh, available_backends, build_info, launch_env
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

__version__ = build_info()["version"]

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
    # strata.nn imports torch, so it is loaded on first use rather than by
    # `import strata`.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
