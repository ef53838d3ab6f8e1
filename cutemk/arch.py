"""The one architecture switch.

CuTe DSL reads its target arch (``CUTE_DSL_ARCH``) once, when ``cutlass`` is first imported, so
cutemk pins it before any of its modules import cutlass: the GPU's own arch where a GPU is
visible, else sm_90a (the H200 every cutemk number is measured on), so a CPU-only machine
compiles what the H200 will run. Arch-specific code asks :func:`target_arch` and keeps its
per-arch branches behind :data:`SUPPORTED`; a Blackwell (sm_100a) path is added there.
"""

from __future__ import annotations

import os

from .errors import UnsupportedArchError

SUPPORTED = ("sm_90a",)
DEFAULT_ARCH = "sm_90a"


def _detect() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            suffix = "a" if major >= 9 else ""
            return f"sm_{major}{minor}{suffix}"
    except Exception:  # no usable CUDA: compile for the default target
        pass
    return DEFAULT_ARCH


def pin_arch() -> str:
    """Set ``CUTE_DSL_ARCH`` unless the user did; returns the arch in effect.

    Also points CuTe DSL's on-disk compile cache at a per-user directory that survives reboots
    (its default lives under /tmp), unless ``CUTE_DSL_CACHE_DIR`` is set.
    """
    if "CUTE_DSL_ARCH" not in os.environ:
        os.environ["CUTE_DSL_ARCH"] = _detect()
    os.environ.setdefault(
        "CUTE_DSL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "cutemk", "cute_dsl")
    )
    return os.environ["CUTE_DSL_ARCH"]


def target_arch() -> str:
    """The arch kernels are built for; raises UnsupportedArchError if cutemk has no path."""
    arch = pin_arch()
    if arch not in SUPPORTED:
        raise UnsupportedArchError(
            f"cutemk has device code for {SUPPORTED}, not {arch} "
            "(set CUTE_DSL_ARCH=sm_90a to cross-compile for the H200)"
        )
    return arch
