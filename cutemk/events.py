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
import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence, Union

from .errors import GraphError
from .symbolic import Bindings, Expr, IntLike, evaluate, shape_str

Index = tuple[int, ...]
IndexMap = Callable[..., Union[Index, Iterable[Index], None]]
"""``f(*coord) -> index | [index, ...] | None``; receives ``env=`` if it declares that kwarg.

An index is a tuple of ints, or one int for a 1-d event; several indices come as a list (or
any other iterable, a numpy array of rows included). "Int" means an integer scalar, Python's or
numpy's (``np.int64``; anything ``operator.index`` takes); bools and floats are refused, even
integral floats, as are the same in a count."""

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
    the number of notifiers of each element. Numpy integers count as ints; a float is refused,
    even an integral one like ``2.0`` (a constant here, a function's result when the graph is
    instantiated), so that a count computed by true division is never silently truncated.
    """

    shape: tuple[IntLike, ...]
    count: Union[IntLike, CountFn, None] = None
    name: str = "event"

    def __post_init__(self) -> None:
        c = self.count
        if c is None or callable(c) or isinstance(c, Expr):
            return
        n = _as_int(c)
        if n is None:
            raise TypeError(
                f"event {self.name}: count must be an int, a sym expression, a function "
                f"(index, env) -> int or None, got {c!r}"
            )
        self.count = n

    def concrete_shape(self, env: Bindings) -> tuple[int, ...]:
        return tuple(evaluate(d, env) for d in self.shape)

    def count_at(self, index: Index, env: Bindings) -> int | None:
        if self.count is None:
            return None
        if callable(self.count):
            c = self.count(index, env)
            n = _as_int(c)
            if n is None:
                raise GraphError(
                    f"event {self.name}: count at {list(index)} must be an int (numpy ints "
                    f"too; floats are refused, even integral ones), got {c!r}"
                )
            return n
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


def _as_int(x: Any) -> int | None:
    """``x`` as a Python int if it is an integer scalar (int, numpy integer, anything
    ``operator.index`` takes) and not a bool; else None."""
    if type(x) is int:  # the common case, first
        return x
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def apply_rank_map(
    fn: RankIndexMap, coord: Sequence[int], env: Bindings, what: str = "rank map"
) -> list[tuple[int, Index]]:
    """Evaluate a cross-rank wait map: ``[(rank, index), ...]``. ``what`` names the map in
    errors (its event and task)."""
    res = fn(*coord, env=env) if _takes_env(fn) else fn(*coord)
    if res is None:
        return []
    if isinstance(res, tuple) and len(res) == 2 and _as_int(res[0]) is not None:
        res = [res]
    try:
        out = []
        for rank, idx in res:
            r = _as_int(rank)
            if r is None:
                raise TypeError
            out.append((r, _index(idx)))
        return out
    except (TypeError, ValueError):
        raise _bad_result(what, res, "(rank, index) pairs of ints") from None


def check_map_arity(fn: Any, args: tuple | None, what: str, env_kw: bool = True) -> None:
    """``fn`` is a function that can be called with ``args`` (a tile coordinate's ints, and
    ``env=`` where it names that parameter; ``env_kw`` False: ``args`` as they are), so a map
    of the wrong arity is named where the event is declared, not deep in planning."""
    if not callable(fn):
        raise GraphError(f"{what} must be a function, got {fn!r}")
    if args is None:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: taken as it is
        return
    try:
        if env_kw and "env" in sig.parameters:
            sig.bind(*args, env={})
        else:
            sig.bind(*args)
    except TypeError as e:
        n = len(args)
        raise GraphError(f"{what} must take {n} argument{'s' * (n != 1)}: {e}") from None


def apply_map(
    fn: IndexMap, coord: Sequence[int], env: Bindings, what: str = "index map"
) -> list[Index]:
    """Evaluate an index map at a tile coordinate, normalising its result to a list. ``what``
    names the map in errors (its event and task)."""
    res = fn(*coord, env=env) if _takes_env(fn) else fn(*coord)
    if res is None:
        return []
    if isinstance(res, tuple) and all(type(i) is int for i in res):  # the common case, first
        return [res]
    try:
        if _as_int(res) is not None:
            return [_index(res)]
        # a tuple of ints (numpy's too) is one index; a tuple of indices is several
        if isinstance(res, tuple) and all(_as_int(i) is not None for i in res):
            return [_index(res)]
        return [_index(r) for r in res]
    except TypeError:
        raise _bad_result(
            what, res, "an index (a tuple of ints or an int) or a list of them"
        ) from None


def _index(idx: Any) -> Index:
    """One event index: an int or an iterable of ints (numpy's included), else TypeError."""
    n = _as_int(idx)
    if n is not None:
        return (n,)
    out = tuple(_as_int(i) for i in idx)
    if None in out:
        raise TypeError
    return out  # type: ignore[return-value]


def _bad_result(what: str, res: Any, want: str) -> GraphError:
    return GraphError(
        f"{what} returned {res!r}: expected {want} (numpy ints count as ints; floats and bools "
        "do not)"
    )


@lru_cache(maxsize=None)
def _takes_env(fn: IndexMap) -> bool:
    try:
        return "env" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
