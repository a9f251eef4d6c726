"""The names of the mesh's axes, as one constant set.

``strata.Axis.TP`` is the string ``"tp"`` (an ``Axis`` is a ``str``), so it
goes wherever an axis or group name goes; a typo (``Axis.TPP``) fails where
it is written instead of deep inside a call::

    from strata import Axis
    tp = world.group(Axis.TP)
    tp_dp = world.group((Axis.TP, Axis.DP))      # the group "tp-dp"

Dense axes: ``TP`` (tensor), ``CP`` (context), ``DP`` (data), ``PP``
(pipeline). Expert axes: ``EP`` (expert), ``ETP`` (expert tensor), ``EDP``
(expert data); expert groups combine them with ``PP``.
"""

import enum

__all__ = ["Axis", "group_name"]


class Axis(str, enum.Enum):
    TP = "tp"
    CP = "cp"
    DP = "dp"
    PP = "pp"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)


def group_name(axes):
    """The group name of ``axes``: a name ("tp-dp", "world"), an
    :class:`Axis`, or a sequence of them (joined with '-'). Raises
    :class:`strata.InvalidArgument` for anything else, naming it."""
    from .errors import InvalidArgument

    if isinstance(axes, str):  # an Axis is a str
        return axes.value if isinstance(axes, Axis) else axes
    if isinstance(axes, (list, tuple)) and axes and all(isinstance(a, str) for a in axes):
        return "-".join(a.value if isinstance(a, Axis) else a for a in axes)
    raise InvalidArgument(f"axes must be a group name ('tp', 'dp-cp', 'world'), a strata.Axis or "
                          f"a sequence of them; got {axes!r}")
