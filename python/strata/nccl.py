"""The NCCL that strata's nccl backend uses in this process, and why.

One NCCL per process: in a process that imported torch, strata uses the
libnccl torch loaded (the nvidia-nccl wheel's); otherwise it loads one:
``STRATA_NCCL_LIBRARY``, else ``libnccl.so.2`` from the dynamic loader's
search path, else the one strata was built against (the CUDA toolkit's); see
docs/nccl.md. So the same machine can report two versions (the demo, which
imports torch, and ``strata-topo``, which does not); every report names the
file and the reason. Import torch before creating NCCL communicators, so that
no second copy is loaded::

    import torch
    import strata.nccl
    info = strata.nccl.library()
    print(info["version"], info["path"])   # (2, 30, 7) .../nvidia/nccl/lib/libnccl.so.2
    print(info["source"], info["reason"])  # already-loaded  already loaded ... by torch (...)
"""

from . import _strata

__all__ = ["find", "library"]


def library(path=""):
    """Resolves (and on the first call loads) the process's libnccl and
    returns ``{"path", "version": (major, minor, patch), "source", "reason"}``:
    ``path`` is absolute, ``source`` one of "already-loaded", "option",
    "STRATA_NCCL_LIBRARY", "search-path", "built-against", and ``reason`` says
    why that file in words. ``path`` asks for a file when no NCCL is loaded
    yet. Raises :class:`strata.CommError` when two different libnccl files
    are loaded, when ``path`` names another file than the one in use, or when
    none can be loaded."""
    return _strata._nccl_library(path)


def find(path=""):
    """The libnccl this process uses, or would use by the same rule, as
    :func:`library` returns it, without keeping a file it had to open loaded
    (so a later ``import torch`` does not meet a second NCCL). Works in every
    build of strata. Raises :class:`strata.CommError` as :func:`library`."""
    return _strata._nccl_find(path)
