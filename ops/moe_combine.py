"""MoE combine tile op: y[t] = sum_j weights[t, j] * rows[slot_row[t, j]].

One block of tokens (and of hidden columns) a task. Which rows a token reads is data (the
routing), so the declared read of ``rows`` is the whole tensor: a combine tile waits for every
grouped-GEMM tile. With data the read boxes are exact (the interpreter's race check uses them).

In the slot layout of ``ops.moe_slot_gemm`` (``slot_block_m`` > 0) there is no ``slot_row``:
the input in its place is the top-k's ``ids`` and slot j of token t is row ``(t * k + j) *
slot_block_m + t``, or no row where the id names no expert (outside ``[0, num_experts)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Float32, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import SIMT_WIDE_THREADS
from cutemk.errors import GraphError, ShapeError
from cutemk.symbolic import cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    blocks,
    boxes,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    full_box,
    register_op,
    span,
)


UNROLL = 4
"""Outputs (or words) a thread gathers at once (k loads each): the gather is latency bound."""

GATHER_BYTES = 256
"""Most bytes of gathered words a thread holds at once (64 registers; the megakernel's threads
have 168, and 512 spilled in the MoE kernels): 8 picks of 8 columns two words a batch, of 4
columns four."""


@register_op
@dataclass(frozen=True)
class MoeCombineTile(TileOp):
    rows: TensorSpec  # (tiles*block_m, hidden), grouped layout
    weights: TensorSpec  # (tokens, k) fp32
    slot_row: TensorSpec  # (tokens, k) int32
    block_m: int = 16
    block_n: int = 256
    slot_block_m: int = 0  # > 0: slot_row is the top-k's ids, rows in the slot layout
    num_experts: int = 0  # the slot layout's experts (ids outside [0, num_experts): no row)
    r: TensorSpec | None = None  # (tokens, hidden): a residual added before the one rounding

    name: ClassVar[str] = "moe_combine"
    token_local: ClassVar[bool] = True
    # a latency-bound gather: both consumer warpgroups, twice the loads in flight an SM
    simt_threads: ClassVar[int] = SIMT_WIDE_THREADS
    outputs: ClassVar[tuple[str, ...]] = ("y",)
    data_inputs: ClassVar[tuple[str, ...]] = ("slot_row",)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("rows", "weights", "slot_row") + ("r",) * (self.r is not None)

    def __post_init__(self) -> None:
        expect_ndim(self.rows, 2, "moe_combine rows")
        expect_ndim(self.weights, 2, "moe_combine weights")
        expect_ndim(self.slot_row, 2, "moe_combine slot_row")
        expect_dtype(self.rows, FLOAT_DTYPES, "moe_combine rows")
        expect_dtype(self.weights, (torch.float32,), "moe_combine weights")
        expect_dtype(self.slot_row, (torch.int32,), "moe_combine slot_row")
        expect_same_dim(self.weights.shape[0], self.slot_row.shape[0], "moe_combine: tokens")
        expect_same_dim(self.weights.shape[1], self.slot_row.shape[1], "moe_combine: top-k")
        if self.r is not None:
            expect_ndim(self.r, 2, "moe_combine r")
            if self.r.dtype != self.rows.dtype:
                raise TypeError(f"moe_combine r must be {self.rows.dtype}, got {self.r.dtype}")
            expect_same_dim(self.r.shape[0], self.weights.shape[0], "moe_combine: r rows")
            expect_same_dim(self.r.shape[1], self.rows.shape[1], "moe_combine: r columns")
        for f in ("block_m", "block_n"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"moe_combine {f} must be a positive int")
        if self.slot_block_m:
            if not isinstance(self.slot_block_m, int) or self.slot_block_m < 1:
                raise ValueError("moe_combine slot_block_m must be a positive int (or 0)")
            if not isinstance(self.num_experts, int) or self.num_experts < 1:
                raise ValueError("moe_combine in the slot layout needs num_experts >= 1")
            k = self.slot_row.shape[1]
            if not isinstance(k, int):
                raise ShapeError("moe_combine: the slot layout needs a static top-k")
            expect_same_dim(  # every slot's row must be inside rows
                self.rows.shape[0],
                self.slot_row.shape[0] * k * self.slot_block_m,
                "moe_combine: slot-layout rows vs tokens*top_k*slot_block_m",
            )

    def check_producers(self, producers) -> None:
        gemm = producers.get("rows")
        if self.slot_block_m and getattr(gemm, "slot_input", None) is not None:
            if (gemm.block_m, gemm.w.shape[0]) != (self.slot_block_m, self.num_experts):
                raise GraphError(
                    f"moe_combine reads the slot layout as block_m={self.slot_block_m} over "
                    f"{self.num_experts} experts, its grouped GEMM has block_m={gemm.block_m} "
                    f"over {gemm.w.shape[0]}"
                )

    def _rows_of(self, slot_row: torch.Tensor, t0: int) -> torch.Tensor:
        """Rows gathered by tokens ``t0, t0 + 1, ...`` (-1: none): ``slot_row`` itself, or in
        the slot layout the rows of those tokens' ids."""
        if not self.slot_block_m:
            return slot_row
        bt, k = slot_row.shape
        t = torch.arange(t0, t0 + bt, dtype=torch.int64).unsqueeze(1)
        j = torch.arange(k, dtype=torch.int64).unsqueeze(0)
        rows = (t * k + j) * self.slot_block_m + t
        ok = (slot_row >= 0) & (slot_row < self.num_experts)
        return torch.where(ok, rows, -1)

    def output_specs(self):
        return {"y": TensorSpec((self.weights.shape[0], self.rows.shape[1]), self.rows.dtype)}

    def grid(self):
        return (cdiv(self.weights.shape[0], self.block_m), cdiv(self.rows.shape[1], self.block_n))

    def _boxes(self, coord, env):
        t, k = self.weights.concrete(env)
        h = self.rows.concrete(env)[1]
        return block(coord[0], self.block_m, t), block(coord[1], self.block_n, h), k

    def reads(self, coord, env, data=None):
        tr, hc, k = self._boxes(coord, env)
        r = {
            "weights": (tr, (0, k)),
            "slot_row": (tr, (0, k)),
            "rows": full_box(self.rows.concrete(env)),
        }
        if self.r is not None:
            r["r"] = (tr, hc)
        if data is not None and k:
            # the span of rows it gathers: all inside existing tiles, which are written whole
            rows = self._rows_of(data["slot_row"][tr[0] : tr[1]], tr[0]).reshape(-1)
            rows = rows[rows >= 0]  # -1: no row (no usable logit, or an id out of range)
            if self.slot_block_m:  # one row of each slot's tile: the rows themselves
                r["rows"] = [((int(v), int(v) + 1), hc) for v in rows.tolist()] or [((0, 0), hc)]
                return r
            gathered = (int(rows.min()), int(rows.max()) + 1) if rows.numel() else (0, 0)
            r["rows"] = (gathered, hc)  # no rows at all (every slot bad): it reads none
        return r

    def writes(self, coord, env, data=None):
        tr, hc, _ = self._boxes(coord, env)
        return {"y": (tr, hc)}

    uniform_cost: ClassVar[bool] = True

    def region_arrays(self, which, env, coords):
        t, k = self.weights.concrete(env)
        h = self.rows.concrete(env)[1]
        tr = blocks(coords[:, 0], self.block_m, t)
        if which == "writes":
            return {"y": boxes(tr, blocks(coords[:, 1], self.block_n, h))}
        n_t = len(coords)
        r = {
            "weights": boxes(tr, span(0, k, n_t)),
            "slot_row": boxes(tr, span(0, k, n_t)),
            "rows": boxes(*(span(0, d, n_t) for d in self.rows.concrete(env))),
        }
        if self.r is not None:
            r["r"] = boxes(tr, blocks(coords[:, 1], self.block_n, h))
        return r

    def cost(self, coord, env):
        _, k = self.weights.concrete(env)
        es = self.rows.dtype.itemsize
        return tile_time_us(
            2.0 * self.block_m * self.block_n * k,
            self.block_m * self.block_n * (k + 1 + (self.r is not None)) * es,
            torch.float32,
        )

    def reference(self, coord, env, t):
        (t0, t1), (c0, c1), _ = self._boxes(coord, env)
        idx = self._rows_of(t["slot_row"][t0:t1], t0).long()  # (bt, k); -1: no row: NaN out
        gathered = t["rows"][idx.clamp(min=0), c0:c1].float()  # (bt, k, bn)
        terms = gathered * t["weights"][t0:t1].unsqueeze(-1)
        y = torch.where((idx >= 0).unsqueeze(-1), terms, float("nan")).sum(dim=1)
        if self.r is not None:
            y = y + t["r"][t0:t1, c0:c1].float()
        t["y"][t0:t1, c0:c1] = y.to(t["y"].dtype)

    # -- device -----------------------------------------------------------------------------
    @cute.jit
    def _slot_row(self, mSlotRow, tok: Int32, j: int) -> Int32:
        """Row of ``rows`` holding token ``tok``'s ``j``-th pick, or -1 (none: top-k found no
        usable logit, or the id is out of range). Each thread loads what it gathers itself
        (an L1 hit after the tile's first batch): no shared-memory staging, so no hand-over
        between the body's warpgroups (one ``compute-sanitizer --tool racecheck`` reported)."""
        r = mSlotRow[tok, j]
        if cutlass.const_expr(self.slot_block_m):  # an id: its slot's row, or none
            e = r
            r = (tok * self.weights.shape[1] + j) * self.slot_block_m + tok
            if e < 0 or e >= self.num_experts:
                r = Int32(-1)
        return r

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """y[tokens block coord0, cols block coord1]; ``tensors`` = (mRows, mWeights, mSlotRow,
        mY).

        mRows: (tiles*block_m, H), mWeights: (T, k) fp32, mSlotRow: (T, k) int32, mY: (T, H).
        The tile's outputs are one flat range, consecutive threads on consecutive columns (each
        gathered row is read coalesced); a thread takes ``UNROLL`` outputs at a time with all
        their loads unconditional (clamped indices), so k * UNROLL of them are in flight. A slot
        with no row (-1: top-k found no usable logit, or the id was out of range) makes the
        token's output NaN: bad routing data shows in that token, never silently.
        """
        mRows, mWeights, mSlotRow, mY = tensors[0], tensors[1], tensors[2], tensors[-1]
        mR = tensors[3] if cutlass.const_expr(self.r is not None) else mY
        k = self.weights.shape[1]
        tokens = mY.shape[0]
        hidden = mY.shape[1]
        t0 = coord0 * self.block_m
        t_end = cute.min(t0 + self.block_m, tokens)
        c0 = coord1 * self.block_n
        width = cute.min(c0 + self.block_n, hidden) - c0
        if cutlass.const_expr(self._words()):
            self._combine_words(mRows, mWeights, mSlotRow, mR, mY, t0, t_end, c0, width, tidx)
        else:
            total = (t_end - t0) * width
            for base in range(0, total, self.simt_threads * UNROLL):
                got = []  # every load of the batch before any sum (see _combine_words)
                res = []
                for u in cutlass.range_constexpr(UNROLL):
                    idx = cute.min(base + u * self.simt_threads + tidx, total - 1)
                    tok = t0 + idx // width
                    c = c0 + idx % width
                    for j in cutlass.range_constexpr(k):
                        r = self._slot_row(mSlotRow, tok, j)
                        wt = mWeights[tok, j].to(Float32)
                        got.append((r, wt, mRows[cute.max(r, 0), c]))
                    if cutlass.const_expr(self.r is not None):
                        res.append(mR[tok, c])
                accs = []
                for u in cutlass.range_constexpr(UNROLL):
                    acc = Float32(0.0)
                    for j in cutlass.range_constexpr(k):
                        r, wt, x = got[u * k + j]
                        v = x.to(Float32) * wt
                        if r >= 0:
                            acc = acc + v
                        else:
                            acc = Float32(float("nan"))
                    if cutlass.const_expr(self.r is not None):
                        acc = acc + res[u].to(Float32)
                    accs.append(acc)
                for u in cutlass.range_constexpr(UNROLL):
                    idx = base + u * self.simt_threads + tidx
                    if idx < total:
                        mY[t0 + idx // width, c0 + idx % width] = accs[u].to(mY.element_type)

    def _words(self) -> int:
        """Columns a word of 16-bit rows: 8 (16-byte words) where H and block_n are multiples
        of 8, else 4 (8-byte words) where they are multiples of 4, else 0 (one element a
        load). Rows then start on a word (the tensors are 16-byte aligned)."""
        h = self.rows.shape[1]
        if self.rows.dtype.itemsize != 2 or not isinstance(h, int):
            return 0
        for cols in (8, 4):
            if h % cols == 0 and self.block_n % cols == 0:
                return cols
        return 0

    def _word_unroll(self) -> int:
        """Words a thread gathers a batch: ``UNROLL``, fewer where its ``k`` gathers of
        ``_words()`` columns each would pass ``GATHER_BYTES``."""
        word_bytes = 2 * self._words()
        if not word_bytes:  # the element path: UNROLL outputs a batch
            return UNROLL
        return max(1, min(UNROLL, GATHER_BYTES // (self.weights.shape[1] * word_bytes)))

    @cute.jit
    def _combine_words(self, mRows, mWeights, mSlotRow, mR, mY, t0, t_end, c0, width, tidx):
        """The tile as words of ``_words()`` columns: ``_word_unroll()`` words a thread at a time, k
        word loads each (and the residual's word, ``mR``, with ``r``), all issued before their
        sums (each after its slot row, ``_slot_row``)."""
        k = self.weights.shape[1]
        hidden = self.rows.shape[1]
        cols = self._words()
        unroll = self._word_unroll()
        row_words = hidden // cols

        def as_words(m):
            return cute.make_tensor(
                m.iterator,
                cute.make_layout((m.shape[0], row_words, cols), stride=(hidden, cols, 1)),
            )

        rows_w, y_w, r_w = as_words(mRows), as_words(mY), as_words(mR)
        w0 = c0 // cols
        words = width // cols
        total = (t_end - t0) * words
        for base in range(0, total, self.simt_threads * unroll):
            # every load of the batch first (the slot rows and weights, then the words),
            # the sums after: no branch between two loads, so all are in flight
            got = []
            res = []
            for u in cutlass.range_constexpr(unroll):
                idx = cute.min(base + u * self.simt_threads + tidx, total - 1)
                tok = t0 + idx // words
                cw = w0 + idx % words
                for j in cutlass.range_constexpr(k):
                    r = self._slot_row(mSlotRow, tok, j)
                    wt = mWeights[tok, j].to(Float32)
                    vals = cute.make_rmem_tensor((cols,), mRows.element_type)
                    cute.autovec_copy(rows_w[cute.max(r, 0), cw, None], vals)
                    got.append((r, wt, vals))
                if cutlass.const_expr(self.r is not None):
                    rv = cute.make_rmem_tensor((cols,), mR.element_type)
                    cute.autovec_copy(r_w[tok, cw, None], rv)
                    res.append(rv)
            accs = []
            for u in cutlass.range_constexpr(unroll):
                acc = cute.make_rmem_tensor((cols,), Float32)
                acc.fill(0.0)
                for j in cutlass.range_constexpr(k):
                    r, wt, vals = got[u * k + j]
                    if r >= 0:
                        for q in cutlass.range_constexpr(cols):
                            acc[q] = acc[q] + vals[q].to(Float32) * wt
                    else:
                        acc.fill(float("nan"))
                if cutlass.const_expr(self.r is not None):
                    for q in cutlass.range_constexpr(cols):
                        acc[q] = acc[q] + res[u][q].to(Float32)
                accs.append(acc)
            for u in cutlass.range_constexpr(unroll):
                idx = base + u * self.simt_threads + tidx
                if idx < total:
                    out = cute.make_rmem_tensor((cols,), mY.element_type)
                    for q in cutlass.range_constexpr(cols):
                        out[q] = accs[u][q].to(mY.element_type)
                    cute.autovec_copy(out, y_w[t0 + idx // words, w0 + idx % words, None])


def moe_combine(
    rows: TensorSpec,
    weights: TensorSpec,
    slot_row: TensorSpec,
    r: TensorSpec | None = None,
    *,
    block_m: int = 16,
    block_n: int = 256,
    slot_block_m: int = 0,
    num_experts: int = 0,
) -> MoeCombineTile:
    """``slot_block_m`` > 0: ``slot_row`` is the top-k's ids and ``rows`` the slot layout of
    ``ops.moe_slot_gemm`` (see the module doc). ``r`` (tokens, hidden): y = the combine + r,
    added in fp32 before the one rounding (a decoder layer's residual add)."""
    return MoeCombineTile(rows, weights, slot_row, block_m, block_n, slot_block_m, num_experts, r)
