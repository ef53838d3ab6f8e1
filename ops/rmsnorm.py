"""RMSNorm tile op: y = x / sqrt(mean(x^2) + eps) * weight, one block of rows a task.

``weight`` None: y = x / sqrt(mean(x^2) + eps), for a norm whose weight is folded into the
projection that reads y (see ``cutemk.layers.fold_norm``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
from cutlass import Float32, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_WARPS, WARP_SIZE
from cutemk.device.vectors import row_vectors
from cutemk.errors import ShapeError
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
    register_op,
    span,
)


W_BATCH = 8
"""Weight vectors a lane loads at once while writing a row held in registers."""


@register_op
@dataclass(frozen=True)
class RmsNormTile(TileOp):
    x: TensorSpec  # (rows, hidden)
    weight: TensorSpec | None  # (hidden,), or None for a weight of ones
    eps: float = 1e-6
    block_m: int = 16

    name: ClassVar[str] = "rmsnorm"
    outputs: ClassVar[tuple[str, ...]] = ("y",)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("x",) if self.weight is None else ("x", "weight")

    def __post_init__(self) -> None:
        expect_ndim(self.x, 2, "rmsnorm x")
        expect_dtype(self.x, FLOAT_DTYPES, "rmsnorm x")
        if self.weight is not None:
            self._check_weight()
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"rmsnorm block_m must be a positive int, got {self.block_m!r}")
        if not self.eps > 0:
            raise ValueError(f"rmsnorm eps must be > 0, got {self.eps}")

    def _check_weight(self) -> None:
        expect_ndim(self.weight, 1, "rmsnorm weight")
        expect_dtype(self.weight, (self.x.dtype,), "rmsnorm weight")
        if self.weight.shape[0] != self.x.shape[1]:
            raise ShapeError(
                f"rmsnorm weight has {self.weight.shape[0]} elements, x has "
                f"{self.x.shape[1]} columns"
            )

    def output_specs(self):
        return {"y": TensorSpec(self.x.shape, self.x.dtype)}

    def grid(self):
        return (cdiv(self.x.shape[0], self.block_m),)

    def _dims(self, env):
        return tuple(d if isinstance(d, int) else d.eval(env) for d in self.x.shape)

    def reads(self, coord, env, data=None):
        rows, cols = self._dims(env)
        r = {"x": (block(coord[0], self.block_m, rows), (0, cols))}
        if self.weight is not None:
            r["weight"] = ((0, cols),)
        return r

    def writes(self, coord, env, data=None):
        rows, cols = self._dims(env)
        return {"y": (block(coord[0], self.block_m, rows), (0, cols))}

    uniform_cost: ClassVar[bool] = True
    token_local: ClassVar[bool] = True

    def region_arrays(self, which, env, coords):
        rows, cols = self._dims(env)
        n_t = len(coords)
        b = boxes(blocks(coords[:, 0], self.block_m, rows), span(0, cols, n_t))
        if which == "writes":
            return {"y": b}
        if self.weight is None:
            return {"x": b}
        return {"x": b, "weight": boxes(span(0, cols, n_t))}

    def cost(self, coord, env):
        _, cols = self._dims(env)
        es = self.x.dtype.itemsize
        return tile_time_us(3.0 * self.block_m * cols, 2.0 * self.block_m * cols * es, self.x.dtype)

    def reference(self, coord, env, t):
        (r0, r1), _ = self.writes(coord, env)["y"]
        x = t["x"][r0:r1].float()
        y = x * (x.pow(2).mean(dim=-1, keepdim=True) + self.eps).rsqrt()
        if self.weight is not None:
            y = y * t["weight"].float()
        t["y"][r0:r1] = y.to(t["y"].dtype)

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0  # one warp per row: the reduction stays in registers (warp shuffles)

    @property
    def _vec(self) -> int:
        """Elements of one 16-byte access."""
        return 16 // self.x.dtype.itemsize

    @property
    def _vectors(self) -> bool:
        """Rows move in 16-byte vectors: a static width of whole vectors."""
        cols = self.x.shape[1]
        return isinstance(cols, int) and cols % self._vec == 0

    @property
    def _row_vectors(self) -> int:
        """16-byte vectors a lane holds when a whole row fits in its warp's registers (a
        static width, a multiple of 32 vectors, at most 128 values of x a lane: 64 registers of
        16-bit values; the weight streams in as the outputs go out), else 0."""
        cols = self.x.shape[1]
        per_warp = WARP_SIZE * self._vec
        if not isinstance(cols, int) or cols % per_warp or cols // WARP_SIZE > 128:
            return 0
        return cols // per_warp

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Rows ``[coord0 * block_m, +block_m)`` of y; ``tensors`` = (mX, mW, mY).

        mX: (rows, hidden), mW: (hidden,), mY: (rows, hidden). Warp w normalises rows w,
        w + NUM_WARPS, ...; a butterfly shuffle sums the squares (no shared memory, no CTA
        barrier). Rows of a static width move in 16-byte vectors. Where the row fits (see
        ``_row_vectors``) every lane issues all its loads of x at once and keeps them in
        registers: one round trip to memory a row, and one per batch of the weight
        (``W_BATCH``), or none where the weight is one batch: then it is loaded once, before
        the rows. Otherwise the row streams twice
        (the second pass mostly hits L1/L2), four vectors a lane in flight; a width known only
        at run time goes element by element.
        """
        mX, mY = tensors[0], tensors[len(tensors) - 1]
        mW = tensors[1]  # without a weight this is y: never read then
        has_w = self.weight is not None
        rows = mX.shape[0]
        cols = mX.shape[1]
        if cutlass.const_expr(self._vectors):  # static: every vector access is aligned
            cols = self.x.shape[1]
        vec = self._vec
        nvec = cols // vec
        x3 = row_vectors(mX, rows, cols, vec)
        y3 = row_vectors(mY, rows, cols, vec)
        w2 = cute.make_tensor(mW.iterator, cute.make_layout((nvec, vec), stride=(vec, 1)))
        warp = tidx // WARP_SIZE
        lane = tidx % WARP_SIZE
        row0 = coord0 * self.block_m
        inv_cols = Float32(1.0) / Float32(cols)
        n = self._row_vectors
        # a weight that fits in one batch is loaded once, before the rows, so its round trip
        # overlaps the first row's (one round trip a row where there were two)
        w_first = has_w and 0 < n <= W_BATCH
        ws0 = []
        if cutlass.const_expr(w_first):
            for i in cutlass.range_constexpr(n):
                w_vec = cute.make_rmem_tensor((vec,), mW.element_type)
                cute.autovec_copy(w2[lane + i * WARP_SIZE, None], w_vec)
                ws0.append(w_vec)
        for r in range(warp, self.block_m, NUM_WARPS):
            row = row0 + r
            if row < rows:
                if cutlass.const_expr(n > 0):
                    xs = []
                    for i in cutlass.range_constexpr(n):
                        xv = cute.make_rmem_tensor((vec,), mX.element_type)
                        cute.autovec_copy(x3[row, lane + i * WARP_SIZE, None], xv)
                        xs.append(xv)
                    ss = Float32(0.0)
                    for i in cutlass.range_constexpr(n):
                        for e in cutlass.range_constexpr(vec):
                            v = xs[i][e].to(Float32)
                            ss = ss + v * v
                    ss = cute.arch.warp_reduction_sum(ss)
                    rstd = cute.math.rsqrt(ss * inv_cols + Float32(self.eps))
                    # the weight in batches loaded before their stores (a load after a store
                    # may not pass it: one round trip a batch, not a vector)
                    for i0 in cutlass.range_constexpr(0, n, W_BATCH):
                        ws = ws0[i0:]
                        if cutlass.const_expr(not w_first):
                            for i in cutlass.range_constexpr(i0, min(n, i0 + W_BATCH)):
                                wv = cute.make_rmem_tensor((vec,), mW.element_type)
                                if cutlass.const_expr(has_w):
                                    cute.autovec_copy(w2[lane + i * WARP_SIZE, None], wv)
                                ws.append(wv)
                        for i in cutlass.range_constexpr(i0, min(n, i0 + W_BATCH)):
                            yv = cute.make_rmem_tensor((vec,), mY.element_type)
                            for e in cutlass.range_constexpr(vec):
                                y = xs[i][e].to(Float32) * rstd
                                if cutlass.const_expr(has_w):
                                    y = y * ws[i - i0][e].to(Float32)
                                yv[e] = y.to(mY.element_type)
                            cute.autovec_copy(yv, y3[row, lane + i * WARP_SIZE, None])
                elif cutlass.const_expr(self._vectors):
                    ss = Float32(0.0)
                    for c in cutlass.range(lane, nvec, WARP_SIZE, unroll=4):
                        xv = cute.make_rmem_tensor((vec,), mX.element_type)
                        cute.autovec_copy(x3[row, c, None], xv)
                        for e in cutlass.range_constexpr(vec):
                            v = xv[e].to(Float32)
                            ss = ss + v * v
                    ss = cute.arch.warp_reduction_sum(ss)
                    rstd = cute.math.rsqrt(ss * inv_cols + Float32(self.eps))
                    for c in cutlass.range(lane, nvec, WARP_SIZE, unroll=4):
                        xv = cute.make_rmem_tensor((vec,), mX.element_type)
                        wv = cute.make_rmem_tensor((vec,), mW.element_type)
                        cute.autovec_copy(x3[row, c, None], xv)
                        if cutlass.const_expr(has_w):
                            cute.autovec_copy(w2[c, None], wv)
                        yv = cute.make_rmem_tensor((vec,), mY.element_type)
                        for e in cutlass.range_constexpr(vec):
                            y = xv[e].to(Float32) * rstd
                            if cutlass.const_expr(has_w):
                                y = y * wv[e].to(Float32)
                            yv[e] = y.to(mY.element_type)
                        cute.autovec_copy(yv, y3[row, c, None])
                else:  # a width known only at run time: element by element
                    ss = Float32(0.0)
                    for c in cutlass.range(lane, cols, WARP_SIZE, unroll=4):
                        v = mX[row, c].to(Float32)
                        ss = ss + v * v
                    ss = cute.arch.warp_reduction_sum(ss)
                    rstd = cute.math.rsqrt(ss * inv_cols + Float32(self.eps))
                    for c in cutlass.range(lane, cols, WARP_SIZE, unroll=4):
                        y = mX[row, c].to(Float32) * rstd
                        if cutlass.const_expr(has_w):
                            y = y * mW[c].to(Float32)
                        mY[row, c] = y.to(mY.element_type)


def rmsnorm(
    x: TensorSpec, weight: TensorSpec | None = None, *, eps: float = 1e-6, block_m: int = 16
) -> RmsNormTile:
    return RmsNormTile(x, weight, eps, block_m)
