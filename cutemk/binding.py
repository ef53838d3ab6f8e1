"""Binding user tensors to a graph's leaves: argument checks and sym inference.

Every backend goes through :func:`bind`, so every backend rejects bad input the same way: the
error names the argument and says what was expected and what came.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .errors import DeviceError, DTypeError, LayoutError, ShapeError
from .graph import Graph
from .symbolic import Sym, evaluate, shape_str


def bind(
    graph: Graph, args: Sequence[Any], kwargs: Mapping[str, Any], device_type: str | None = None
) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Match positional/keyword tensors to the graph's inputs and weights (declaration order).

    Returns ``(env, tensors)``: the value of every sym, and tensors by leaf name.
    """
    leaves = graph.leaves
    names = [v.name for v in leaves]
    if len(args) > len(leaves):
        raise TypeError(
            f"{graph.name} takes {len(leaves)} tensors {names}, got {len(args)} positional"
        )
    given: dict[str, Any] = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{graph.name} got an unexpected argument {k!r}; expected {names}")
        if k in given:
            raise TypeError(f"{graph.name} got argument {k!r} twice")
        given[k] = v
    missing = [n for n in names if n not in given]
    if missing:
        raise TypeError(f"{graph.name} is missing arguments {missing}")

    env: dict[str, int] = {}
    source: dict[str, str] = {}
    device = None
    for leaf in leaves:
        t = given[leaf.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{leaf.name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested or t.layout != torch.strided:
            kind = "nested" if t.is_nested else str(t.layout)
            raise LayoutError(f"{leaf.name} must be a dense (strided) tensor, got a {kind} one")
        if t.dtype != leaf.dtype:
            raise DTypeError(f"{leaf.name} must have dtype {leaf.dtype}, got {t.dtype}")
        if t.dim() != len(leaf.shape):
            raise ShapeError(
                f"{leaf.name} must be {len(leaf.shape)}-D with shape "
                f"{shape_str(leaf.shape)}, got shape {tuple(t.shape)}"
            )
        if device_type is not None and t.device.type != device_type:
            raise DeviceError(f"{leaf.name} must be on a {device_type} device, got {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise DeviceError(f"{leaf.name} is on {t.device} but earlier tensors are on {device}")
        if t.is_meta:
            raise DeviceError(f"{leaf.name} is a meta tensor: it has no data to compute on")
        if not t.is_contiguous():
            raise LayoutError(
                f"{leaf.name} must be contiguous (got strides {t.stride()} for "
                f"shape {tuple(t.shape)})"
            )
        given[leaf.name] = t = _canonical(t)
        for d, dim in enumerate(leaf.shape):
            if isinstance(dim, Sym):
                n = int(t.shape[d])
                if dim.name in env and env[dim.name] != n:
                    raise ShapeError(
                        f"{leaf.name}.shape[{d}] is {dim.name}={n} but "
                        f"{source[dim.name]} gave {dim.name}={env[dim.name]}"
                    )
                env[dim.name] = dim.check(n, f"{leaf.name}.shape[{d}]")
                source[dim.name] = f"{leaf.name}.shape[{d}]"
    for leaf in leaves:
        t = given[leaf.name]
        want = tuple(evaluate(d, env) for d in leaf.shape)
        if tuple(t.shape) != want:
            raise ShapeError(
                f"{leaf.name} must have shape {shape_str(leaf.shape)} = {want}, "
                f"got {tuple(t.shape)}"
            )
    _check_updates_alone(graph, given)
    return env, {leaf.name: given[leaf.name] for leaf in leaves}


def _check_updates_alone(graph: Graph, given: Mapping[str, torch.Tensor]) -> None:
    """An input an op updates in place (``TileOp.updates``: a KV cache) shares no memory with
    any other input or weight: the update would change what the other one reads (two caches
    passed as one tensor: the v rows overwrite the k rows) with nothing ordering the two."""
    if not any(node.op.updates for node in graph.nodes):
        return
    leaves = [given[v.name] for v in graph.leaves]
    pair = LeavesApart(graph, leaves).overlap(tuple(t.data_ptr() for t in leaves))
    if pair is not None:
        name, other = (graph.leaves[k].name for k in pair)
        raise LayoutError(
            f"{name} is updated in place but shares memory with {other}: pass tensors that "
            "do not overlap"
        )


class LeavesApart:
    """Whether the leaves updated in place share no memory with another leaf. :func:`bind`
    checks it on every full binding; a launch kept for repeated calls (which skip
    :func:`bind`) calls it with the leaves' addresses, checked once per set of addresses (the
    same tensors again cost one tuple compare). Graphs with no in-place leaf check nothing."""

    __slots__ = ("updated", "nbytes", "seen")

    def __init__(self, graph: Graph, leaves: Sequence[torch.Tensor]) -> None:
        names = [v.name for v in graph.leaves]
        self.updated = tuple(
            names.index(node.args[i].name) for node in graph.nodes for i in node.op.updates.values()
        )
        self.nbytes = tuple(t.numel() * t.element_size() for t in leaves)
        self.seen: tuple | None = None

    def overlap(self, ptrs: tuple[int, ...]) -> tuple[int, int] | None:
        """The first (in-place leaf, other leaf) pair of positions whose bytes overlap."""
        nbytes = self.nbytes
        for i in self.updated:
            a0, a1 = ptrs[i], ptrs[i] + nbytes[i]
            for j, b0 in enumerate(ptrs):
                if j != i and nbytes[j] and a0 < a1 and a0 < b0 + nbytes[j] and b0 < a1:
                    return i, j
        return None

    def __call__(self, ptrs: tuple[int, ...]) -> bool:
        if not self.updated or ptrs == self.seen:
            return True
        if self.overlap(ptrs) is not None:
            return False
        self.seen = ptrs
        return True


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` as device code sees it: inference only (no autograd: the kernels write no graph,
    and DLPack refuses tensors that require grad), with exactly row-major strides. torch calls
    a tensor contiguous whatever the stride of a size-1 dim, but a TMA descriptor built from a
    (1, K) view with strides (1, 1) would step 2 bytes a row: re-view it, at no cost."""
    if t.requires_grad:
        t = t.detach()
    want, step = [], 1
    for n in reversed(t.shape):
        want.append(step)
        step *= max(int(n), 1)
    want = tuple(reversed(want))
    if t.stride() != want:
        t = t.as_strided(tuple(t.shape), want)
    return t


def env_key(env: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(env.items()))


def fresh_(t: torch.Tensor, v) -> torch.Tensor:
    """Fill a new buffer of graph value ``v``: zeros for an op's own counter
    (``Value.is_own_counter``), else poison."""
    return t.zero_() if v.is_own_counter else poison_(t)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with a value no kernel writes by accident (NaN for floats)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)
