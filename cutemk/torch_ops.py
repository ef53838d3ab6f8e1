"""The drop-in modules' megakernel calls as ``torch.library`` custom ops.

``torch.compile`` cannot trace into a megakernel launch (host-side planning, a CuTe DSL call),
so :class:`cutemk.nn.MegaMLP` and :class:`cutemk.nn.MegaMoE` call it through an opaque op with
a fake (meta) implementation: the output has the input rows' shape and dtype. A module that
uses them compiles with ``fullgraph=True``, no graph break. The op's schema holds tensors and
a string: the module's launch configuration, which finds a live module to run it (see
:func:`key_of`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

_runners: dict[str, weakref.WeakSet] = {}


def key_of(module: Any) -> str:
    """The op key of ``module``: its launch configuration as a string (``_cutemk_key``, set
    when it is built). Modules with the same key run the same compiled kernels (the weights are
    op arguments), so any live one serves the op: copies, reloaded modules and the many layers
    of a model share a key, and ``torch.compile`` sees one constant for all of them (no
    recompilation per layer); a profiled module (``profile = True``) has a key of its own.
    Outside tracing, records the module among its key's runners."""
    key = op_key(module)
    if not torch.compiler.is_compiling():
        _runners.setdefault(key, weakref.WeakSet()).add(module)
    return key


def op_key(module: Any) -> str:
    """:func:`key_of` without recording the module."""
    key = module.__dict__["_cutemk_key"]
    profile = module.__dict__.get("profile")
    if profile:  # profiled kernels are others: never share a runner
        key += " profiled" if profile is True else f" profiled={profile}"
    return key


def direct(x: torch.Tensor) -> bool:
    """Whether a module call on activations ``x`` may launch without going through its custom
    op: outside ``torch.compile`` and ``torch.jit.trace`` tracing, with no torch dispatch mode
    active (a fake-tensor or meta trace must see the op), and ``x`` a plain tensor (not a
    subclass). The op's Python dispatch costs tens of microseconds of host time an eager call;
    the op does the same launch."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch._C._is_tracing()  # torch.jit.is_tracing() past its scripting check
        and _current_dispatch_mode() is None
    )


def _runner(key: str) -> Any:
    for module in _runners.get(key, ()):
        return module
    raise RuntimeError(f"cutemk: no live module runs {key!r}")


@torch.library.custom_op("cutemk::mega_mlp", mutates_args=())
def mega_mlp(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, key: str
) -> torch.Tensor:
    """MegaMLP's megakernel on token rows ``x`` (T, H) -> (T, H)."""
    module = _runner(key)
    module._check_op_args(x, (w_gate_up, w_down))  # the op may be called directly
    return module._launch(x, w_gate_up, w_down)


@mega_mlp.register_fake
def _(x, w_gate_up, w_down, key):
    return _fake_rows(key, x, (w_gate_up, w_down))


@torch.library.custom_op("cutemk::mega_moe", mutates_args=())
def mega_moe(
    x: torch.Tensor,
    w_router: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    key: str,
) -> torch.Tensor:
    """MegaMoE's megakernel on token rows ``x`` (T, H) -> (T, H)."""
    module = _runner(key)
    module._check_op_args(x, (w_router, w_gate_up, w_down))  # the op may be called directly
    return module._launch(x, w_router, w_gate_up, w_down)


@mega_moe.register_fake
def _(x, w_router, w_gate_up, w_down, key):
    return _fake_rows(key, x, (w_router, w_gate_up, w_down))


@torch.library.custom_op("cutemk::mega_live", mutates_args=())
def mega_live(
    x: torch.Tensor, num_tokens: torch.Tensor, weights: list[torch.Tensor], key: str
) -> torch.Tensor:
    """MegaMLP's / MegaMoE's ``forward_live``: rows ``x`` (max_tokens, H), the token count a
    device int (``num_tokens``), the module's weights in its graphs' leaf order -> (max_tokens,
    H), rows past the count undefined. Its shapes never depend on the count, so a compiled
    module captures once (``mode="reduce-overhead"``) for every count."""
    module = _runner(key)
    module._check_op_args(x, weights, live=True)  # the op may be called directly
    return module._live_rows(x, num_tokens, weights)


@mega_live.register_fake
def _(x, num_tokens, weights, key):
    return _fake_rows(key, x, weights, live=True)


@torch.library.custom_op("cutemk::mega_decoder_layer", mutates_args=("k_cache", "v_cache"))
def mega_decoder_layer(
    x: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    weights: list[torch.Tensor],
    key: str,
) -> torch.Tensor:
    """MegaDecoderLayer's megakernel: one decode step, the caches updated in place."""
    module = _runner(key)
    module._check_op_args(x, weights)  # the op may be called directly
    return module._launch(x, positions, k_cache, v_cache, page_table, seq_lens, weights)


@mega_decoder_layer.register_fake
def _(x, positions, k_cache, v_cache, page_table, seq_lens, weights, key):
    return _fake_rows(key, x, weights)


def _fake_rows(key: str, x: torch.Tensor, weights: Any, live: bool = False) -> torch.Tensor:
    """A fake (meta) implementation's output, the rows' shape and dtype, after the module's
    checks of the op's arguments: a traced call with wrong shapes fails where it is traced,
    as the real call would, not at its first run."""
    _runner(key)._check_op_args(x, weights, live=live)
    return torch.empty_like(x)
