"""One CUDA-graph capture for every token count: the token count as device data.

A :class:`~cutemk.runtime.CuteGraph` plans each token count on the host and launches that
plan; a CUDA graph captured at one count replays that count only. :class:`LiveGraph` serves
a graph of ops whose tokens are independent (``TileOp.token_local``: GEMMs, split-K reduces,
RMSNorm, adds, and the MoE block's routing, permute, grouped GEMMs and combine) whose
tensors are allocated at the token dim's maximum, and reads the live count from a device
tensor at each launch:

- Ahead of time it plans a ladder of counts (:func:`live_counts`: powers of two up to 128,
  then multiples of 128, and the maximum; each plan's tile grid is the one its counts would
  get), and packs every plan's program and device state into two buffers, with a table
  (``codegen.layout.LIVE_HEADER``) mapping each count to the smallest plan that covers it.
- The kernel (``KernelSpec.live``) reads the count, picks the plan, binds the token dims of
  its tensors (and dims computed from it, such as an MoE block's T x top_k slots) to their
  values at the plan's count and runs it; a count of 0, or one outside the kernel's range
  (another regime's kernel serves it), runs nothing. Tokens between the live count and the
  plan's are computed from whatever the buffers hold (an MoE block routes them too) and land
  in rows nobody reads.
- A count below 0 or above the limit (the maximum, or the largest count any kernel of the
  caller serves) runs nothing and is recorded in the table;
  :meth:`LiveGraph.check` raises it (eager calls with the watchdog check every launch).

So one capture replays correctly at any count, and a count costs what its plan costs; an op
that treats rows past its input's extent as absent (``TileOp.live_rows_inputs``: the MoE
block's top-k) gets that input bound to the live count itself, so the plan's tokens past it
route nowhere and cost next to nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .binding import LeavesApart, bind, poison_
from .codegen.layout import DEVICE_STATE, LH, LIVE_HEADER_WORDS, LIVE_ROW, LR
from .errors import CuteMKError, GraphError, LayoutError
from .kernels import _compile, kernel_spec, live_dims
from .plan import instantiate
from .symbolic import Sym, free_syms

__all__ = ["LiveGraph", "live_counts", "pack_live"]

_ALIGN_WORDS = 32  # each plan's program and state start 128-byte aligned in the big buffers


def live_counts(first: int, last: int, step: int = 128) -> list[int]:
    """The token counts a live kernel serving ``[first, last]`` plans: powers of two below
    ``step``, multiples of ``step``, and ``last``. A count runs the smallest plan at or above
    it, which has the tile grid the count's own plan would have wherever the row tiles are
    powers of two up to ``step`` rows."""
    if not 1 <= first <= last:
        raise ValueError(f"need 1 <= first <= last, got first={first}, last={last}")
    out = {last}
    c = 1
    while c < step:
        out.add(c)
        c *= 2
    out.update(range(step, last, step))
    return sorted(c for c in out if first <= c <= last)


def pack_live(
    built: Sequence[tuple],
    counts: Sequence[int],
    first: int,
    max_tokens: int,
    limit: int | None = None,
    extents: Sequence[Sequence[int]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[int]]:
    """The live kernel's three int32 buffers from the planned counts' ``(lowered, program,
    device state, spans)`` (``CuteGraph._plan_arrays``): the table (``LIVE_HEADER``, the
    lookup from each count in ``[first, max_tokens]`` to the smallest plan that covers it,
    a ``LIVE_ROW`` per plan followed by its ``extents``: the value of each token-dependent
    dim at its count, default the count alone), every program and every device state back
    to back; and where each plan's program and state start. ``limit`` (default
    ``max_tokens``): counts above it are errors; counts in ``(max_tokens, limit]`` belong to
    another kernel."""
    if extents is None:
        extents = [(c,) for c in counts]
    if len(extents) != len(counts) or len({len(e) for e in extents}) != 1:
        raise ValueError("extents: one row of the same length per planned count")

    def place(sizes):
        offs, off = [], 0
        for n in sizes:
            offs.append(off)
            off += -(-n // _ALIGN_WORDS) * _ALIGN_WORDS
        return offs, max(off, _ALIGN_WORDS)

    prog_off, prog_len = place([b[1].size for b in built])
    dev_off, dev_len = place([b[2].size for b in built])
    prog = np.zeros(prog_len, dtype=np.int32)
    dev = np.zeros(dev_len, dtype=np.int32)
    lookup = np.full(max_tokens + 1, -1, dtype=np.int32)
    width = len(LIVE_ROW) + len(extents[0])
    rows = np.zeros((len(built), width), dtype=np.int32)
    lo = first
    for k, (c, (low, prog_np, dev_np, _)) in enumerate(zip(counts, built)):
        prog[prog_off[k] : prog_off[k] + prog_np.size] = prog_np
        dev[dev_off[k] : dev_off[k] + dev_np.size] = dev_np
        lookup[lo : c + 1] = k
        lo = c + 1
        rows[k, LR["prog_off"]], rows[k, LR["prog_len"]] = prog_off[k], prog_np.size
        rows[k, LR["dev_off"]], rows[k, LR["dev_len"]] = dev_off[k], dev_np.size
        rows[k, LR["num_tasks"]] = low.num_tasks
        rows[k, LR["num_init"]] = low.num_init
        rows[k, LR["max_epoch"]] = low.max_launches()
        rows[k, LR["tokens"]] = c
        rows[k, len(LIVE_ROW) :] = extents[k]
    head = np.zeros(LIVE_HEADER_WORDS, dtype=np.int32)
    head[LH["max"]] = max_tokens
    head[LH["limit"]] = max_tokens if limit is None else limit
    head[LH["first"]] = max(first, 1)  # a count of 0 runs nothing in any kernel
    head[LH["lookup"]] = LIVE_HEADER_WORDS
    head[LH["rows"]] = LIVE_HEADER_WORDS + lookup.size
    head[LH["num_plans"]] = len(built)
    head[LH["count_rows"]] = LIVE_HEADER_WORDS + lookup.size + rows.size
    # per count served, its plan's row: the kernel reads it straight from the count
    served = lookup[head[LH["first"]] : max_tokens + 1]
    if (served < 0).any():
        raise ValueError(f"counts {list(counts)} leave counts in [{first}, {max_tokens}] unplanned")
    by_count = rows[served]
    table = np.concatenate([head, lookup, rows.ravel(), by_count.ravel()])
    return table, prog, dev, prog_off, dev_off


def token_sym(graph: Any, fixed: Collection[str] = ()) -> Sym:
    """The one symbolic dim of ``graph`` besides the ``fixed`` ones, its token count
    (GraphError if it has another)."""
    syms = [
        s for s in free_syms(*(d for v in graph.values for d in v.shape)) if s.name not in fixed
    ]
    if len(syms) != 1:
        raise GraphError(
            f"{graph.name}: a live token count needs exactly one symbolic dim besides the fixed "
            f"ones {sorted(fixed)}, the graph has {sorted(s.name for s in syms)}"
        )
    (sym,) = syms
    assert isinstance(sym, Sym)
    return sym


def live_spec(cg: Any, fixed: Collection[str] = ()):
    """The kernel spec of ``cg``'s graph taking its token count as device data, its ``fixed``
    dims bound by the tensors (raises GraphError where the graph cannot: see
    :func:`cutemk.kernels.live_dims`)."""
    name = token_sym(cg.graph, fixed).name
    return kernel_spec(cg.graph, cg.dynamic, cg.spec.watchdog, False, live=name)


@dataclass
class _LivePlan:
    """One planned count: where its program and state lie in the big buffers, and views of
    its state for the watchdog's check."""

    tokens: int
    buffers: Any  # runtime._Buffers with views into the big buffers


class LiveGraph:
    """A compiled graph that takes its token count as device data (build it with
    :meth:`CuteGraph.live <cutemk.runtime.CuteGraph.live>`).

    Call it with the leaves allocated at the token dim's maximum and ``num_tokens``, an int32
    CUDA tensor of one element holding the live count: it launches without any host work that
    depends on the count, so a CUDA graph captured once replays at every count. Outputs are
    allocated at the maximum (or passed as ``out``); rows at and past the live count are not
    defined. ``fixed``: the graph's other symbolic dims, bound once for every plan (e.g. a KV
    cache's pages); the leaves must have them."""

    def __init__(
        self,
        cg: Any,
        first: int | None = None,
        counts: Sequence[int] | None = None,
        limit: int | None = None,
        fixed: Mapping[str, int] | None = None,
    ):
        g = cg.graph
        self.fixed = {k: int(v) for k, v in (fixed or {}).items()}
        sym = token_sym(g, self.fixed)
        if cg.spec.profile:
            raise CuteMKError("profile=True records one plan's tasks; compile without it")
        # the graph keeps its live graphs (CuteGraph.live): a weak reference back, so a
        # dropped graph's device state goes with it, not at the next garbage collection
        self.cg = weakref.proxy(cg)
        self.tokens = sym.name
        self.max_tokens = int(sym.max)
        self.first = int(sym.min if first is None else first)
        if not sym.min <= self.first <= self.max_tokens:
            raise ValueError(
                f"first={self.first} is outside {self.tokens}'s range "
                f"[{sym.min}, {self.max_tokens}]"
            )
        self.spec = live_spec(cg, self.fixed)
        if counts is None:
            counts = live_counts(self.first, self.max_tokens)
        counts = sorted({int(c) for c in counts})
        if not counts or counts[-1] != self.max_tokens or counts[0] < self.first:
            raise ValueError(
                f"counts must lie in [{self.first}, {self.max_tokens}] and end at "
                f"{self.max_tokens}, got {counts}"
            )
        self.counts = counts
        self.limit = self.max_tokens if limit is None else int(limit)
        if self.limit < self.max_tokens:
            raise ValueError(f"limit={limit} is below the graph's maximum {self.max_tokens}")
        from .runtime import _off_graph

        # device state and scratch are built on a thread and stream of their own: never in a
        # CUDA graph being captured, nor from its memory pool (as ``CuteGraph`` builds plans)
        self.plans = _off_graph(self._build)
        streams = {torch.cuda.current_stream()}
        if cg._stream_obj is not None:  # the stream the graph's launches run on
            streams.add(cg._stream_obj)
        for stream in streams:
            for t in (
                self.table,
                self.prog,
                self.dev,
                self.prof,
                self.peers,
                *cg._scratch_bufs.values(),
            ):
                t.record_stream(stream)  # freed only after the launches that read them
        self._fn = _compile(self.spec)  # compiled (or loaded) now, not in a capture
        self._outputs = [(k, v) for k, v in enumerate(g.values) if v in g.outputs]
        leaf_index = {v.name: j for j, v in enumerate(g.leaves)}
        # values updated in place: their tensor is the leaf they alias
        self._alias_pos = [
            (k, leaf_index[v.alias_of.name])
            for k, v in enumerate(g.values)
            if v.alias_of is not None
        ]
        self._checks: tuple | None = None
        self._apart: LeavesApart | None = None  # set with _checks

    # -- building ------------------------------------------------------------------------------
    def _build(self) -> list[_LivePlan]:
        from .runtime import _Buffers

        cg, g = self.cg, self.cg.graph
        planned = [instantiate(g, self._env(c)) for c in self.counts]
        built = [cg._plan_arrays(p) for p in planned]
        table, prog, dev, _, dev_off = pack_live(
            built, self.counts, self.first, self.max_tokens, self.limit, self._extents()
        )
        self.table = torch.from_numpy(table).cuda()
        self.prog = torch.from_numpy(prog).cuda()
        self.dev = torch.from_numpy(dev).cuda()
        self.prof = torch.zeros(4, dtype=torch.int64, device="cuda")
        self.peers = torch.tensor([self.dev.data_ptr()], dtype=torch.int64, device="cuda")
        plans = []
        for k, (c, (low, _, dev_np, spans)) in enumerate(zip(self.counts, built)):
            devbuf = self.dev[dev_off[k] : dev_off[k] + dev_np.size]
            views = {name: devbuf[o : o + n] for name, (o, n) in zip(DEVICE_STATE, spans)}
            views["debug"].fill_(-1)
            torch_dev = {**views, "devbuf": devbuf}
            b = _Buffers(planned[k], low, (), torch_dev, {}, low.max_launches())
            plans.append(_LivePlan(c, b))
        self._template_cache = self._template()
        return plans

    def _env(self, count: int) -> dict[str, int]:
        return {**self.fixed, self.tokens: count}

    def _extents(self) -> list[list[int]]:
        """Per planned count, the value of each token-dependent dim (``kernels.live_dims``);
        none may exceed its value at the maximum, where the buffers are allocated."""
        _, exprs = live_dims(self.cg.graph, self.tokens, self.fixed)
        at_max = [e.eval(self._env(self.max_tokens)) for e in exprs]
        out = []
        for c in self.counts:
            row = [e.eval(self._env(c)) for e in exprs]
            for e, v, top in zip(exprs, row, at_max):
                if v > top:
                    raise GraphError(
                        f"{self.cg.graph.name}: the dim {e} is {v} at {self.tokens}={c}, more "
                        f"than its {top} at the maximum, where a live graph allocates"
                    )
            out.append(row)
        return out

    def _template(self) -> list:
        """The kernel's tensor list with the leaves' and outputs' slots empty: intermediates
        are views of the graph's scratch at the maximum, then the table (the count is
        appended per call)."""
        cg, g = self.cg, self.cg.graph
        env = self._env(self.max_tokens)
        t: list = []
        for v in g.values:
            if v.kind == "intermediate" and v not in g.outputs and v.alias_of is None:
                shape = v.spec.concrete(env)
                t.append(cg._scratch(v)[: int(np.prod(shape))].view(shape))
            else:
                t.append(None)
        return t + [self.table]

    # -- calling -------------------------------------------------------------------------------
    def __call__(
        self,
        *leaves: torch.Tensor,
        num_tokens: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ):
        if not (
            isinstance(num_tokens, torch.Tensor)
            and num_tokens.dtype == torch.int32
            and num_tokens.numel() == 1
            and num_tokens.is_cuda
        ):
            raise TypeError(
                "num_tokens must be an int32 CUDA tensor of one element (the live token count)"
            )
        if not self._matches(leaves):
            leaves = self._bind(leaves)  # the full checks; the canonical views launch
        if num_tokens.device != leaves[0].device:
            raise LayoutError(
                f"num_tokens is on {num_tokens.device}, the leaves on {leaves[0].device}"
            )
        if num_tokens.data_ptr() % 16:
            raise LayoutError("num_tokens must be 16-byte aligned (a tensor of its own)")
        tensors = list(self._template_cache)
        for k, t in zip(self._leaf_pos, leaves):
            tensors[k] = t
        for k, j in self._alias_pos:  # updated in place: the leaf itself
            tensors[k] = leaves[j]
        env = self._env(self.max_tokens)
        outs = []
        for j, (k, v) in enumerate(self._outputs):
            if v.alias_of is not None:  # an input updated in place is its own output
                outs.append(tensors[k])
                continue
            shape = v.spec.concrete(env)
            if out is not None:
                o = out[j]
                if (
                    tuple(o.shape) != tuple(shape)
                    or o.dtype != v.dtype
                    or not o.is_contiguous()
                    or o.device != leaves[0].device
                    or o.data_ptr() % 16
                    or o.requires_grad
                ):
                    raise LayoutError(
                        f"out[{j}] ({v.name}) must be a contiguous, 16-byte aligned {v.dtype} "
                        f"tensor of shape {tuple(shape)} on {leaves[0].device} without grad, "
                        f"got {o.dtype} {tuple(o.shape)} on {o.device}"
                    )
            else:
                o = torch.empty(shape, dtype=v.dtype, device=leaves[0].device)
                if self.cg.poison_outputs:
                    poison_(o)
            tensors[k] = o
            outs.append(o)
        tensors.append(num_tokens)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and self.spec.watchdog:
            raise CuteMKError(
                "watchdog=True reads the kernel's state back after every launch, so it "
                "cannot be captured in a CUDA graph; compile without it"
            )
        # the graph's scratch is shared with every launch of the graph: one stream at a time
        index = leaves[0].get_device()
        stream = torch._C._cuda_getCurrentRawStream(index)
        if stream != self.cg._stream:
            self.cg._follow_stream(stream, capturing, index)
        self._fn(
            tensors,
            self.prog,
            self.dev,
            self.prof,
            self.peers,
            0,
            0,
            1,
            self.cg.timeout_ns,
            self.cg.num_sms,
        )
        if self.spec.watchdog:
            for p in self.plans:
                self.cg._check(p.buffers)
            self.check()
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _matches(self, leaves: tuple) -> bool:
        """``leaves`` can launch as the last bound call's did: same shapes, dtypes, strides
        (the canonical views' own) and devices, aligned, no autograd, and no in-place leaf
        sharing memory with another (``binding.LeavesApart``)."""
        checks = self._checks
        if checks is None or len(leaves) != len(checks):
            return False
        ptrs = []
        for t, (shape, dtype, stride, device) in zip(leaves, checks):
            if not isinstance(t, torch.Tensor):
                return False
            p = t.data_ptr()
            if (
                t.shape != shape
                or t.dtype != dtype
                or t.stride() != stride
                or t.device != device
                or t.requires_grad
                or p % 16
            ):
                return False
            ptrs.append(p)
        return self._apart(tuple(ptrs))

    def _bind(self, leaves: tuple) -> tuple:
        """The full checks of ``leaves`` (``cutemk.binding.bind``) and their canonical views,
        which launch; a later call whose tensors look the same skips this."""
        g = self.cg.graph
        env, bound = bind(g, leaves, {}, device_type="cuda")
        if env.get(self.tokens) != self.max_tokens:
            raise LayoutError(
                f"{g.name}: a live launch takes its tensors at {self.tokens} = "
                f"{self.max_tokens} (the maximum), got {self.tokens} = {env.get(self.tokens)}"
            )
        for name, value in self.fixed.items():
            if env.get(name) != value:
                raise LayoutError(
                    f"{g.name}: this live graph was planned for {name} = {value}, the tensors "
                    f"have {name} = {env.get(name)}"
                )
        for name, t in bound.items():
            if t.data_ptr() % 16:
                raise LayoutError(f"{name} must be 16-byte aligned")
        canonical = tuple(bound[v.name] for v in g.leaves)
        pos = {v.name: k for k, v in enumerate(g.values)}
        self._leaf_pos = [pos[v.name] for v in g.leaves]
        self._checks = tuple((t.shape, t.dtype, t.stride(), t.device) for t in canonical)
        self._apart = LeavesApart(g, canonical)
        return canonical

    def take_errors(self) -> tuple[int, int]:
        """(launches with a count outside [0, limit] since the last call, the last such count)
        and zero the tally; reading it waits for the launches."""
        bad, last = (int(x) for x in self.table[LH["bad"] : LH["last_bad"] + 1].tolist())
        if bad:
            self.table[LH["bad"]] = 0
        return bad, last

    def check(self) -> None:
        """Raise CuteMKError if a launch since the last check had a live count below 0 or
        above the limit (such a launch ran nothing); reading it waits for the launches."""
        bad, last = self.take_errors()
        if bad:
            raise CuteMKError(
                f"{self.cg.graph.name}: {bad} launch(es) got a live token count outside "
                f"[0, {self.limit}] (the last: {last}) and ran nothing"
            )
