"""cutemk's ``CUTEMK_*`` environment variables, read strictly: a value that is not one the
variable takes is an error naming the variable, never a silent default (``CUTEMK_EPI_MBARRIER
=off`` used to mean on, ``CUTEMK_SPLIT_REDUCE=tile`` nothing, ``CUTEMK_SMEM_RESERVED=2.5`` a raw
``int()`` error at import). Unset or empty: the default."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """An on / off variable: ``1`` or ``0``."""
    v = os.environ.get(name, "")
    if v == "":
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: use 1 (on) or 0 (off)")
    return v == "1"


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """A variable that names one of ``choices``; None when unset or empty."""
    v = os.environ.get(name, "")
    if v == "":
        return None
    if v not in choices:
        raise ValueError(f"{name}={v!r}: use one of {', '.join(choices)}")
    return v


def env_int(name: str, default: int, minimum: int, multiple: int = 1) -> int:
    """A whole number of at least ``minimum`` (and a multiple of ``multiple``)."""
    v = os.environ.get(name, "")
    if v == "":
        return default
    try:
        n = int(v, 10)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected a whole number") from None
    if n < minimum or n % multiple:
        what = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise ValueError(f"{name}={n}: expected at least {minimum}{what}")
    return n
