"""Graph composition: tensors (values) and tile-op calls (nodes), built once, symbolically.

Invariants: every value has exactly one producer (a graph input/weight, or one node), so the
graph is SSA and acyclic by construction; shapes are symbolic and every sym in the graph can be
inferred from the shape of some graph input; data flows graph -> instantiate (``cutemk.plan``)
-> schedule -> backend.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import torch

from . import registry
from .errors import GraphError, ShapeError
from .events import EventMap, EventTensor, IndexMap, check_map_arity
from .symbolic import Expr, IntLike, Sym, const, free_syms
from .tileop import TensorSpec, TileOp, check_call_types, check_field_types


@dataclass(eq=False)
class Value:
    """A tensor in a graph. ``kind`` is 'input', 'weight' or 'intermediate'."""

    graph: "Graph"
    name: str
    spec: TensorSpec
    kind: str
    producer: "Node | None" = None
    alias_of: "Value | None" = None
    """For an op's in-place output (``TileOp.updates``): the graph input whose memory it is."""

    @property
    def shape(self) -> tuple[IntLike, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def is_own_counter(self) -> bool:
        """An output its op keeps as a counter of its own (``TileOp.zeroed_outputs``): it starts
        zeroed, not poisoned, and no other node reads it."""
        node = self.producer
        return node is not None and any(node.results.get(o) is self for o in node.op.zeroed_outputs)

    def __repr__(self) -> str:
        return f"Value({self.name}: {self.spec}, {self.kind})"


@dataclass(eq=False)
class Node:
    """One tile-op call: its op instance and the values bound to the op's arguments."""

    index: int
    name: str
    op: TileOp
    args: dict[str, Value]
    results: dict[str, Value] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Node({self.name})"


OpBuilder = Callable[..., TileOp]


class Graph:
    """A graph of tile-op calls. Build with :meth:`input`, :meth:`weight`, :meth:`call`,
    :meth:`output`; then :meth:`compile` for a backend."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self.event_maps: list[EventMap] = []
        self._names: set[str] = set()
        self._compiled = False  # set by compile: a compiled graph reads it, so it is final

    # -- building ---------------------------------------------------------------------------
    def input(
        self, name: str, shape: Sequence[IntLike], dtype: torch.dtype = torch.float32
    ) -> Value:
        """A per-launch input (activations). Its symbolic dims are bound from its shape."""
        return self._leaf(name, shape, dtype, "input")

    def weight(
        self, name: str, shape: Sequence[IntLike], dtype: torch.dtype = torch.float32
    ) -> Value:
        """A parameter tensor, passed at every call like an input."""
        return self._leaf(name, shape, dtype, "weight")

    def call(
        self, op: Union[OpBuilder, TileOp], *args: Value, name: str | None = None, **config: Any
    ) -> Union[Value, tuple[Value, ...]]:
        """Call a tile op on graph values. ``op`` is an op builder (e.g. ``ops.gemm``) taking
        the input specs positionally and config by keyword, or an already-built op instance.
        Returns the op's output value(s) in its declared output order."""
        self._check_open()
        for i, a in enumerate(args):
            if not isinstance(a, Value) or a.graph is not self:
                raise GraphError(
                    f"argument {i} of {getattr(op, '__name__', op)} is not a value "
                    f"of graph {self.name!r}"
                )
        for a in args:
            if a.is_own_counter:
                raise GraphError(
                    f"{a.name} is {a.producer.op.name}'s own counter: no node may read it"
                )
        if not isinstance(op, TileOp) and not callable(op):
            raise GraphError(f"op must be an op builder (e.g. ops.gemm) or a TileOp, got {op!r}")
        if isinstance(op, TileOp):
            if config:
                raise GraphError(
                    "config keywords are given to the op builder, not with an op instance"
                )
            inst = op
        else:
            check_call_types(op, config, getattr(op, "__name__", str(op)))
            inst = op(*[a.spec for a in args], **config)
        if not isinstance(inst, TileOp):
            raise GraphError(f"{op} did not build a TileOp")
        out_specs = _checked_declarations(inst)
        check_field_types(inst, inst.name)
        if len(args) != len(inst.inputs):
            raise GraphError(
                f"{inst.name} takes {len(inst.inputs)} inputs {inst.inputs}, got {len(args)}"
            )
        if isinstance(op, TileOp):  # an op built elsewhere: built for these arguments?
            for iname, a in zip(inst.inputs, args):
                spec = getattr(inst, iname, None)
                if isinstance(spec, TensorSpec) and (
                    tuple(spec.shape) != tuple(a.spec.shape) or spec.dtype != a.spec.dtype
                ):
                    raise GraphError(
                        f"{inst.name} was built with {iname} of shape {tuple(spec.shape)} "
                        f"{spec.dtype}, but is called on {a.name} of shape "
                        f"{tuple(a.spec.shape)} {a.spec.dtype}"
                    )

        def names_of(n: str) -> list[str]:  # the node's name and its values' names
            return [n] + [f"{n}.{o}" for o in out_specs]

        node_name = name or next(
            f"{inst.name}{i}"
            for i in range(len(self.nodes) + len(self._names) + 1)
            if not any(v in self._names for v in names_of(f"{inst.name}{i}"))
        )
        for v in names_of(node_name):
            self._claim(v)
        node = Node(len(self.nodes), node_name, inst, dict(zip(inst.inputs, args)))
        for oname, target in inst.updates.items():
            src = node.args.get(target)
            if src is None or src.kind != "input":
                raise GraphError(
                    f"{inst.name} updates {target!r} in place: it must be a graph input"
                )
            spec = out_specs[oname]
            if tuple(spec.shape) != tuple(src.spec.shape) or spec.dtype != src.spec.dtype:
                raise GraphError(f"{inst.name}.{oname} must have {target}'s shape and dtype")
        for oname, spec in out_specs.items():
            v = Value(self, f"{node_name}.{oname}", spec, "intermediate", node)
            if oname in inst.updates:
                v.alias_of = node.args[inst.updates[oname]]
            node.results[oname] = v
            self.values.append(v)
        self.nodes.append(node)
        outs = tuple(node.results[o] for o in inst.outputs)
        return outs[0] if len(outs) == 1 else outs

    def output(self, value: Value, name: str | None = None) -> Value:
        """Mark an intermediate value as a graph output (returned by a compiled graph)."""
        self._check_open()
        if not isinstance(value, Value) or value.graph is not self or value.producer is None:
            what = value.name if isinstance(value, Value) else repr(value)
            raise GraphError(f"output {what} must be a value produced by a node of this graph")
        if value in self.outputs:
            raise GraphError(f"{value.name} is already an output")
        if name is not None and name != value.name:
            self._claim(name)
            value.name = name
        self.outputs.append(value)
        return value

    def event(
        self,
        shape: Sequence[IntLike],
        count: Any = None,
        *,
        name: str = "event",
        notify: Sequence[tuple[Value, IndexMap]] = (),
        wait: Sequence[tuple[Value, IndexMap]] = (),
        remote_wait: Sequence[tuple[Value, Any]] = (),
    ) -> EventTensor:
        """Declare an explicit event tensor (Event Tensor paper, Fig. 3).

        ``notify``/``wait`` pair a value *produced by* the node that notifies / waits with an
        index map from that node's tile coordinate to event indices. An explicit event adds
        ordering to a (producer, consumer) pair: the pair's automatic events (its data
        dependencies) stay, so an ordering event can never drop one, and the explicit event's
        counts are checked when the graph is instantiated.

        ``remote_wait`` (distributed graphs) pairs a value with a map from the waiting node's
        tile coordinate to ``(rank, index)`` pairs: the task waits until element ``index`` of
        this event *on rank* ``rank`` is complete (see ``cutemk.events.RankIndexMap``).
        """
        self._check_open()
        if not isinstance(name, str) or not name:
            raise GraphError(f"an event's name must be a non-empty str, got {name!r}")
        _check_dims(shape, f"event {name}: shape", GraphError, GraphError)
        ev = EventTensor(
            tuple(const(d) if not isinstance(d, int) else d for d in shape), count, name
        )
        if callable(count):
            check_map_arity(count, ((0,) * len(shape), {}), f"event {name}: count", env_kw=False)
        em = EventMap(ev)
        for kind, pairs, out in (
            ("notify", notify, em.notify),
            ("wait", wait, em.wait),
            ("remote_wait", remote_wait, em.remote_wait),
        ):
            if not isinstance(pairs, (tuple, list)):
                raise GraphError(
                    f"event {name}: {kind} must be a list of (value, map) pairs, got {pairs!r}"
                )
            for entry in pairs:
                if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                    raise GraphError(
                        f"event {name}: each {kind} entry is a (value, map) pair, got {entry!r}"
                    )
                v, fn = entry
                node = self._node_of(v, f"event {name}: a {kind} entry")
                grid = node.op.grid()
                ndim = len(grid) if isinstance(grid, (tuple, list)) else None
                what = f"event {name}: the {kind} map of {node.name}"
                check_map_arity(fn, None if ndim is None else (0,) * ndim, what)
                out.append((node, fn))
        if not em.notify or not (em.wait or em.remote_wait):
            raise GraphError(f"event {name}: needs at least one notifying and one waiting node")
        self.event_maps.append(em)
        return ev

    # -- queries ----------------------------------------------------------------------------
    @property
    def leaves(self) -> list[Value]:
        return [v for v in self.values if v.kind in ("input", "weight")]

    def syms(self) -> dict[str, Sym]:
        out: dict[str, Sym] = {}
        for v in self.values:
            for s in free_syms(*v.shape):
                if out.setdefault(s.name, s) != s:
                    raise GraphError(
                        f"two different syms named {s.name}: {out[s.name]!r} and {s!r}: "
                        "declare a dim once and use it everywhere"
                    )
        return out

    def world_size(self) -> int | None:
        """The number of ranks the graph's communicating ops (those that reach other ranks'
        values: all-gather, reduce-scatter) were built for; None if it has none. Raises
        :class:`GraphError` if two of them were built for different worlds."""
        built = [(n.name, getattr(n.op, "world", None)) for n in self.nodes if n.op.peer_values]
        for name, w in built[1:]:
            if w != built[0][1]:
                raise GraphError(
                    f"graph {self.name!r}: {built[0][0]} is built for {built[0][1]} ranks, "
                    f"{name} for {w}; one graph runs on one world"
                )
        return built[0][1] if built else None

    def validate(self) -> None:
        """Check the graph before instantiation; raises :class:`GraphError`."""
        if not self.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        self.world_size()
        bound = {s for v in self.leaves for s in v.shape if isinstance(s, Sym)}
        syms = self.syms()
        for name, s in syms.items():
            if s not in bound:
                raise GraphError(
                    f"sym {name} appears in the graph but is not a plain dim of any "
                    "input or weight, so no launch can bind it"
                )
        for em in self.event_maps:
            ev = em.event
            count = (ev.count,) if isinstance(ev.count, Expr) else ()
            for s in free_syms(*ev.shape, *count):
                if syms.get(s.name) != s:
                    raise GraphError(
                        f"event {ev.name}: its shape or count uses sym {s.name}"
                        + ("" if s.name not in syms else f" (max {s.max})")
                        + ", which no input or weight of the graph declares"
                        + ("" if s.name not in syms else " with those bounds")
                    )
        outputs = {v.name for v in self.outputs}
        for node in self.nodes:  # values other ranks reach live in symmetric memory
            for a in node.op.peer_values:
                v = node.args.get(a) or node.results[a]
                if v.producer is None:
                    raise GraphError(
                        f"{node.name}.{a} ({v.name}) is reached by other ranks, so it must live "
                        "in symmetric memory: produce it in the graph (copy the input with an "
                        "op), not pass it as an input"
                    )
                if v.name in outputs:
                    raise GraphError(
                        f"{v.name} is reached by other ranks, so it lives in symmetric memory "
                        "and cannot be a graph output (copy it out with another op)"
                    )
        updated: dict[str, str] = {}  # input name -> the node updating it in place
        for node in self.nodes:
            for target in node.op.updates.values():
                name = node.args[target].name
                if name in updated:
                    raise GraphError(
                        f"{name} is updated in place by {updated[name]} and {node.name}"
                    )
                updated[name] = node.name
        for node in self.nodes:
            for a, v in node.args.items():
                if v.producer is not None and v.producer.index >= node.index:
                    raise GraphError(f"{node.name}.{a} reads {v.name} before it is produced")
                if v.name in updated and updated[v.name] != node.name:
                    raise GraphError(
                        f"{node.name}.{a} reads {v.name}, which {updated[v.name]} updates in "
                        "place: read that op's output instead (nothing orders a read of the old "
                        "contents before the update)"
                    )
            node.op.check_producers(
                {
                    a: (v.producer.op if v.producer is not None else None)
                    for a, v in node.args.items()
                }
            )

    def compile(self, backend: str | None = None, **options: Any):
        """Compile for a backend: 'cute' (one persistent CuTe DSL kernel; the default where a
        GPU exists) or 'interpret' (CPU reference with simulated SMs).

        Common options: ``num_sms``, ``scheduler`` ('static' | 'dynamic' | a scheduler
        instance). Interpreter: ``seed``, ``check_races``. Cute: ``watchdog``, ``timeout_s``,
        ``profile`` (True: per-task and per-CTA timestamps; ``"slices"``: each ring slice's
        issue and landing too), ``poison_outputs``.
        """
        self.validate()
        if backend is None:
            backend = "cute" if torch.cuda.is_available() else "interpret"
        try:
            cls = registry.backend(backend)
        except ValueError as e:
            raise GraphError(str(e)) from None
        compiled = cls(self, **options)
        self._compiled = True  # only once a backend took it: a refused option leaves it open
        return compiled

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._compiled:
            raise GraphError(
                f"graph {self.name!r} has been compiled and its compiled graphs read it: it "
                "cannot change any more (build a new Graph)"
            )

    def _leaf(self, name: str, shape: Sequence[IntLike], dtype: torch.dtype, kind: str) -> Value:
        self._check_open()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{name}: dtype must be a torch.dtype, got {dtype!r}")
        _check_dims(shape, f"{name}.shape", TypeError, ShapeError)
        self._claim(name)
        v = Value(
            self,
            name,
            TensorSpec(tuple(const(d) if not isinstance(d, int) else d for d in shape), dtype),
            kind,
        )
        self.values.append(v)
        return v

    def _claim(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"a name in graph {self.name!r} must be a non-empty str, got {name!r}")
        if name in self._names:
            raise GraphError(f"name {name!r} is used twice in graph {self.name!r}")
        self._names.add(name)

    def _node_of(self, v: Value, what: str) -> Node:
        if not isinstance(v, Value) or v.producer is None or v.graph is not self:
            raise GraphError(f"{what}: expected a value produced by a node of this graph")
        return v.producer

    def __repr__(self) -> str:
        lines = [f"Graph {self.name}"]
        for v in self.leaves:
            lines.append(f"  {v.kind} {v.name}: {v.spec}")
        for n in self.nodes:
            ins = ", ".join(f"{k}={v.name}" for k, v in n.args.items())
            outs = ", ".join(f"{v.name}: {v.spec}" for v in n.results.values())
            lines.append(f"  {n.name} = {n.op.name}({ins}) -> {outs}")
        lines.append("  outputs: " + ", ".join(v.name for v in self.outputs))
        return "\n".join(lines)


def _checked_declarations(op: TileOp) -> dict[str, TensorSpec]:
    """What a call relies on an op class to declare (its name, argument names, output specs and
    the names its class attributes list), checked when it is called; returns its output specs.
    A slip here (an output named like an input, a spec that is not a ``TensorSpec``) would
    otherwise surface as a lost dependency, a wrong tensor in a reference, or a raw error at
    the first launch."""
    name = getattr(op, "name", None)
    if not isinstance(name, str) or not name:
        raise GraphError(f"{type(op).__name__}: a TileOp needs a class attribute name (a str)")
    if not dataclasses.is_dataclass(op):
        raise GraphError(f"{name}: a TileOp must be a dataclass (@dataclass(frozen=True))")
    for attr in ("inputs", "outputs"):
        names = getattr(op, attr, None)
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
            raise GraphError(f"{name}.{attr} must be a tuple of names, got {names!r}")
        if len(set(names)) != len(names):
            raise GraphError(f"{name}.{attr} names an argument twice: {tuple(names)}")
    ins, outs = set(op.inputs), set(op.outputs)
    if ins & outs:
        raise GraphError(
            f"{name}: {sorted(ins & outs)} named both an input and an output (a tile's "
            "reads, writes and reference see one tensor under each name)"
        )
    specs = op.output_specs()
    if not isinstance(specs, dict) or set(specs) != outs:
        got = sorted(specs) if isinstance(specs, dict) else repr(specs)
        raise GraphError(
            f"{name}.output_specs() must be a dict with one TensorSpec for each of its "
            f"outputs {tuple(op.outputs)}, got {got}"
        )
    for oname, spec in specs.items():
        what = f"{name}.output_specs()[{oname!r}]"
        if not isinstance(spec, TensorSpec):
            raise GraphError(f"{what} must be a TensorSpec, got {spec!r}")
        if not isinstance(spec.dtype, torch.dtype):
            raise GraphError(f"{what}: dtype must be a torch.dtype, got {spec.dtype!r}")
        if not isinstance(spec.shape, (tuple, list)):
            raise GraphError(f"{what}: shape must be a tuple of ints and syms, got {spec.shape!r}")
        for d, dim in enumerate(spec.shape):
            if isinstance(dim, bool) or not isinstance(dim, (int, Expr)):
                raise GraphError(f"{what}: shape[{d}] must be an int or a sym, got {dim!r}")
            if _can_be_negative(dim):
                raise GraphError(f"{what}: shape[{d}] = {dim} can be negative")
    # (scatter_outputs, data_inputs, ... may name arguments an op has only in some configs)
    unknown = set(op.updates) - outs
    if unknown:
        raise GraphError(
            f"{name}.updates names {sorted(unknown)}, not among its outputs {tuple(op.outputs)}"
        )
    return specs


def _check_dims(shape: Any, what: str, type_error: type, sign_error: type) -> None:
    """``shape`` is a tuple of ints and syms none of which can be negative; ``what`` names it
    in the errors (``type_error`` for a wrong type, ``sign_error`` for a negative dim)."""
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise type_error(f"{what} must be a tuple of ints and syms, got {shape!r}")
    for d, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, (int, Expr)):
            raise type_error(f"{what}[{d}] must be an int or a sym, got {dim!r}")
        if _can_be_negative(dim):
            raise sign_error(f"{what}[{d}] must not be negative, got {dim}")


def _can_be_negative(dim: IntLike) -> bool:
    """True if ``dim`` is negative, or is negative with its syms at some corner of their ranges
    (a witness: interval bounds alone would refuse e.g. ``T - T // 2``)."""
    if isinstance(dim, int):
        return dim < 0
    if dim.bounds()[0] >= 0:
        return False
    syms = sorted(free_syms(dim), key=lambda v: v.name)[:8]
    for corner in itertools.product(*((v.min, v.max) for v in syms)):
        if dim.eval({v.name: c for v, c in zip(syms, corner)}) < 0:
            return True
    return False
