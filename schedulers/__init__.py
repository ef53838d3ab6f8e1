"""Scheduling policies. Each policy is one file and follows ``cutemk.scheduling``'s protocol;
each registers itself by name (``cutemk.registry.register_scheduler``), which is how
``Graph.compile(scheduler="static" | "dynamic")`` finds it."""

from .dynamic import DynamicScheduler
from .static import StaticScheduler

__all__ = ["StaticScheduler", "DynamicScheduler"]
