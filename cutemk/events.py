"""Event tensors: multi-dimensional arrays of dependency counters with symbolic shapes.

An :class:`EventTensor` has a symbolic shape and, per element, a wait count. Producer tasks
``notify`` elements (each notify adds 1); a consumer task ``wait``s until an element's count of
notifies equals its wait count. Index maps from a task's tile coordinates to the elements it
notifies / waits on are attached per graph node (:class:`EventMap`).

Events come two ways (``cutemk.plan`` turns both into concrete counters):

- **automatic**: derived from the tile regions the ops read and write. For a producer node P and
  a consumer node C, the event tensor has C's task-grid shape; element ``c`` counts the P tiles
  whose writes intersect what tile ``c`` of C reads. Elements with the same producer set are
  merged when the graph is instantiated, so a GEMM -> SiLU edge gets one event per row block.
- **explicit**: a custom op's author declares the event tensor, its count and the maps, as in
  the Event Tensor paper's Figure 3. The count is checked against the number of notifiers when
  the graph is instantiated: a count that can never be met is a :class:`GraphError`, not a hang.
  Explicit events also carry the dependencies between ranks of a distributed graph: a
  ``remote_wait`` map sends a task to wait on the same event element of another rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Sequence, Union

from .symbolic import Bindings, Expr, IntLike, evaluate, shape_str

Index = tuple[int, ...]
IndexMap = Callable[..., Union[Index, Iterable[Index], None]]
"""``f(*coord) -> index | [index, ...] | None``; receives ``env=`` if it declares that kwarg."""

CountFn = Callable[[Index, Bindings], int]
RankIndexMap = Callable[..., Union[tuple[int, Index], Iterable[tuple[int, Index]], None]]
"""``f(*coord[, env=]) -> [(rank, index), ...]``: the event elements of *other ranks* a task
waits on (distributed graphs; every rank runs the same graph, so an event index means the same
counter on every rank). ``env["RANK"]`` is this rank; a pair naming it is an ordinary wait."""


@dataclass(eq=False)
class EventTensor:
    """A symbolic-shape array of counters.

    ``count`` is the wait count of every element: an int, a symbolic expression of the launch's
    dims, a callable ``(index, env) -> int`` for per-element counts, or ``None`` to derive it as
    the number of notifiers of each element.
    """

    shape: tuple[IntLike, ...]
    count: Union[IntLike, CountFn, None] = None
    name: str = "event"

    def __post_init__(self) -> None:
        c = self.count
        if isinstance(c, bool) or not (c is None or callable(c) or isinstance(c, (int, Expr))):
            raise TypeError(
                f"event {self.name}: count must be an int, a sym expression, a function "
                f"(index, env) -> int or None, got {c!r}"
            )

    def concrete_shape(self, env: Bindings) -> tuple[int, ...]:
        return tuple(evaluate(d, env) for d in self.shape)

    def count_at(self, index: Index, env: Bindings) -> int | None:
        if self.count is None:
            return None
        if callable(self.count):
            return int(self.count(index, env))
        return evaluate(self.count, env)

    def __str__(self) -> str:
        return f"EventTensor {self.name}{shape_str(self.shape)}"


@dataclass(eq=False)
class EventMap:
    """Explicit notify/wait wiring of one event tensor between graph nodes."""

    event: EventTensor
    notify: list[tuple[object, IndexMap]] = field(default_factory=list)  # (node, map)
    wait: list[tuple[object, IndexMap]] = field(default_factory=list)
    remote_wait: list[tuple[object, RankIndexMap]] = field(default_factory=list)


def apply_rank_map(
    fn: RankIndexMap, coord: Sequence[int], env: Bindings
) -> list[tuple[int, Index]]:
    """Evaluate a cross-rank wait map: ``[(rank, index), ...]``."""
    res = fn(*coord, env=env) if _takes_env(fn) else fn(*coord)
    if res is None:
        return []
    if isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], int):
        res = [res]
    out = []
    for rank, idx in res:
        out.append((int(rank), (int(idx),) if isinstance(idx, int) else tuple(int(i) for i in idx)))
    return out


def apply_map(fn: IndexMap, coord: Sequence[int], env: Bindings) -> list[Index]:
    """Evaluate an index map at a tile coordinate, normalising its result to a list."""
    res = fn(*coord, env=env) if _takes_env(fn) else fn(*coord)
    if res is None:
        return []
    if isinstance(res, tuple) and all(isinstance(i, int) for i in res):
        return [res]
    if isinstance(res, int):
        return [(res,)]
    return [tuple(int(i) for i in ((r,) if isinstance(r, int) else r)) for r in res]


@lru_cache(maxsize=None)
def _takes_env(fn: IndexMap) -> bool:
    try:
        return "env" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
