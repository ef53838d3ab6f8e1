"""The tile-operator protocol.

A tile op is a frozen dataclass (its config plus the specs of its inputs) that *declares*:

- its task grid, in symbolic dims (:meth:`TileOp.grid`);
- for one tile, the box (or list of boxes) of each tensor argument it reads and writes
  (:meth:`reads`, :meth:`writes`; reads may name the op's own outputs, i.e. results other
  tiles of the op wrote: the race checker sees those, and they derive no events). With
  ``data=None`` the boxes must be a sound superset valid for any data
  (used to derive events when the graph is instantiated); with ``data`` (the live tensors) an
  op whose regions depend on values computed earlier in the same launch returns the exact boxes
  (used by the interpreter's race checker);
- whether a tile exists given such data (:meth:`exists`): a data-dependent task grid is declared
  at its maximum and tiles that do not exist are skipped, still completing their events;
- a cost estimate in microseconds and a torch :meth:`reference` that computes one tile in place;
- its device contract, in phases, each with the threads it runs on (see :class:`RingTile`):
  a *SIMT op* (``ring_tile() is None``) has one body, :meth:`device_tile`, run by the SIMT group
  (``cutemk.device.config.NUM_THREADS`` consumer threads, synchronised by ``simt_sync``); a
  *ring op* streams operands through the megakernel's shared-memory ring and splits its tile
  into loads of operands no task of the launch writes (:meth:`device_load_independent`, issued
  by the producer warp *before* the task's events are met), loads of operands produced in the
  launch (:meth:`device_load_dependent`, after the acquire), the consumers' compute into a
  shared-memory staging buffer (:meth:`device_compute`), and the asynchronous store the storer
  warp issues from it (:meth:`device_store`), whose completion precedes the notify.

Ops never name events: the graph derives them from the regions (see ``cutemk.plan``). Core
modules never import a concrete op; ops register themselves with :func:`register_op`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence, Union

import numpy as np
import torch

from .errors import DTypeError, ShapeError
from .symbolic import Bindings, IntLike, Sym, evaluate, shape_str

Box = tuple[tuple[int, int], ...]
"""Half-open interval per tensor dim: ((lo0, hi0), (lo1, hi1), ...)."""

Region = Union[Box, list]
"""What a tile touches of one tensor: a box, or a list of boxes."""

Coord = tuple[int, ...]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RingTile:
    """How a ring op's tile uses the megakernel's shared-memory ring (all compile-time)."""

    slices: int  # ring slots one tile streams through (e.g. K / BLOCK_K)
    tx_bytes: int  # bytes TMA lands in a slot per slice (the full barrier's transaction count)
    slot_bytes: int  # room one slice needs (a multiple of 1024: swizzled TMA tiles)
    epi_bytes: int  # shared memory staging the tile's output for its asynchronous store


@dataclass(frozen=True)
class TensorSpec:
    """Shape (ints or symbolic exprs) and dtype of a tensor in a graph."""

    shape: tuple[IntLike, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def concrete(self, env: Bindings) -> tuple[int, ...]:
        return tuple(evaluate(d, env) for d in self.shape)

    def __str__(self) -> str:
        return f"{shape_str(self.shape)}:{str(self.dtype).removeprefix('torch.')}"


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def block(index: int, size: int, extent: int) -> tuple[int, int]:
    """Interval of block ``index`` of ``size`` elements, clipped to ``extent``."""
    lo = index * size
    return (min(lo, extent), min(lo + size, extent))


def box_is_empty(box: Box) -> bool:
    return any(hi <= lo for lo, hi in box)


def as_boxes(region: Region) -> list[Box]:
    return region if isinstance(region, list) else [region]


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def blocks(index: np.ndarray, size: int, extent: int) -> np.ndarray:
    """:func:`block` of every index at once: (n, 2) intervals."""
    lo = np.minimum(index * size, extent)
    return np.stack([lo, np.minimum(index * size + size, extent)], axis=1)


def span(lo: int, hi: int, n: int) -> np.ndarray:
    """The interval [lo, hi) for n tiles: (n, 2)."""
    return np.broadcast_to(np.array([lo, hi], dtype=np.int64), (n, 2))


def boxes(*intervals: np.ndarray) -> np.ndarray:
    """Per-dim (n, 2) intervals -> (n, ndim, 2) boxes, one per tile."""
    return np.stack(intervals, axis=1).astype(np.int64, copy=False)


class TileOp:
    """Base class of tile operators. Subclasses are frozen dataclasses."""

    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]]
    outputs: ClassVar[tuple[str, ...]]

    # -- declarations -------------------------------------------------------------------
    def input_specs(self) -> dict[str, TensorSpec]:
        return {n: getattr(self, n) for n in self.inputs}

    def output_specs(self) -> dict[str, TensorSpec]:
        raise NotImplementedError(f"op {self.name} declares no output_specs()")

    def grid(self) -> tuple[IntLike, ...]:
        raise NotImplementedError(f"op {self.name} declares no grid()")

    def reads(
        self, coord: Coord, env: Bindings, data: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, Box]:
        raise NotImplementedError(f"op {self.name} declares no reads()")

    def writes(
        self, coord: Coord, env: Bindings, data: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, Box]:
        raise NotImplementedError(f"op {self.name} declares no writes()")

    def exists(self, coord: Coord, env: Bindings, data: Mapping[str, torch.Tensor]) -> bool:
        """False when data computed earlier in the launch says this tile has no work."""
        return True

    def region_arrays(
        self, which: str, env: Bindings, coords: np.ndarray
    ) -> dict[str, np.ndarray] | None:
        """Optional: :meth:`reads` (``which == "reads"``) or :meth:`writes` without data for
        the tiles ``coords`` (n, grid rank) at once, one box per tile and tensor, each an
        int64 array (n, ndim, 2) equal to what the per-tile method gives. Planning a new token
        count then costs array operations instead of a Python call per tile. None (the
        default): the per-tile methods are called."""
        return None

    uniform_cost: ClassVar[bool] = False
    """True if :meth:`cost` does not depend on the tile (only on the bound dims)."""

    def cost_array(self, env: Bindings, coords: np.ndarray) -> np.ndarray | None:
        """:meth:`cost` of the tiles ``coords`` at once (n,), or None (then per tile)."""
        if self.uniform_cost and len(coords):
            c = self.cost(tuple(coords[0].tolist()), env)
            if isinstance(c, (int, float, np.integer, np.floating)):
                return np.full(len(coords), float(c))
        return None  # (a cost that is no number: the planner's per-tile check names it)

    peer_values: ClassVar[tuple[str, ...]] = ()
    """Inputs/outputs that other ranks' tiles read or write (distributed ops): the runtime puts
    them in symmetric memory and ``device_tile`` gets one peer table per name (int64
    ``[rank, addr_0, ...]``) after the outputs; references get a ``cutemk.comm.PeerTable``
    under ``cutemk.comm.peer_key(value)``."""

    data_inputs: ClassVar[tuple[str, ...]] = ()
    """Inputs whose values (not only shapes) decide the task grid or regions."""

    updates: ClassVar[dict[str, str]] = {}
    """Outputs that are an input updated in place (output name -> input name), e.g. a KV-cache
    append: the output is the input's memory, the input must be a graph input (a leaf) read by
    no other node (later readers read the output), and elements the op does not write keep the
    caller's values."""

    scatter_outputs: ClassVar[tuple[str, ...]] = ()
    """Outputs the tiles write at data-dependent places (a scatter): without ``data`` their
    write boxes are supersets that may overlap between tiles (a reader then waits for every
    tile that may write its box); with ``data`` they are exact, and the interpreter checks
    that no two unordered tiles write the same element."""

    zeroed_outputs: ClassVar[tuple[str, ...]] = ()
    """Outputs the op keeps as counters of its own (e.g. how many tiles of a group have
    finished): allocated zeroed instead of poisoned, and every launch must leave them zero.
    No other node may read them; their writes need not be declared."""

    def cost(self, coord: Coord, env: Bindings) -> float:
        """Estimated microseconds for one tile on one SM (see ``cutemk.costmodel``)."""
        return 1.0

    def host_args(self, tensors: tuple) -> tuple:
        """Extra kernel arguments built on the host at each launch from the op's cute tensors
        (``inputs + outputs`` order), e.g. TMA descriptors. Called inside the ``@cute.jit``
        launch function; ``device_tile`` receives ``tensors + host_args(tensors)``."""
        return ()

    def order_key(self, coord: Coord) -> tuple:
        """Preferred run order of this op's tiles (schedulers break ties with it). The default
        is grid order; an op whose tiles share inputs can group them, e.g. a GEMM runs blocks
        of row tiles across the columns so one wave of SMs reads few A and B tiles."""
        return tuple(coord)

    def order_key_array(self, coords: np.ndarray) -> np.ndarray:
        """:meth:`order_key` of the tiles ``coords`` (tasks, grid rank) at once, as a
        (tasks, key length) array. An op overriding :meth:`order_key` overrides this too where
        its planning time matters; the fallback calls it per tile."""
        if type(self).order_key is TileOp.order_key:
            return coords
        keys = [self.order_key(tuple(c)) for c in coords.tolist()]
        return np.asarray(keys).reshape(len(coords), -1)

    def reads_async_proxy(self) -> bool:
        """True if the device tile reads global memory through the async proxy (TMA): the
        megakernel then fences every task's stores before notifying them."""
        return False

    def reference(self, coord: Coord, env: Bindings, t: Mapping[str, torch.Tensor]) -> None:
        """Compute one tile with torch, writing its outputs in place into ``t``."""
        raise NotImplementedError(f"op {self.name} has no torch reference()")

    def check_producers(self, producers: Mapping[str, TileOp | None]) -> None:
        """Called by ``Graph.validate`` with the op producing each input (None for a leaf):
        raise ``GraphError`` where they disagree on something the shapes do not show (e.g.
        the number of experts the routing and the expert weights assume)."""

    def check_bindings(self, env: Mapping[str, int]) -> None:
        """Called when a plan binds the graph's syms (``plan.instantiate``): raise
        ``ShapeError`` where a bound size breaks a rule the builder could check only for
        static sizes (e.g. a gate/up width that must be even)."""

    token_local: ClassVar[bool] = False
    """The op keeps tokens apart: whatever the other tokens' rows hold (NaN, inf, ids out of
    range), a token's final outputs in a graph of such ops depend on its own rows (and on
    values no token writes) only, and the op's tiles read and write inside their buffers. A
    row-wise op (GEMM, RMSNorm, add) does so row by row; the MoE block's routing, permute,
    grouped GEMMs and combine do so together: routing keeps each expert's rows in token
    order (a token's rank in its expert does not depend on the tokens after it), GEMM rows
    are independent and the combine reads a token's own slots. Graphs of such ops can take
    the token count as device data (one CUDA-graph capture for every count,
    ``CuteGraph.live``): a plan serves every count up to its own, the tokens past the live
    count computed from whatever the buffers hold into rows (or slots) no live token reads.
    Such an op takes its token-dependent extents from its bound tensors' shapes and its
    strides from their layouts, and relies on no zero fill past a token-dependent extent: a
    live launch binds extents at the plan's count over buffers (and TMA descriptors) at the
    maximum."""

    live_rows_inputs: ClassVar[tuple[str, ...]] = ()
    """Inputs whose token rows past their bound extent the op treats as absent (as if they did
    not exist, e.g. a top-k picking no expert for them) while it still covers its outputs'
    rows. A live launch (``CuteGraph.live``) binds these values' token dim to the live count
    itself rather than the plan's, so the tokens between the two cost nothing downstream (the
    MoE block's routing then places only live tokens). Every other op touching such a value
    must tolerate the smaller extent (stores masked by it, or by a TMA descriptor at the
    maximum)."""

    live_updates: ClassVar[bool] = False
    """The op's in-place updates (``updates``) are only for tokens inside its
    ``live_rows_inputs``' extents (e.g. a KV append skipping the rows past the live count), so
    a graph with it can take the token count as device data: its cache is never written for
    the plan's tokens past the live count."""

    # -- device contract (CuTe DSL; see the module docstring) -------------------------------
    exists_on_device: ClassVar[bool] = False
    """True if :meth:`device_exists` reads data to decide whether a tile exists."""

    independent_inputs: ClassVar[tuple[str, ...]] = ()
    """Ring ops: inputs :meth:`device_load_independent` loads. The megakernel issues those loads
    before the task's events only where no node of the graph produces these inputs."""

    simt_threads: ClassVar[int] = 128
    """SIMT ops: the threads :meth:`device_tile` runs on (``tidx`` below it), 128 (the SIMT
    group, ``cutemk.device.config.NUM_THREADS``) or 256 (``SIMT_WIDE_THREADS``: both consumer
    warpgroups, for a latency-bound body that wants twice the loads in flight). The body
    strides by it and syncs with ``simt_sync(simt_threads)``."""

    def ring_tile(self) -> RingTile | None:
        """None for a SIMT op; a ring op's use of the ring."""
        return None

    def device_smem_bytes(self) -> int:
        """Scratch shared memory of :meth:`device_tile` (SIMT ops)."""
        return 0

    def device_exists(self, tensors, coord0, coord1):
        """Device twin of :meth:`exists` (only called where ``exists_on_device``)."""
        raise NotImplementedError(f"{self.name}: exists_on_device without device_exists")

    def device_task_word(self, tensors, coord0, coord1):
        """Ring op with ``exists_on_device``: the Int32 of launch data its loads depend on
        (a grouped GEMM's expert), read by the producer warp once per task, after the task's
        events, and passed to both load phases as ``word``; the slices never re-read it."""
        raise NotImplementedError(f"{self.name}: exists_on_device without device_task_word")

    early_exists: ClassVar[bool] = False
    """Ring op with ``exists_on_device`` whose :meth:`device_exists`, :meth:`device_task_word`
    and :meth:`device_slices` read only its ``data_inputs``: where no node writes those, the
    producer decides the tile before its events and issues its independent loads first."""

    def independent_loads_allowed(self, producers: Mapping[str, TileOp]) -> bool:
        """Whether :meth:`device_load_independent` may run before the task's events although
        nodes of the launch write some ``independent_inputs`` (``producers``: input name -> the
        op writing it; never called with none). Only an op that knows what those producers
        write, and leaves exactly that to :meth:`device_load_dependent`, says yes."""
        return False

    dynamic_slices: ClassVar[bool] = False
    """Ring op with ``exists_on_device``: a tile streams :meth:`device_slices` slices, read
    from launch data (at most ``ring_tile().slices``), instead of always that many."""

    def device_slices(self, tensors, coord0, coord1, word):
        """Int32 slices a live tile streams, from its task ``word`` (0 where it streams
        nothing, e.g. a tile of bad data that only writes NaN); the producer takes it with the
        verdict and the consumers (``device_compute``) must count the same."""
        raise NotImplementedError(f"{self.name}: dynamic_slices without device_slices")

    def device_tile(self, tensors, coord0, coord1, tidx, smem_ptr) -> None:
        """SIMT op: one tile on its :attr:`simt_threads` (``tidx`` below it), ``smem_ptr``
        1024-byte aligned scratch of :meth:`device_smem_bytes`. ``tensors`` are the op's
        ``inputs + outputs`` (+ peer tables) + ``host_args``."""
        raise NotImplementedError(f"op {self.name} has no device function")

    def device_load_independent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        """Ring op, producer warp: slice ``kt``'s loads of ``independent_inputs`` into ring slot
        ``idx`` completing on mbarrier ``bar`` (``ring``: the ring's base, ``stages`` slots of
        ``slot`` bytes). ``word``: :meth:`device_task_word` where ``exists_on_device`` (such
        ops' loads all follow the acquire), else 0."""
        raise NotImplementedError

    def device_load_dependent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        """Ring op, producer warp: slice ``kt``'s other loads (issued after the acquire and a
        generic-to-async proxy fence)."""
        raise NotImplementedError

    @property
    def prefetches_l2(self) -> bool:
        """Ring op whose tiles prefetch into L2, before their events, the independent loads of
        all their slices (:meth:`device_prefetch_l2`): an op's choice, e.g. a projection whose
        weights would otherwise wait for ring slots that the tiles before it hold while HBM is
        idle."""
        return False

    def device_prefetch_l2(self, tensors, coord0, coord1, word, kt, ring, stages, slot):
        """Ring op with :attr:`prefetches_l2`, one elected producer lane: slice ``kt``'s
        independent loads into L2 only (no slot, no barrier)."""
        raise NotImplementedError

    def device_compute(
        self,
        tensors,
        coord0,
        coord1,
        word,
        full,
        empty,
        count,
        ring,
        stages,
        slot,
        epi,
        ctid,
        wait,
        epi_free=None,
    ):
        """Ring op, every consumer thread (``ctid`` in ``[0, consumer threads)``; ``word`` as the
        loads got it, handed over with the task): consume ring
        slices ``count, count + 1, ...`` (``full`` / ``empty``: the ring's mbarriers, waited on
        through ``wait``, see ``cutemk.device.ring``), stage the output in ``epi`` (after
        ``cutemk.device.ring.epi_acquire(epi_free, ...)``, exactly once a tile: the previous
        tile's store has read it) fenced into the async proxy, and return the ring count after
        the tile."""
        raise NotImplementedError

    def device_store(self, tensors, coord0, coord1, epi) -> None:
        """Ring op, the storer warp: issue the asynchronous store of the tile staged in ``epi``
        (the megakernel commits it, waits for it and then notifies)."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------
    def label(self, coord: Coord) -> str:
        return f"{self.name}{list(coord)}"

    def describe(self) -> dict[str, Any]:
        """JSON-able description for dumps."""
        out: dict[str, Any] = {"op": self.name}
        for f in self.__dataclass_fields__:  # type: ignore[attr-defined]
            v = getattr(self, f)
            out[f] = str(v)
        return out


_REGISTRY: dict[str, type[TileOp]] = {}


def register_op(cls: type[TileOp]) -> type[TileOp]:
    """Class decorator: make an op known by name (``registered_ops``), refusing two op classes
    with the same name (the name labels tasks, events and dumps)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"tile op name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    _check_types_when_built(cls)
    return cls


def _check_types_when_built(cls: type[TileOp]) -> None:
    """Run :func:`check_field_types` on every instance of ``cls`` before its own
    ``__post_init__``, however it is built (``g.call``, the op's builder, the class itself,
    ``dataclasses.replace``): the op's checks may compare a value (``eps > 0``) before any
    check would have named a string or a bool passed for it."""
    post = getattr(cls, "__post_init__", None)  # its own, or a base class's
    if getattr(post, "_checks_types", False):
        return
    if post is not None:

        def __post_init__(self) -> None:
            check_field_types(self, type(self).name)
            post(self)

        __post_init__._checks_types = True
        cls.__post_init__ = __post_init__
        return
    init = cls.__init__  # no __post_init__: the dataclass's __init__ calls none

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        check_field_types(self, type(self).name)

    __init__._checks_types = True
    cls.__init__ = __init__


def registered_ops() -> dict[str, type[TileOp]]:
    return dict(_REGISTRY)


# -- argument checks shared by op builders ----------------------------------------------------
def expect_ndim(spec: TensorSpec, ndim: int, arg: str) -> None:
    if spec.ndim != ndim:
        raise ShapeError(f"{arg} must be {ndim}-D, got shape {shape_str(spec.shape)}")


def expect_dtype(spec: TensorSpec, allowed: Sequence[torch.dtype], arg: str) -> None:
    if spec.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise DTypeError(f"{arg} must have dtype in ({names}), got {spec.dtype}")


def expect_positive_int(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


def expect_positive_sizes(**sizes: Any) -> None:
    """Layer sizes are positive ints; the error names the argument (not an op deep inside)."""
    for name, v in sizes.items():
        expect_positive_int(v, name)


def expect_same_dim(a: IntLike, b: IntLike, what: str) -> None:
    """Static check that two dims are the same int or the same symbolic expression."""
    if a != b:
        if isinstance(a, Sym) and isinstance(b, Sym) and a.name == b.name:
            raise ShapeError(
                f"{what}: two different syms named {a.name} ({a!r} and {b!r}): declare a "
                "dim once and use it everywhere"
            )
        raise ShapeError(f"{what}: {a} != {b}")


_FIELD_KINDS: dict[type, dict[str, tuple[str, bool]]] = {}
_A = {"bool": "a bool", "int": "an int", "float": "a number"}


def _kind_of(annotation: Any) -> tuple[str, bool] | None:
    """(``bool`` / ``int`` / ``float``, None allowed) of an annotation naming one of them
    (alone or with None), from its text; None for any other annotation."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    text = text.replace(" ", "")
    for kind in ("bool", "int", "float"):
        if text == kind:
            return kind, False
        if text in (f"{kind}|None", f"None|{kind}", f"Optional[{kind}]"):
            return kind, True
    return None


def check_call_types(builder: Any, config: Mapping[str, Any], what: str) -> None:
    """:func:`check_field_types` for the keyword arguments of an op builder, by its
    signature's annotations, before it runs (its own checks may compare a value first)."""
    import inspect

    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        return
    for name, value in config.items():
        p = params.get(name)
        kind = None if p is None else _kind_of(p.annotation)
        if kind is not None:
            _check_value(value, name, *kind, what)


def _field_kinds(cls: type) -> dict[str, tuple[str, bool]]:
    """Per dataclass field annotated ``bool``, ``int`` or ``float`` (or one of them or None):
    its kind and whether None is allowed; other fields are not listed. Read from the
    annotations' text (modules here use postponed annotations), so names imported only for
    type checking do not matter."""
    kinds = _FIELD_KINDS.get(cls)
    if kinds is None:
        import dataclasses

        kinds = {}
        for f in dataclasses.fields(cls):
            kind = _kind_of(f.type)
            if kind is not None:
                kinds[f.name] = kind
        _FIELD_KINDS[cls] = kinds
    return kinds


def check_field_value(cls: type, name: str, value: Any, what: str) -> None:
    """:func:`check_field_types` for one value of field ``name`` of dataclass ``cls``."""
    kind = _field_kinds(cls).get(name)
    if kind is not None:
        _check_value(value, name, *kind, what)


def check_field_types(obj: Any, what: str) -> None:
    """A dataclass's ``bool`` / ``int`` / ``float`` fields hold values of those types: a
    switch takes a bool (``"no"`` or ``1`` would be read as on), a size an int that is not a
    bool, a float a finite number; None only where the field allows it. ``TypeError`` /
    ``ValueError`` naming ``what`` and the field."""
    for name, (kind, optional) in _field_kinds(type(obj)).items():
        _check_value(getattr(obj, name), name, kind, optional, what)


def check_positive_fields(obj: Any, what: str) -> None:
    """A config dataclass's sizes (``int`` fields) are at least 1 and its ``float`` fields above
    0 where set: a negative tile or head count would otherwise pass until a graph at some
    batch size builds an op from it. ``ValueError`` naming ``what`` and the field."""
    for name, (kind, _) in _field_kinds(type(obj)).items():
        value = getattr(obj, name)
        if value is None or kind == "bool":
            continue
        if (kind == "int" and value < 1) or (kind == "float" and not value > 0):
            need = "a positive int" if kind == "int" else "above 0"
            raise ValueError(f"{what}: {name} must be {need}, got {value!r}")


def _check_value(value: Any, name: str, kind: str, optional: bool, what: str) -> None:
    import math

    if value is None:
        if not optional:
            raise TypeError(f"{what}: {name} must be {_A[kind]}, got None")
        return
    if kind == "bool":
        ok = isinstance(value, (bool, np.bool_))
    elif kind == "int":
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    else:
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
            value, (bool, np.bool_)
        )
        if ok and not math.isfinite(value):
            raise ValueError(f"{what}: {name} must be finite, got {value!r}")
    if not ok:
        raise TypeError(f"{what}: {name} must be {_A[kind]}, got {value!r}")
