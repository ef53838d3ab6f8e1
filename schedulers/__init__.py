"""Scheduling policies. Each policy is one file and follows ``cutemk.scheduling``'s protocol."""

from .dynamic import DynamicScheduler
from .static import StaticScheduler

BY_NAME = {"static": StaticScheduler, "dynamic": DynamicScheduler}

__all__ = ["StaticScheduler", "DynamicScheduler", "BY_NAME"]
