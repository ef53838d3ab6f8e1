"""Registries of backends and scheduling policies, so the core looks them up by name and never
imports them: a backend (``cute``, ``interpret``) registers a loader (its module may be heavy:
the cute backend imports CuTe DSL), a policy registers its class. ``cutemk/__init__.py`` does
both for the built-in ones; other packages may add their own.
"""

from __future__ import annotations

from typing import Any, Callable

_BACKENDS: dict[str, Callable[[], Any]] = {}
_SCHEDULERS: dict[str, type] = {}


def register_backend(name: str, loader: Callable[[], Any]) -> None:
    """``loader()`` returns the backend's class, called as ``cls(graph, **options)``."""
    _BACKENDS[name] = loader


def backend(name: str) -> Any:
    try:
        loader = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(_BACKENDS)}") from None
    return loader()


def register_scheduler(cls: type) -> type:
    """Class decorator: make a scheduling policy known by its ``name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"a scheduler class needs a non-empty str ``name``, got {name!r}")
    if name in _SCHEDULERS and _SCHEDULERS[name] is not cls:
        raise ValueError(f"scheduler name {name!r} registered twice")
    _SCHEDULERS[name] = cls
    return cls


def scheduler_classes() -> dict[str, type]:
    return dict(_SCHEDULERS)
