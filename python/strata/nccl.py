"""The NCCL that strata's nccl backend uses in this process.

One NCCL per process: in a process that imported torch, strata uses the
libnccl torch loaded (the nvidia-nccl wheel's); otherwise it loads one (see
docs/nccl.md). Import torch before creating NCCL communicators, so that no
second copy is loaded::

    import torch
    import strata.nccl
    info = strata.nccl.library()
    print(info["version"], info["path"])   # (2, 30, 7) .../nvidia/nccl/lib/libnccl.so.2
"""

from . import _strata

__all__ = ["library"]


def library(path=""):
    """Resolves (and on the first call loads) the process's libnccl and
    returns ``{"path", "version": (major, minor, patch), "reason"}``.
    ``path`` asks for a file when no NCCL is loaded yet. Raises
    :class:`strata.CommError` when two different libnccl files are loaded,
    when ``path`` names another file than the one in use, or when none can
    be loaded."""
    return _strata._nccl_library(path)
