"""strata's own environment variables (``STRATA_*``), from the one registry
of the C++ library (strata/base/settings.h; docs/settings.md lists them).
Python reads a ``STRATA_*`` variable only through :func:`settings`."""

import collections

from . import _strata

Setting = collections.namedtuple(
    "Setting", ["name", "value", "source", "default", "type", "choices", "meaning", "doc"])
Setting.__doc__ = """One setting: ``value`` as the environment spells it ("" when unset),
``source`` "environment" or "default", the ``default`` value, its ``type``
("bool", "choice", "path", "text") and accepted ``choices``, what it does
(``meaning``) and the page that documents it (``doc``)."""


def settings(env=None):
    """Every ``STRATA_*`` setting in ``env`` (default ``os.environ``), by name:
    ``{"STRATA_GLOO_CMA": Setting(value="0", source="environment", ...), ...}``.

    Raises :class:`strata.InvalidArgument` naming a variable whose value its
    type does not take (``STRATA_GLOO_CMA='maybe' is not a boolean
    (0/1/true/false)``): strata never replaces a bad value by a default."""
    return {d["name"]: Setting(**d) for d in _strata.settings(None if env is None else dict(env))}
