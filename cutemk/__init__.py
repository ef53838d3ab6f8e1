"""cutemk: event-tensor megakernels on NVIDIA CuTe DSL.

Build a :class:`Graph` of tile operators (``cutemk.ops``) over symbolic shapes, then compile it
for a backend. Core modules never import concrete ops or models; ``cutemk.layers`` (Qwen3 MLP
and MoE graphs) and ``cutemk.nn`` (``MegaMLP``, a drop-in for Hugging Face MLPs) sit on top;
``cutemk.nn`` is imported on first access, so ``import cutemk`` does not import the ops.
"""

from .arch import pin_arch as _pin_arch

_pin_arch()  # before anything imports cutlass (it reads the target arch once, at import)

from .errors import (
    CuteMKError,
    DataError,
    DeadlockError,
    DeviceError,
    DTypeError,
    GraphError,
    LayoutError,
    RaceError,
    ScheduleError,
    ShapeError,
    UnsupportedArchError,
)
from .events import EventTensor
from .graph import Graph, Node, Value
from .plan import Plan, instantiate
from .scheduling import (
    SchedulingMode,
    StaticSchedule,
    check_static_schedule,
    critical_path,
    resolve_scheduler,
)
from .symbolic import Expr, Sym, cdiv, smax, smin, sym
from .tileop import TensorSpec, TileOp, register_op

from . import registry as _registry


def _interpret_backend():
    from .interpret import InterpretedGraph

    return InterpretedGraph


def _cute_backend():
    from .runtime import CuteGraph  # imports CuTe DSL: only when a graph is compiled for it

    return CuteGraph


_registry.register_backend("interpret", _interpret_backend)
_registry.register_backend("cute", _cute_backend)
from . import schedulers as _schedulers  # noqa: E402,F401  (the policies register themselves)

__version__ = "0.1.0"


def __getattr__(name: str):
    # PEP 562: ``cutemk.nn`` imports the concrete ops (through cutemk.layers), which the core
    # never does; load it only when asked for, after the core is fully initialised.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    if name == "warmup":
        from .prepare import warmup

        return warmup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CuteMKError",
    "DataError",
    "DeadlockError",
    "DeviceError",
    "DTypeError",
    "GraphError",
    "LayoutError",
    "RaceError",
    "ScheduleError",
    "ShapeError",
    "UnsupportedArchError",
    "EventTensor",
    "Graph",
    "Node",
    "Value",
    "Plan",
    "instantiate",
    "SchedulingMode",
    "StaticSchedule",
    "check_static_schedule",
    "critical_path",
    "resolve_scheduler",
    "Expr",
    "Sym",
    "cdiv",
    "smax",
    "smin",
    "sym",
    "TensorSpec",
    "TileOp",
    "register_op",
]
