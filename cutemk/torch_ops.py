"""The drop-in modules' megakernel calls as ``torch.library`` custom ops.

``torch.compile`` cannot trace into a megakernel launch (host-side planning, a CuTe DSL call),
so :class:`cutemk.nn.MegaMLP` and :class:`cutemk.nn.MegaMoE` call it through an opaque op with
a fake (meta) implementation: the output has the input rows' shape and dtype. A module that
uses them compiles with ``fullgraph=True``, no graph break. The op finds its module through an
integer handle (a weak registry: the op's schema holds only tensors and ints).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

_modules: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def handle_of(module: Any) -> int:
    """The handle of ``module`` (kept weakly) to pass to the ops. Made when the module is
    built; a copy of a module re-registers on its first eager call (while ``torch.compile``
    traces, the handle is read as it is: a copy's then names the module it was copied from,
    whose compiled kernels are the same; the op takes the weights as arguments)."""
    handle = module.__dict__.get("_cutemk_handle")
    if torch.compiler.is_compiling():
        return handle
    if handle is None or _modules.get(handle) is not module:
        handle = next(_ids)
        _modules[handle] = module
        module.__dict__["_cutemk_handle"] = handle
    return handle


def _module(handle: int) -> Any:
    module = _modules.get(handle)
    if module is None:
        raise RuntimeError(f"cutemk: no live module with handle {handle}")
    return module


@torch.library.custom_op("cutemk::mega_mlp", mutates_args=())
def mega_mlp(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, handle: int
) -> torch.Tensor:
    """MegaMLP's megakernel on token rows ``x`` (T, H) -> (T, H)."""
    return _module(handle)._launch(x, w_gate_up, w_down)


@mega_mlp.register_fake
def _(x, w_gate_up, w_down, handle):
    return torch.empty_like(x)


@torch.library.custom_op("cutemk::mega_moe", mutates_args=())
def mega_moe(
    x: torch.Tensor,
    w_router: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    handle: int,
) -> torch.Tensor:
    """MegaMoE's megakernel on token rows ``x`` (T, H) -> (T, H)."""
    return _module(handle)._launch(x, w_router, w_gate_up, w_down)


@mega_moe.register_fake
def _(x, w_router, w_gate_up, w_down, handle):
    return torch.empty_like(x)
