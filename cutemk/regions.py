"""What an op declares for its tiles (grid, ``reads`` / ``writes`` regions, costs), checked
against its node's tensors and normalised: the inputs of :func:`cutemk.plan.instantiate`.

A mistake here (a region naming a tensor the op lacks, a box outside its tensor or running
backwards, a produced input left undeclared, a NaN cost) would silently drop a dependency or
mislead the race checker and the schedulers, so each is a :class:`GraphError` naming the op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import GraphError
from .graph import Node
from .symbolic import Bindings, Expr
from .tileop import Box, Coord, TileOp, as_boxes


def node_regions(
    node: Node, which: str, coord: Coord, env: Bindings, data=None, shapes=None
) -> dict[str, list[Box]]:
    """An op's declared ``reads``/``writes`` for one tile, checked and normalised.

    A region that names an unknown argument, has the wrong rank, or leaves out an input that
    another node produces would silently drop a dependency, so each is a GraphError.
    ``shapes``: the node's tensors' shapes at ``env`` (:func:`node_shapes`), where the caller
    asks for many tiles of one node.
    """
    op = node.op
    raw = op.reads(coord, env, data) if which == "reads" else op.writes(coord, env, data)
    if not isinstance(raw, Mapping):
        raise GraphError(
            f"{op.name}.{which}() must return a dict of tensor name -> box(es), got {raw!r}"
        )
    # a tile may read its own node's outputs (results other tiles of the node wrote): the race
    # checker sees those reads; they derive no events (order them explicitly)
    tensors = {**node.args, **node.results} if which == "reads" else node.results
    out: dict[str, list[Box]] = {}
    for name, region in raw.items():
        if name not in tensors:
            raise GraphError(
                f"{op.name}.{which}() names {name!r}, which is not one of its "
                f"{'inputs or outputs' if which == 'reads' else 'outputs'} {tuple(tensors)}"
            )
        shape = shapes[name] if shapes is not None else tensors[name].spec.concrete(env)
        boxes = []
        for box in as_boxes(region):
            if len(box) != len(shape) or any(len(iv) != 2 for iv in box):
                raise GraphError(
                    f"{op.name}.{which}() gives {name} the box {box!r}; {name} is "
                    f"{len(shape)}-D, so a box is {len(shape)} (lo, hi) pairs"
                )
            try:
                box = tuple((int(lo), int(hi)) for lo, hi in box)
            except TypeError:
                raise GraphError(
                    f"{op.name}.{which}() gives {name} the box {box!r}: bounds must be ints "
                    "(evaluate symbolic dims with the bindings, e.g. spec.concrete(env))"
                ) from None
            check_box(box, shape, f"{op.name}{list(coord)}.{which}() of {name}")
            boxes.append(box)
        out[name] = boxes
    if which == "reads":
        check_produced_inputs_read(node, out, "reads()")
    return out


def node_shapes(node: Node, value_shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """``node``'s arguments and results by their names in the op, with their shapes taken from
    ``value_shapes`` (a plan's ``shapes``: by value name)."""
    return {n: value_shapes[v.name] for n, v in {**node.args, **node.results}.items()}


def check_box(box: Box, shape: tuple[int, ...], what: str) -> None:
    """A box lies inside its tensor and no interval runs backwards (an empty one is (x, x)):
    the race checker and the dependency index would clip or wrap what lies outside, and a
    device tile would touch memory past the buffer."""
    for d, ((lo, hi), n) in enumerate(zip(box, shape)):
        if not 0 <= lo <= hi <= n:
            raise GraphError(
                f"{what}: the box {list(box)} has dim {d} [{lo}, {hi}), not inside [0, {n}] "
                f"of the tensor's shape {shape} (with lo <= hi)"
            )


def check_produced_inputs_read(node: Node, declared, method: str) -> None:
    """Every input another node produces is among the declared reads (else its dependency
    would be lost)."""
    for name, v in node.args.items():
        if v.producer is not None and name not in declared:
            raise GraphError(
                f"{node.op.name}.{method} declares nothing for {name!r}, which "
                f"{v.producer.name} produces: its dependency would be lost"
            )


def grid_coords(grid: tuple[int, ...]) -> np.ndarray:
    """Every coordinate of ``grid`` in row-major order (``itertools.product``'s): (n, rank)."""
    if not grid:
        return np.zeros((1, 0), dtype=np.int64)
    return np.indices(grid, dtype=np.int64).reshape(len(grid), -1).T


def region_arrays(node: Node, which: str, env: Bindings, coords: np.ndarray):
    """The op's ``region_arrays``, checked like :func:`node_regions`; None where it has none."""
    op = node.op
    arrays = op.region_arrays(which, env, coords)
    if arrays is None:
        return None
    tensors = {**node.args, **node.results} if which == "reads" else node.results
    what = f"{op.name}.region_arrays({which!r})"
    if not isinstance(arrays, Mapping):
        raise GraphError(f"{what} must return a dict of tensor name -> array, got {arrays!r}")
    for name, a in arrays.items():
        if name not in tensors:
            raise GraphError(f"{what} names {name!r}, not a tensor of it")
        if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.integer):
            got = getattr(a, "dtype", type(a).__name__)
            raise GraphError(f"{what} gives {name} {got}, not an int numpy array")
        shape = tensors[name].spec.concrete(env)
        want = (len(coords), len(shape), 2)
        if tuple(a.shape) != want:
            raise GraphError(f"{what} gives {name} shape {a.shape}, not {want}")
        bad = (a[:, :, 0] < 0) | (a[:, :, 0] > a[:, :, 1]) | (a[:, :, 1] > np.asarray(shape))
        if bad.any():
            i = int(np.argwhere(bad)[0][0])
            check_box(tuple(map(tuple, a[i].tolist())), shape, f"{what} of {name}, tile {i}")
    if which == "reads":
        check_produced_inputs_read(node, arrays, "region_arrays('reads')")
    else:
        for name in node.results:
            # an op's own counters have no readers (TileOp.zeroed_outputs)
            if name not in arrays and name not in op.zeroed_outputs:
                raise GraphError(
                    f"{op.name}.region_arrays('writes') declares nothing for its output "
                    f"{name!r}: its readers would wait for no tile"
                )
    return arrays


def checked_grid(node: Node) -> tuple:
    """The op's task grid, a tuple of ints and symbolic dims."""
    grid = node.op.grid()
    if not isinstance(grid, (tuple, list)) or not all(
        isinstance(d, (int, Expr)) and not isinstance(d, bool) for d in grid
    ):
        raise GraphError(
            f"{node.op.name}.grid() (node {node.name}) must be a tuple of ints and symbolic "
            f"dims, got {grid!r}"
        )
    return grid


def checked_costs(node: Node, costs: Any, n: int) -> list[float]:
    """One finite, non-negative cost per task of ``node`` (the schedulers rank tasks by them:
    a NaN or a negative one orders the queues by nonsense, with no error)."""
    own_array = type(node.op).cost_array is not TileOp.cost_array
    what = f"{node.op.name}.{'cost_array' if own_array else 'cost'}()"
    try:
        arr = np.asarray(costs, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise GraphError(f"{what} (node {node.name}) must give numbers, got {costs!r}") from None
    if len(arr) != n:
        raise GraphError(f"{what} (node {node.name}) gave {len(arr)} costs for {n} tasks")
    bad = ~(np.isfinite(arr) & (arr >= 0))
    if bad.any():
        i = int(np.argmax(bad))
        got = repr(costs[i]) if isinstance(costs, list) else arr[i]
        raise GraphError(
            f"{what} (node {node.name}) gave task {i} the cost {got}: costs are "
            "finite microseconds >= 0"
        )
    return arr.tolist()
