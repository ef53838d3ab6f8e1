"""Exception hierarchy of cutemk.

Every user-facing error derives from :class:`CuteMKError` and carries the facts in its message
(which argument, expected vs got). Errors about bad arguments also derive from the built-in
``ValueError``/``TypeError`` so ordinary ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class CuteMKError(Exception):
    """Base class of every error raised by cutemk."""


class GraphError(CuteMKError, ValueError):
    """The graph is malformed (unknown value, cycle, output never produced, ...)."""


class ShapeError(CuteMKError, ValueError):
    """A tensor has the wrong shape, or a symbolic dimension is out of its declared range."""


class DTypeError(CuteMKError, TypeError):
    """A tensor has the wrong dtype."""


class DeviceError(CuteMKError, ValueError):
    """A tensor lives on the wrong device, or tensors are spread over several devices."""


class LayoutError(CuteMKError, ValueError):
    """A tensor is non-contiguous or misaligned where the kernel needs it contiguous/aligned."""


class ScheduleError(CuteMKError):
    """A schedule is invalid: a task missing or repeated, or a cross-SM wait cycle."""


class DeadlockError(CuteMKError):
    """Execution stopped with tasks still waiting on events that can no longer be notified."""


class RaceError(CuteMKError):
    """A task read data that no producer ordered before it (by notify -> wait) had written."""


class UnsupportedArchError(CuteMKError):
    """The requested GPU architecture has no code path."""


class DataError(CuteMKError, ValueError):
    """Values computed or passed at run time that an op cannot use (e.g. an expert id outside
    the layer's experts)."""
