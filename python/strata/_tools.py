"""The console commands of the pip-installed package: ``strata-topo`` and
``strata-ckpt`` run the binaries that ``pip install .`` built into
``strata/bin`` (beside the package's libstrata, which they link)."""

import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def _run(name):
    path = os.path.join(_BIN, name)
    if not os.access(path, os.X_OK):
        sys.exit(f"{name}: {path} is missing: this copy of strata was not installed by "
                 f"`pip install .` (in a build tree the tools are build/tools/strata-topo "
                 f"and build/bin/strata-ckpt)")
    os.execv(path, [name] + sys.argv[1:])


def topo():
    _run("strata-topo")


def ckpt():
    _run("strata-ckpt")
