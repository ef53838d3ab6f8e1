"""Instantiation: a symbolic graph plus bound dims -> a concrete task graph with event counters.

A :class:`Plan` is what schedulers and backends consume. Its invariants:

- tasks are numbered node by node, each node's tiles in row-major order of its grid;
- every event element has a wait count equal to the number of tasks that notify it (checked
  for explicit events, true by construction for automatic ones);
- a task may start once every event it waits on has reached its count, and the union of those
  events' notifiers covers every producer tile that writes what the task reads (for the
  conservative, data-independent regions the ops declare).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import operator
import os
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from . import native
from .errors import CuteMKError, GraphError, ShapeError
from .events import apply_map, apply_rank_map
from .graph import Graph, Node
from .regions import (
    checked_costs,
    checked_grid,
    grid_coords,
    node_regions,
    node_shapes,
    region_arrays,
)
from .symbolic import Bindings
from .tileop import Box, Coord, box_is_empty


def tasks_by_event(per_task: Sequence[Sequence[int]], num_events: int) -> list[list[int]]:
    """Event id -> the tasks whose list in ``per_task`` holds it, in task order."""
    out: list[list[int]] = [[] for _ in range(num_events)]
    for t, evs in enumerate(per_task):
        for e in evs:
            out[e].append(t)
    return out


class Task(NamedTuple):
    """One tile of one node (a tuple: a plan holds one per task, built by the ten thousand)."""

    tid: int
    node: Node
    coord: Coord

    @property
    def label(self) -> str:
        return f"{self.node.name}{list(self.coord)}"


class Tasks(Sequence[Task]):
    """A plan's tasks, each made when asked for from its node's task range and coordinates (a
    plan of ten thousand tasks builds no object for each up front)."""

    __slots__ = ("_coords", "_lists", "_n", "_nodes", "_starts")

    def __init__(self, nodes: Sequence[Node], node_tasks: Sequence[range], coords) -> None:
        self._nodes = list(nodes)
        self._starts = [r.start for r in node_tasks]
        self._n = node_tasks[-1].stop if node_tasks else 0
        self._coords = coords
        self._lists: list[list[Coord] | None] = [None] * len(self._nodes)

    def _coords_of(self, k: int) -> list[Coord]:
        lst = self._lists[k]
        if lst is None:
            lst = self._lists[k] = list(map(tuple, self._coords[k].tolist()))
        return lst

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, t):
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(self._n))]
        t = operator.index(t)
        if t < 0:
            t += self._n
        if not 0 <= t < self._n:
            raise IndexError(f"task {t} out of range (the plan has {self._n})")
        k = bisect_right(self._starts, t) - 1
        return Task(t, self._nodes[k], self._coords_of(k)[t - self._starts[k]])

    def __iter__(self) -> Iterator[Task]:
        for k, node in enumerate(self._nodes):
            start = self._starts[k]
            for i, c in enumerate(self._coords_of(k)):
                yield Task(start + i, node, c)


@dataclass
class Plan:
    graph: Graph
    env: dict[str, int]
    tasks: Sequence[Task]
    node_tasks: list[range]
    shapes: dict[str, tuple[int, ...]]
    event_count: list[int] = field(default_factory=list)
    event_label: list[str] = field(default_factory=list)
    waits: list[list[int]] = field(default_factory=list)
    notifies: list[list[int]] = field(default_factory=list)
    remote_waits: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per task: ``(rank, event)`` pairs it waits on in other ranks' plans (distributed)."""
    shared_events: set[int] = field(default_factory=set)
    """Events other ranks may wait on: kept (notified) even with no local waiter."""
    cost: list[float] = field(default_factory=list)
    coords: list[np.ndarray] = field(default_factory=list)
    """Per node: its tasks' coordinates (tasks, grid rank), in task order."""

    def coords_of(self, node: int) -> np.ndarray:
        """Node ``node``'s task coordinates as an int array (tasks, grid rank)."""
        if node < len(self.coords):
            return self.coords[node]
        ts = self.node_tasks[node]
        return np.asarray([self.tasks[t].coord for t in ts], dtype=np.int64).reshape(len(ts), -1)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def num_events(self) -> int:
        return len(self.event_count)

    def new_event(self, label: str, count: int = 0) -> int:
        self.event_count.append(count)
        self.event_label.append(label)
        return len(self.event_count) - 1

    def task_key(self, t: int) -> tuple:
        """Sort key of task t for schedulers: node order, then the op's ``order_key``."""
        task = self.tasks[t]
        return (task.node.index, *task.node.op.order_key(task.coord))

    def ready_key(self, t: int) -> tuple:
        """Order of the dynamic queue's initial tasks: tasks that wait on other ranks go behind
        every other one. A popped task spins on its cross-rank waits while holding its SM; had
        such waiters come first they could fill every SM ahead of the producers the other ranks
        wait for (a cross-rank deadlock). Then the op's preferred order (``task_key``)."""
        return (bool(self.remote_waits[t]), *self.task_key(t))

    def producers(self) -> list[list[int]]:
        """Event id -> tasks notifying it."""
        return tasks_by_event(self.notifies, self.num_events)

    def consumers(self) -> list[list[int]]:
        """Event id -> tasks waiting on it."""
        return tasks_by_event(self.waits, self.num_events)

    def preds(self, mirror_remote: bool = False) -> list[set[int]]:
        """Task -> tasks it depends on (through any event).

        With ``mirror_remote`` (schedulers of distributed graphs), a task that waits on other
        ranks also depends on every producer of every event other ranks may wait on
        (``shared_events``). Each rank's queues then run all of those producers before any
        cross-rank waiter, so no rank's waiter can sit in front of a producer another rank
        needs: the queues cannot deadlock across ranks, whatever each rank's costs (a shared
        producer that itself depends on a cross-rank waiter makes this a cycle, refused)."""
        prod = self.producers()
        out = [
            set(itertools.chain.from_iterable(prod[e] for e in self.waits[t]))
            for t in range(self.num_tasks)
        ]
        if mirror_remote and self.shared_events:
            shared = set(itertools.chain.from_iterable(prod[e] for e in self.shared_events))
            for t, rw in enumerate(self.remote_waits):
                if rw:
                    out[t].update(shared - {t})
        return out

    def check_distributed(self, dynamic: bool) -> None:
        """Refuse what the distributed protocol cannot run without a cross-rank deadlock:
        in dynamic mode a popped task spins on its cross-rank waits while holding its SM, so
        every producer of an event other ranks wait on must be a task that waits on nothing
        (pushed at launch, ahead of any waiter in the FIFO ready queue)."""
        if not dynamic or not self.shared_events:
            return
        prod = self.producers()
        for e in sorted(self.shared_events):
            for t in prod[e]:
                if any(self.event_count[w] > 0 for w in self.waits[t]) or self.remote_waits[t]:
                    raise GraphError(
                        f"dynamic scheduling: {self.tasks[t].label} notifies "
                        f"{self.event_label[e]}, which other ranks wait on, but waits itself; "
                        "cross-rank producers must wait on nothing (use the static scheduler)"
                    )

    def num_edges(self) -> int:
        return sum(len(p) for p in self.preds())

    def describe(self) -> dict[str, Any]:
        """JSON-able dump of the task graph (``CUTEMK_DUMP``)."""
        return {
            "graph": self.graph.name,
            "env": self.env,
            "tasks": [
                {
                    "tid": t.tid,
                    "label": t.label,
                    "waits": self.waits[t.tid],
                    "remote_waits": self.remote_waits[t.tid],
                    "notifies": self.notifies[t.tid],
                    "cost_us": self.cost[t.tid],
                }
                for t in self.tasks
            ],
            "events": [
                {"eid": e, "label": self.event_label[e], "count": self.event_count[e]}
                for e in range(self.num_events)
            ],
        }


class _WriteIndex:
    """Which producer tiles write which cells of one tensor.

    Cells are the grid formed by every producer box boundary, so intersecting a consumer's box
    with all producer boxes costs only the cells it covers. Tiles of one op write disjoint
    boxes, except for an op's ``scatter_outputs`` (``overlap``): their boxes are supersets of
    data-dependent writes, and a cell then maps to every tile that may write it.
    """

    def __init__(
        self, value_name: str, boxes: list[tuple[int, Box]], overlap: bool = False
    ) -> None:
        self.name = value_name
        boxes = [(t, b) for t, b in boxes if not box_is_empty(b)]
        ndim = len(boxes[0][1]) if boxes else 0
        self.bps = [sorted({x for _, b in boxes for x in b[d]}) for d in range(ndim)]
        self.cells: dict[tuple[int, ...], int | frozenset[int]] = {}
        for t, b in boxes:
            ranges = [
                range(bisect_left(bp, lo), bisect_left(bp, hi)) for bp, (lo, hi) in zip(self.bps, b)
            ]
            for cell in itertools.product(*ranges):
                prev = self.cells.setdefault(cell, t)
                if prev == t:
                    continue
                if not overlap:
                    raise GraphError(
                        f"tasks {prev} and {t} both write the same part of "
                        f"{value_name}: tiles of one op must write disjoint boxes"
                    )
                prev = prev if isinstance(prev, frozenset) else frozenset((prev,))
                self.cells[cell] = prev | {t}
        self.grid: np.ndarray | None = None  # a tiling: writer id per cell (-1: none)
        self._flat: list[int] | None = None
        self._memo: dict[Box, frozenset[int]] = {}

    @classmethod
    def from_arrays(
        cls, value_name: str, tasks: np.ndarray, boxes: np.ndarray, overlap: bool = False
    ) -> _WriteIndex:
        """The index of one box per task given as arrays (``region_arrays``' form): where each
        box is one cell of the grid of box edges and no two share a cell (a tiling), built with
        array operations; otherwise as from the box list."""
        keep = (boxes[:, :, 1] > boxes[:, :, 0]).all(axis=1)
        tasks, boxes = tasks[keep], boxes[keep]
        if len(boxes):
            ndim = boxes.shape[1]
            bps = [_sorted_unique(boxes[:, d, :]) for d in range(ndim)]
            lo = np.stack([np.searchsorted(bps[d], boxes[:, d, 0]) for d in range(ndim)], 1)
            hi = np.stack([np.searchsorted(bps[d], boxes[:, d, 1]) for d in range(ndim)], 1)
            shape = tuple(len(bp) - 1 for bp in bps)
            size = int(np.prod(shape, dtype=np.int64))
            if (hi - lo == 1).all() and size <= 4 * len(tasks) + 64:
                at = np.ravel_multi_index(tuple(lo.T), shape)
                if len(_sorted_unique(at)) == len(tasks):
                    # a tiling: the cells as one row-major list of writer ids (-1: none),
                    # which a range of cells reads a slice at a time
                    grid = np.full(size, -1, dtype=np.int32)
                    grid[at] = tasks
                    self = cls.__new__(cls)
                    self.name = value_name
                    self.bps = [bp.tolist() for bp in bps]
                    self.cells = {}
                    self.grid = grid
                    self._flat = None
                    self._shape = shape
                    self._memo = {}
                    return self
        pairs = [(t, tuple(map(tuple, b))) for t, b in zip(tasks.tolist(), boxes.tolist())]
        return cls(value_name, pairs, overlap)

    def _empty(self) -> bool:
        return not self.cells and self.grid is None

    def query(self, box: Box) -> frozenset[int]:
        if box_is_empty(box) or self._empty():
            return frozenset()
        hit = self._memo.get(box)
        if hit is None:
            ranges = []
            for bp, (lo, hi) in zip(self.bps, box):
                j0 = max(bisect_right(bp, lo) - 1, 0)
                j1 = bisect_left(bp, hi)
                ranges.append((j0, min(j1, len(bp) - 1)))
            hit = self._memo[box] = self.in_cells(tuple(ranges))
        return hit

    def cell_ranges(self, boxes: np.ndarray) -> np.ndarray:
        """:meth:`query`'s cell ranges of many boxes (n, ndim, 2) at once: (n, ndim, 2) half-open
        cell index ranges, empty (lo == hi) where the box is empty or nothing is indexed."""
        n, ndim = boxes.shape[0], boxes.shape[1]
        out = np.zeros((n, ndim, 2), dtype=np.int64)
        if self._empty():
            return out
        empty = (boxes[:, :, 1] <= boxes[:, :, 0]).any(axis=1)
        for d, bp in enumerate(self.bps):
            bp = np.asarray(bp, dtype=np.int64)
            j0 = np.maximum(np.searchsorted(bp, boxes[:, d, 0], side="right") - 1, 0)
            j1 = np.minimum(np.searchsorted(bp, boxes[:, d, 1], side="left"), len(bp) - 1)
            out[:, d, 0] = j0
            out[:, d, 1] = np.maximum(j1, j0)
        out[empty] = 0
        return out

    def in_cells(self, ranges: tuple[tuple[int, int], ...]) -> frozenset[int]:
        """The tasks writing the cells of the per-dim index ranges ``ranges``."""
        found: set[int] = set()
        if self.grid is not None:
            if self._flat is None:  # Python ints for slicing: made where the C pass is not used
                self._flat = self.grid.tolist()
            flat, shape = self._flat, self._shape
            if any(hi <= lo for lo, hi in ranges):
                return frozenset()
            lo_last, hi_last = ranges[-1]
            for outer in itertools.product(*(range(lo, hi) for lo, hi in ranges[:-1])):
                base = 0
                for i, n in zip(outer, shape):
                    base = base * n + i
                base *= shape[-1]
                found.update(flat[base + lo_last : base + hi_last])
            found.discard(-1)
            return frozenset(found)
        for c in itertools.product(*(range(lo, hi) for lo, hi in ranges)):
            w = self.cells.get(c)
            if isinstance(w, frozenset):
                found |= w
            elif w is not None:
                found.add(w)
        return frozenset(found)


PER_TILE = False
"""Plan through the per-tile ``reads``/``writes``/``cost`` even where an op offers the array
forms (``TileOp.region_arrays``): the reference the array path is tested against."""


@contextlib.contextmanager
def no_gc():
    """Python's cyclic collector paused: building a plan allocates ~10 objects per task and
    none of them form cycles, yet each allocation burst made the collector walk every live
    object (a third of the planning time at 13K tasks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def instantiate(graph: Graph, env: Bindings) -> Plan:
    """Bind every sym of ``graph`` to a value and build the concrete task graph. Each sym's
    value must be an int within its declared [min, max] (a ``ShapeError`` otherwise, as a
    call at that size gives): a plan past a sym's max would outgrow buffers sized for it."""
    check_env(graph, env)
    with no_gc():
        return _instantiate(graph, env)


def check_env(graph: Graph, env: Bindings) -> None:
    """Every sym of ``graph`` bound in ``env`` to an int within its bounds."""
    if not isinstance(env, dict):
        raise TypeError(f"a plan's bindings are a dict of sym name -> int, got {env!r}")
    for name, s in graph.syms().items():
        if name not in env:
            raise ShapeError(f"symbolic dim {name} is not bound")
        v = env[name]
        s.check(int(v) if isinstance(v, np.integer) else v, "the plan's bindings")
    if "WORLD" in env or "RANK" in env:  # a distributed plan: this rank's place in the world
        world, rank = env.get("WORLD", 1), env.get("RANK", 0)
        for name, v in (("WORLD", world), ("RANK", rank)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ShapeError(f"{name} must be an int, got {v!r}")
        built = graph.world_size()
        if world < 1 or (built is not None and world != built):
            want = "at least 1" if built is None else f"{built} (the graph's ops were built for it)"
            raise ShapeError(f"WORLD={world}: expected {want}")
        if not 0 <= rank < world:
            raise ShapeError(f"RANK={rank} is outside the world of {world} ranks")
    for node in graph.nodes:
        node.op.check_bindings(env)


def _instantiate(graph: Graph, env: Bindings) -> Plan:
    env = dict(env)
    shapes = {v.name: v.spec.concrete(env) for v in graph.values}
    node_tasks: list[range] = []
    coords: list[np.ndarray] = []
    n = 0
    for node in graph.nodes:
        grid = tuple(max(0, int(d)) for d in (_ev(g, env) for g in checked_grid(node)))
        coords.append(grid_coords(grid))
        node_tasks.append(range(n, n + len(coords[-1])))
        n += len(coords[-1])
    tasks = Tasks(graph.nodes, node_tasks, coords)
    plan = Plan(graph, env, tasks, node_tasks, shapes, coords=coords)
    plan.waits = [[] for _ in range(n)]
    plan.notifies = [[] for _ in range(n)]
    plan.remote_waits = [[] for _ in range(n)]
    plan.cost = []
    for node in graph.nodes:
        c = None if PER_TILE else node.op.cost_array(env, coords[node.index])
        if c is None:
            c = [node.op.cost(tasks[t].coord, env) for t in node_tasks[node.index]]
        plan.cost += checked_costs(node, c, len(node_tasks[node.index]))
    _explicit_events(graph, plan)
    # explicit events add ordering to the automatic ones, never replace them: an event declared
    # on a producer -> consumer pair must not drop the data dependencies derived from regions
    _automatic_events(graph, plan, coords)
    if graph.event_maps:
        # automatic events follow the node order, explicit ones may point back: a cycle
        # through one is refused here for every scheduler (a dynamic launch would never
        # push the tasks on it: a hang on the GPU)
        from .depgraph import DepGraph  # depgraph builds on this module

        DepGraph.of(plan).topological_order(plan)
    dump_stage(plan, "plan", plan.describe)
    return plan


def dump_stage(plan: Plan, stage: str, payload: Any) -> Path | None:
    """Under ``CUTEMK_DUMP=dir``, write one stage of building a launch for ``plan``'s dims:
    ``<graph>_<dims>.<stage>.json`` (a JSON-able payload) or ``.npz`` (a dict of numpy arrays;
    ``payload`` may be a function making it, called only when dumping).
    The stages: ``plan`` (the task graph), ``schedule`` (static queues), ``lowered`` (the
    arrays the megakernel reads); the kernel's (which depends on the graph's structure only) is
    written by :func:`dump_file`. Returns the path, or None when dumping is off."""
    tag = "_".join(f"{k}{v}" for k, v in sorted(plan.env.items())) or "static"
    return dump_file(f"{plan.graph.name}_{tag}.{stage}", payload)


def dump_file(name: str, payload: Any) -> Path | None:
    """Under ``CUTEMK_DUMP=dir``, write ``payload`` to ``dir/<name>.json`` (JSON-able) or
    ``.npz`` (a dict of numpy arrays); a callable ``payload`` is called only when dumping.
    Returns the path, or None when dumping is off. :func:`dump_stage` names a plan's stages;
    the kernel stage is ``<graph>.<static|dynamic>.kernel`` (``runtime.kernel_spec``)."""
    dump_dir = os.environ.get("CUTEMK_DUMP")
    if not dump_dir:
        return None
    if callable(payload):  # built only when dumping
        payload = payload()
    # one file in the dump directory whatever the graph's name ("../x" or "a/b" included)
    safe = re.sub(r"[^A-Za-z0-9_.=+-]", "_", name).lstrip(".") or "_"
    root = Path(dump_dir)
    if root.exists() and not root.is_dir():
        raise CuteMKError(f"CUTEMK_DUMP={dump_dir!r} is a file, not a directory to dump into")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CuteMKError(f"CUTEMK_DUMP={dump_dir!r}: cannot create the directory ({e})") from None
    path = root / safe
    if (
        isinstance(payload, dict)
        and payload
        and all(isinstance(v, np.ndarray) for v in payload.values())
    ):
        path = path.with_name(path.name + ".npz")
        np.savez(path, **payload)
    else:
        path = path.with_name(path.name + ".json")
        path.write_text(json.dumps(payload, indent=1))
    return path


def _ev(d, env):
    return d if isinstance(d, int) else d.eval(env)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` by sorting: numpy 2's default hashes, several times slower on the
    integer arrays of a plan."""
    a = np.sort(a, axis=None)
    if len(a) < 2:
        return a
    keep = np.empty(len(a), dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(keys, axis=0, return_index=True, return_inverse=True)`` for rows of small
    non-negative ints, up to the order of the unique rows (callers group by first occurrence):
    each row packed into one int64 when the columns' ranges allow, which a 1-D unique sorts
    several times faster than rows."""
    if keys.size and keys.min() >= 0:
        dims = (keys.max(axis=0) + 1).tolist()
        if float(np.prod(dims, dtype=np.float64)) < 2.0**62:
            packed = np.ravel_multi_index(tuple(keys.T), dims)
            u, first, inverse = np.unique(packed, return_index=True, return_inverse=True)
            return u, first, inverse.reshape(-1)
    return np.unique(keys, axis=0, return_index=True, return_inverse=True)


def _automatic_events(graph: Graph, plan: Plan, coords: list[np.ndarray]) -> None:
    env = plan.env
    index: dict[str, _WriteIndex] = {}
    for node in graph.nodes:
        tasks = plan.node_tasks[node.index]
        arrays = None if PER_TILE else region_arrays(node, "writes", env, coords[node.index])
        if arrays is not None:
            ids = np.arange(tasks.start, tasks.stop, dtype=np.int64)
            for oname, v in node.results.items():
                overlap = oname in node.op.scatter_outputs
                if oname in arrays:
                    index[v.name] = _WriteIndex.from_arrays(v.name, ids, arrays[oname], overlap)
                else:
                    index[v.name] = _WriteIndex(v.name, [], overlap)
            continue
        shapes = node_shapes(node, plan.shapes)
        writes_of = [
            node_regions(node, "writes", plan.tasks[t].coord, env, shapes=shapes) for t in tasks
        ]
        for oname, v in node.results.items():
            boxes = [(t, b) for t, w in zip(tasks, writes_of) for b in w.get(oname, ())]
            index[v.name] = _WriteIndex(v.name, boxes, oname in node.op.scatter_outputs)
    for cons in graph.nodes:
        by_producer: dict[int, list[str]] = {}
        for arg, v in cons.args.items():
            if v.producer is not None:
                by_producer.setdefault(v.producer.index, []).append(arg)
        if not by_producer:
            continue
        tasks = plan.node_tasks[cons.index]
        if not len(tasks):
            continue
        arrays = None if PER_TILE else region_arrays(cons, "reads", env, coords[cons.index])
        reads_of = None
        if arrays is None:
            shapes = node_shapes(cons, plan.shapes)
            reads_of = [
                node_regions(cons, "reads", plan.tasks[t].coord, env, shapes=shapes) for t in tasks
            ]
        columns: list[np.ndarray] = []  # array path: per producer, each tile's event (-1: none)
        for p_idx, args in by_producer.items():
            prod = graph.nodes[p_idx]
            # keyed by the producer tiles: a frozenset (per-tile path) or a sorted tuple (array
            # path); one pair takes one path, so the two never meet in one dict
            groups: dict[frozenset[int] | tuple[int, ...], int] = {}

            def event_of(
                reads: dict[str, list[Box]] | None,
                sources: frozenset[int] | tuple[int, ...] = frozenset(),
                args=args,
                prod=prod,
                groups=groups,
            ) -> int:
                """The event a tile with these reads of ``prod``'s outputs (or these producer
                tiles) waits on (-1: none): tiles that reach the same producer tiles share one."""
                if reads is not None:
                    for a in args:
                        for box in reads[a]:
                            sources |= index[cons.args[a].name].query(box)
                if not sources:
                    return -1
                eid = groups.get(sources, -1)
                if eid < 0:
                    eid = plan.new_event(f"{prod.name}->{cons.name}#{len(groups)}", len(sources))
                    groups[sources] = eid
                    for p in sorted(sources):
                        plan.notifies[p].append(eid)
                return eid

            if arrays is not None:
                # reads as cell ranges of the producer's write index: tiles reading different
                # boxes over the same cells reach the same producer tiles. The distinct ranges
                # go in the order tiles first make them, so events are numbered exactly as the
                # per-tile path numbers them.
                idxs = [index[cons.args[a].name] for a in args]
                rngs = [ix.cell_ranges(arrays[a]) for ix, a in zip(idxs, args)]
                keys = np.concatenate([r.reshape(len(tasks), -1) for r in rngs], axis=1)
                _, first, inverse = _unique_rows(keys)
                eid_of = np.full(len(first), -1, dtype=np.int64)
                by_first = np.argsort(first, kind="stable")
                per_arg = [_sources(ix, r[first[by_first]]) for ix, r in zip(idxs, rngs)]
                for j, u in enumerate(by_first.tolist()):
                    if len(per_arg) == 1:
                        src = per_arg[0][j]
                    else:
                        src = tuple(sorted(set().union(*(s[j] for s in per_arg))))
                    eid_of[u] = event_of(None, src)
                columns.append(eid_of[inverse.reshape(-1)])
                continue
            # tiles that read the same boxes share their event: the producer set (a frozenset
            # that can hold thousands of tiles) is built and hashed once per distinct read
            by_boxes: dict[tuple, int] = {}
            for t, reads in zip(tasks, reads_of):
                key = tuple(tuple(reads[a]) for a in args)
                eid = by_boxes.get(key)
                if eid is None:
                    eid = by_boxes[key] = event_of(reads)
                if eid >= 0:
                    plan.waits[t].append(eid)
        if columns:
            _add_waits(plan.waits, tasks, np.stack(columns, axis=1))


def _sources(index: _WriteIndex, ranges: np.ndarray) -> list[tuple[int, ...]]:
    """Per box of cells (boxes x dims x [lo, hi)), the sorted tasks writing its cells: in C
    over a tiling's grid where ``cutemk.native`` is built, else cell by cell."""
    if index.grid is not None and len(ranges) and native.lib() is not None:
        return native.cell_sources(index._shape, index.grid, ranges)
    return [tuple(sorted(index.in_cells(tuple(map(tuple, r))))) for r in ranges.tolist()]


def _add_waits(waits: list[list[int]], tasks: range, events: np.ndarray) -> None:
    """Append to each task's waits its row of ``events`` (tasks x producers, -1: none), in
    producer order: one list per task made in C where no earlier wait is there (explicit
    events come first)."""
    rows = events.tolist()
    if (events < 0).any():
        rows = [[e for e in r if e >= 0] for r in rows]
    if any(waits[t] for t in tasks):
        for t, r in zip(tasks, rows):
            waits[t] += r
    else:
        waits[tasks.start : tasks.stop] = rows


def _explicit_events(graph: Graph, plan: Plan) -> None:
    env = MappingProxyType(plan.env)  # the maps read the dims; a write would change the plan
    for em in graph.event_maps:
        ev = em.event
        shape = ev.concrete_shape(env)
        ids: dict[tuple[int, ...], int] = {}
        notifiers: dict[tuple[int, ...], int] = {}

        def eid_of(idx: tuple[int, ...], who: str) -> int:
            if len(idx) != len(shape) or any(not 0 <= i < n for i, n in zip(idx, shape)):
                raise GraphError(f"{who} maps to {ev.name}{list(idx)}, outside shape {shape}")
            if idx not in ids:
                ids[idx] = plan.new_event(f"{ev.name}{list(idx)}")
            return ids[idx]

        for node, fn in em.notify:
            for t in plan.node_tasks[node.index]:
                what = f"event {ev.name}: the notify map of {plan.tasks[t].label}"
                for idx in apply_map(fn, plan.tasks[t].coord, env, what):
                    plan.notifies[t].append(eid_of(idx, plan.tasks[t].label))
                    notifiers[idx] = notifiers.get(idx, 0) + 1
        waited: set[tuple[int, ...]] = set()
        for node, fn in em.wait:
            for t in plan.node_tasks[node.index]:
                what = f"event {ev.name}: the wait map of {plan.tasks[t].label}"
                for idx in apply_map(fn, plan.tasks[t].coord, env, what):
                    plan.waits[t].append(eid_of(idx, plan.tasks[t].label))
                    waited.add(idx)
        rank, world = env.get("RANK", 0), env.get("WORLD", 1)
        for node, fn in em.remote_wait:
            for t in plan.node_tasks[node.index]:
                what = f"event {ev.name}: the remote_wait map of {plan.tasks[t].label}"
                for r, idx in apply_rank_map(fn, plan.tasks[t].coord, env, what):
                    if not 0 <= r < world:
                        raise GraphError(
                            f"{plan.tasks[t].label} waits on {ev.name}{list(idx)} of rank {r}, "
                            f"outside the world of {world} ranks"
                        )
                    eid = eid_of(idx, plan.tasks[t].label)
                    if r == rank:
                        plan.waits[t].append(eid)
                    else:
                        plan.remote_waits[t].append((r, eid))
                    waited.add(idx)
        for idx, eid in ids.items():
            have = notifiers.get(idx, 0)
            want = ev.count_at(idx, env)
            want = have if want is None else want
            if idx in waited and want != have:
                verdict = "would deadlock" if want > have else "would release its waiters early"
                raise GraphError(
                    f"{ev.name}{list(idx)} waits for count {want} but {have} tasks "
                    f"notify it: {verdict}"
                )
            plan.event_count[eid] = want
            if em.remote_wait:
                plan.shared_events.add(eid)
