"""Split-K GEMM for decode sizes: partial tiles over K ranges, then an event-ordered reduction.

At a few tokens a GEMM is a weight stream: its time is the weight bytes over the bandwidth
every SM can pull. One tile per (row block, column block) leaves SMs idle or runs a second,
partial wave (a Qwen3-8B down projection has 16 column blocks of 256 for 132 SMs). Splitting K
into ``split_k`` ranges gives ``split_k`` times as many tiles, each streaming ``1 / split_k`` of
its weight slab, so the stream spreads over all SMs:

- :class:`GemmPartialTile` (``gemm_partial``): tile ``(i, j * split_k + s)`` computes the fp32
  product of row block i and column block j over K range s into ``part[s]`` (split_k, M, N).
  It is the GEMM tile with a K range (the Hopper path streams the range's slices through the
  ring; the weights are loaded before the task's events, as for every GEMM);
- :class:`SplitReduceTile` (``gemm_split_reduce``): sums ``part`` over the ranges and applies
  the epilogue (``silu_mul`` of the gate and up halves, ``residual``), rounding once. Its events
  are the partial tiles whose boxes it reads, so a reduce tile starts as soon as its own column
  block is complete, and the next GEMM's tiles (split too) wait only for the reduce tiles of
  their K range.

:func:`choose_split` picks ``split_k`` and the partial tile width from the sizes
(``cutemk.layers.linear`` uses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import cutlass
import numpy as np
import torch
import torch.nn.functional as F
from cutlass import Float32, Int32, cute

from cutemk.costmodel import H200, Hardware, tile_time_us
from cutemk.device.config import NUM_THREADS, NUM_WARPS, WARP_SIZE, simt_sync
from cutemk.device.vectors import row_vectors, vec16
from cutemk.errors import GraphError, ShapeError
from cutemk.symbolic import IntLike, cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    blocks,
    boxes,
    expect_dtype,
    expect_ndim,
    expect_positive_int,
    expect_same_dim,
    register_op,
    span,
)

from . import gemm_sm90
from .gemm import GemmTile
from .split_reduce import add_squares, load_ranges, reduce_vector

REDUCE_EPILOGUES = (None, "silu_mul", "residual")

SLICE = gemm_sm90.BLOCK_K
"""K granule of a range: each range is a whole number of the Hopper tile's k-slices."""

VEC = 4
"""fp32 partials a reduce thread moves per load (16 bytes)."""

OUT_NORM_VECTORS = 4
"""Most vectors of a row a thread of a reduce with ``out_norm`` holds: N <= 4 * VEC *
NUM_THREADS (2048 on the 128-thread SIMT group; every range's partials of them are loaded at
once, split * 16 fp32 registers a vector)."""


OUT_NORM_PARTIALS = 128
"""Most fp32 partials a thread of a reduce with ``out_norm`` loads at once (its vectors times
the split times ``VEC``): the Qwen3-30B-A3B o_proj's 4 vectors of 8 ranges compile without
spills beside the consumers' other registers; twice that would not fit in 232."""


def out_norm_fits(n, dtype: torch.dtype, epilogue: Optional[str] = None, split: int = 1) -> bool:
    """Whether a reduce of N columns (``dtype`` out, ``epilogue``) over ``split`` ranges can
    take ``out_norm``: a static N of whole vectors, at most ``OUT_NORM_VECTORS`` a thread and
    ``OUT_NORM_PARTIALS`` partials, no ``silu_mul``."""
    vectors = -(-n // (VEC * NUM_THREADS)) if isinstance(n, int) else 0
    return (
        isinstance(n, int)
        and n % VEC == 0
        and vectors <= OUT_NORM_VECTORS
        and vectors * split * VEC <= OUT_NORM_PARTIALS
        and epilogue != "silu_mul"
        and dtype in FLOAT_DTYPES
    )


@register_op
@dataclass(frozen=True)
class GemmPartialTile(GemmTile):
    """``part[s] = A[:, K_s] @ B[:, K_s]^T`` in fp32 for the ``split_k`` equal K ranges K_s."""

    split_k: int = 2

    name: ClassVar[str] = "gemm_partial"
    outputs: ClassVar[tuple[str, ...]] = ("part",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epilogue is not None or self.r is not None:
            raise ValueError("gemm_partial has no epilogue: gemm_split_reduce applies it")
        if self.out_dtype not in (None, torch.float32):
            raise TypeError(f"gemm_partial writes fp32 partials, got out_dtype={self.out_dtype}")
        expect_positive_int(self.split_k, "gemm_partial split_k")
        if self.split_k < 2:
            raise ValueError("gemm_partial split_k must be >= 2 (one range is ops.gemm), got 1")
        k = self.k
        if not isinstance(k, int) or k % (self.split_k * SLICE):
            raise ShapeError(
                f"gemm_partial: K={k} must be a multiple of split_k * {SLICE} = "
                f"{self.split_k * SLICE} (every range a whole number of {SLICE}-wide slices)"
            )

    def output_specs(self) -> dict[str, TensorSpec]:
        return {"part": TensorSpec((self.split_k, self.m, self.n), torch.float32)}

    def grid(self):
        return (cdiv(self.m, self.block_m), cdiv(self.n, self.block_n) * self.split_k)

    # grid order, not the GEMM's raster: a column block's ranges next to each other, so its
    # reduce tile is ready early
    order_key = TileOp.order_key

    def _ranges(self, coord, env):
        m, n, k = self._dims(env)
        i, c1 = coord
        j, s = divmod(c1, self.split_k)
        kq = k // self.split_k
        return block(i, self.block_m, m), block(j, self.block_n, n), (s * kq, (s + 1) * kq), s

    def reads(self, coord, env, data=None):
        rows, cols, ks, _ = self._ranges(coord, env)
        return {"a": (rows, ks), "b": (cols, ks)}

    def writes(self, coord, env, data=None):
        rows, cols, _, s = self._ranges(coord, env)
        return {"part": ((s, s + 1), rows, cols)}

    def region_arrays(self, which, env, coords):
        m, n, k = self._dims(env)
        rows = blocks(coords[:, 0], self.block_m, m)
        cols = blocks(coords[:, 1] // self.split_k, self.block_n, n)
        s = coords[:, 1] % self.split_k
        if which == "writes":
            return {"part": boxes(np.stack([s, s + 1], axis=1), rows, cols)}
        kq = k // self.split_k
        ks = np.stack([s * kq, (s + 1) * kq], axis=1)
        return {"a": boxes(rows, ks), "b": boxes(cols, ks)}

    def cost(self, coord, env):
        _, _, k = self._dims(env)
        kq = k // self.split_k
        bm, bn = self.block_m, self.block_n
        es = self.a.dtype.itemsize
        return tile_time_us(2.0 * bm * bn * kq, (bm + bn) * kq * es + bm * bn * 4, self.a.dtype)

    def reference(self, coord, env, t):
        (r0, r1), (c0, c1), (k0, k1), s = self._ranges(coord, env)
        a = t["a"][r0:r1, k0:k1].float()
        t["part"][s, r0:r1, c0:c1] = a @ t["b"][c0:c1, k0:k1].float().T


@register_op
@dataclass(frozen=True)
class SplitReduceTile(TileOp):
    """``C = epilogue(sum_s part[s])``, one (block_m, block_n) tile of C a task.

    ``silu_mul``: part holds the gate partials in columns [0, N) and the up partials in
    [N, 2N) (a partial GEMM of the stacked [W_gate; W_up]); ``residual``: C = sum + R.

    ``norm_eps`` (with ``x``, the GEMM's A operand (m, K)): the GEMM was ``x @ (W diag(g))^T``
    for an RMSNorm ``y = x / rms(x) * g`` folded into the weight, and each row's sum is scaled
    by ``1 / sqrt(mean(x_row^2) + eps)`` here, before the epilogue: the norm then costs no
    phase of its own between the layer's previous output and the projection.

    Where x is itself the output of a split reduce, that reduce can hand the norm its rows'
    sums of squares instead of the rows: ``sumsq`` makes a tile also write, for each of its
    rows, the sum of the squares of the values it stored (rounded, as the next GEMM reads
    them) to ``ss[row, j]`` (output ``ss``, (m, column blocks), fp32), and a reduce given that
    ``ss`` as ``x`` with ``norm_width`` = K sums a row's column blocks in order (deterministic)
    instead of reading the K-wide row: one small load a row, no block reduction.

    ``out_norm`` (a weight g (N,), with ``out_norm_eps``): the tile also writes ``y`` =
    RMSNorm(C) * g, the norm of the values it stored (rounded), so a pre-norm block's norm of
    the residual stream costs no phase of its own (a decoder layer's post-attention norm where
    the MoE block reads it). A tile then holds whole rows (``block_n`` >= N)."""

    part: TensorSpec  # (split_k, m, n), or (split_k, m, 2n) with silu_mul; fp32
    r: Optional[TensorSpec] = None  # (m, n) with the residual epilogue
    epilogue: Optional[str] = None
    out_dtype: torch.dtype = torch.bfloat16
    block_m: int = 2
    block_n: int = VEC * NUM_THREADS
    x: Optional[TensorSpec] = None  # (m, K): the un-normalised A operand, with norm_eps
    norm_eps: Optional[float] = None
    # x is the A operand's row sums of squares in column blocks (m, nb) of a reduce with
    # ``sumsq``, and this is K (the width the mean is over)
    norm_width: Optional[int] = None
    sumsq: bool = False  # also write ``ss``: each row's sum of squares of this tile's output
    out_norm: Optional[TensorSpec] = None  # (n,): also write y = rmsnorm(C) * out_norm
    out_norm_eps: Optional[float] = None

    name: ClassVar[str] = "gemm_split_reduce"
    uniform_cost: ClassVar[bool] = True
    token_local: ClassVar[bool] = True

    @property
    def outputs(self) -> tuple[str, ...]:
        if self.out_norm is not None:
            return ("c", "y")
        return ("c", "ss") if self.sumsq else ("c",)

    @property
    def inputs(self) -> tuple[str, ...]:
        return (
            ("part",)
            + ("x",) * (self.x is not None)
            + ("r",) * (self.r is not None)
            + ("out_norm",) * (self.out_norm is not None)
        )

    def __post_init__(self) -> None:
        expect_ndim(self.part, 3, "gemm_split_reduce part")
        expect_dtype(self.part, (torch.float32,), "gemm_split_reduce part")
        if not isinstance(self.part.shape[0], int):
            raise ShapeError("gemm_split_reduce: the number of K ranges must be static")
        if self.epilogue not in REDUCE_EPILOGUES:
            raise ValueError(f"gemm_split_reduce epilogue must be one of {REDUCE_EPILOGUES}")
        if self.out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"gemm_split_reduce out_dtype must be one of {FLOAT_DTYPES}")
        if (self.epilogue == "residual") != (self.r is not None):
            raise ValueError("gemm_split_reduce: the residual epilogue takes r, and only it does")
        cols = self.part.shape[2]
        if self.epilogue == "silu_mul" and (not isinstance(cols, int) or cols % 2):
            raise ShapeError(f"gemm_split_reduce silu_mul needs an even static width, got {cols}")
        expect_positive_int(self.block_m, "gemm_split_reduce block_m")
        expect_positive_int(self.block_n, "gemm_split_reduce block_n")
        if self.r is not None:
            expect_ndim(self.r, 2, "gemm_split_reduce r")
            expect_same_dim(self.r.shape[0], self.m, "gemm_split_reduce: r rows vs part rows")
            expect_same_dim(self.r.shape[1], self.n, "gemm_split_reduce: r cols vs N")
            if self.r.dtype != self.out_dtype:
                raise TypeError(f"gemm_split_reduce r must be {self.out_dtype}, got {self.r.dtype}")
        if (self.x is None) != (self.norm_eps is None):
            raise ValueError("gemm_split_reduce: norm_eps takes x (the GEMM's A), and only it does")
        if self.x is not None:
            expect_ndim(self.x, 2, "gemm_split_reduce x")
            expect_dtype(self.x, FLOAT_DTYPES, "gemm_split_reduce x")
            expect_same_dim(self.x.shape[0], self.m, "gemm_split_reduce: x rows vs part rows")
            if not isinstance(self.x.shape[1], int):
                raise ShapeError("gemm_split_reduce: x needs a static width")
            if not self.norm_eps > 0:
                raise ValueError(f"gemm_split_reduce norm_eps must be > 0, got {self.norm_eps}")
        if self.norm_width is not None:
            if self.x is None or self.x.dtype != torch.float32:
                raise TypeError("gemm_split_reduce: norm_width takes x as fp32 row sums of squares")
            expect_positive_int(self.norm_width, "gemm_split_reduce norm_width")
        if (self.out_norm is None) != (self.out_norm_eps is None):
            raise ValueError("gemm_split_reduce: out_norm and out_norm_eps go together")
        if self.out_norm is not None:
            self._check_out_norm()

    def _check_out_norm(self) -> None:
        """A tile of whole rows, each thread's vectors of a row in registers between its
        stores of C and of y (at most ``OUT_NORM_VECTORS``)."""
        n = self.n
        if self.sumsq or self.epilogue == "silu_mul":
            raise ValueError("gemm_split_reduce: out_norm takes neither sumsq nor silu_mul")
        expect_ndim(self.out_norm, 1, "gemm_split_reduce out_norm")
        if self.out_norm.dtype != self.out_dtype:
            raise TypeError(
                f"gemm_split_reduce out_norm must be {self.out_dtype}, got {self.out_norm.dtype}"
            )
        expect_same_dim(self.out_norm.shape[0], n, "gemm_split_reduce: out_norm vs N")
        if not isinstance(n, int) or n % VEC:
            raise ShapeError(f"gemm_split_reduce out_norm needs a static N, a multiple of {VEC}")
        if self.block_n < n:
            raise ShapeError(
                f"gemm_split_reduce out_norm: a tile must hold whole rows (block_n {self.block_n}"
                f" < N {n})"
            )
        vectors = -(-n // (VEC * NUM_THREADS))
        if vectors > OUT_NORM_VECTORS:
            raise ShapeError(
                f"gemm_split_reduce out_norm: N={n} is more than {OUT_NORM_VECTORS} vectors a "
                "thread"
            )
        if isinstance(self.splits, int) and vectors * self.splits * VEC > OUT_NORM_PARTIALS:
            raise ShapeError(
                f"gemm_split_reduce out_norm: N={n} over {self.splits} ranges is "
                f"{vectors * self.splits * VEC} fp32 partials a thread, more than "
                f"{OUT_NORM_PARTIALS} (they would spill)"
            )
        if not self.out_norm_eps > 0:
            raise ValueError(f"gemm_split_reduce out_norm_eps must be > 0, got {self.out_norm_eps}")

    def check_producers(self, producers) -> None:
        src = producers.get("part")
        if self.norm_width is not None:
            ss = producers.get("x")
            if getattr(ss, "sumsq", False) is not True:  # a reduce's or a gemm_split's
                raise GraphError(
                    "gemm_split_reduce: with norm_width, x must be the ss output of a "
                    "gemm_split_reduce or gemm_split with sumsq"
                )
            width = ss.n if isinstance(ss.n, int) else None
            if isinstance(src, GemmPartialTile) and not (width == self.norm_width == src.k):
                raise GraphError(
                    f"gemm_split_reduce: norm_width={self.norm_width}, but the partials are "
                    f"over K={src.k} and the sums of squares over {width} columns"
                )
            return
        if self.x is not None and isinstance(src, GemmPartialTile) and self.x.shape[1] != src.k:
            raise GraphError(
                f"gemm_split_reduce: x has {self.x.shape[1]} columns, but the partials are over "
                f"K={src.k} (x must be the partial GEMM's A operand)"
            )

    @property
    def splits(self) -> int:
        return self.part.shape[0]

    @property
    def m(self) -> IntLike:
        return self.part.shape[1]

    @property
    def n(self) -> IntLike:
        cols = self.part.shape[2]
        return cols // 2 if self.epilogue == "silu_mul" else cols

    @property
    def _vec(self) -> int:
        """Columns a thread moves at once: VEC where rows and tiles keep 16-byte alignment."""
        n = self.n
        ok = isinstance(n, int) and n % VEC == 0 and self.block_n % VEC == 0
        return VEC if ok else 1

    def output_specs(self):
        specs = {"c": TensorSpec((self.m, self.n), self.out_dtype)}
        if self.sumsq:
            specs["ss"] = TensorSpec((self.m, cdiv(self.n, self.block_n)), torch.float32)
        if self.out_norm is not None:
            specs["y"] = TensorSpec((self.m, self.n), self.out_dtype)
        return specs

    def grid(self):
        return (cdiv(self.m, self.block_m), cdiv(self.n, self.block_n))

    def _box(self, coord, env):
        m, n = (d if isinstance(d, int) else d.eval(env) for d in (self.m, self.n))
        return block(coord[0], self.block_m, m), block(coord[1], self.block_n, n), n

    def reads(self, coord, env, data=None):
        rows, cols, n = self._box(coord, env)
        ranges = (0, self.splits)
        part = (ranges, rows, cols)
        if self.epilogue == "silu_mul":  # the gate and the up partials of these columns
            part = [part, (ranges, rows, (n + cols[0], n + cols[1]))]
        r = {"part": part}
        if self.r is not None:
            r["r"] = (rows, cols)
        if self.x is not None:
            r["x"] = (rows, (0, self.x.shape[1]))
        if self.out_norm is not None:
            r["out_norm"] = ((0, n),)
        return r

    def writes(self, coord, env, data=None):
        rows, cols, _ = self._box(coord, env)
        w = {"c": (rows, cols)}
        if self.sumsq:
            w["ss"] = (rows, (coord[1], coord[1] + 1))
        if self.out_norm is not None:
            w["y"] = (rows, cols)
        return w

    def region_arrays(self, which, env, coords):
        if which == "reads" and self.epilogue == "silu_mul":
            return None  # two boxes a tile: per tile (few tiles at the sizes split-K serves)
        m, n = (d if isinstance(d, int) else d.eval(env) for d in (self.m, self.n))
        rows = blocks(coords[:, 0], self.block_m, m)
        cols = blocks(coords[:, 1], self.block_n, n)
        if which == "writes":
            w = {"c": boxes(rows, cols)}
            if self.sumsq:
                w["ss"] = boxes(rows, np.stack([coords[:, 1], coords[:, 1] + 1], axis=1))
            if self.out_norm is not None:
                w["y"] = boxes(rows, cols)
            return w
        r = {"part": boxes(span(0, self.splits, len(coords)), rows, cols)}
        if self.r is not None:
            r["r"] = boxes(rows, cols)
        if self.x is not None:
            r["x"] = boxes(rows, span(0, self.x.shape[1], len(coords)))
        if self.out_norm is not None:
            r["out_norm"] = boxes(span(0, n, len(coords)))
        return r

    def cost(self, coord, env):
        # the tile's live rows, each a round trip for its partials and, with ``x``, one for
        # its norm (they run one after another): on the H200 a one-row tile with the norm
        # measured ~3 us and a two-row one ~5 us. Uniform: every tile is priced as the first
        (r0, r1), _, _ = self._box((0, 0), env)
        rows = r1 - r0
        nb = 2 if self.epilogue == "silu_mul" else 1
        elems = rows * self.block_n
        nbytes = elems * (
            4 * self.splits * nb + self.out_dtype.itemsize * (1 + (self.r is not None))
        )
        if self.x is not None:
            nbytes += rows * self.x.shape[1] * self.x.dtype.itemsize
        if self.out_norm is not None:  # y's rows; its block sum a barrier, no round trip
            nbytes += elems * self.out_dtype.itemsize
        # the norm's row: a round trip before the partials' (its sums of squares load with them)
        trips = rows * (2 if self.x is not None and self.norm_width is None else 1)
        stream = tile_time_us(elems * self.splits * nb, nbytes, torch.float32)
        return stream + H200.load_latency_us * trips

    def reference(self, coord, env, t):
        (r0, r1), (c0, c1), n = self._box(coord, env)
        part = t["part"][:, r0:r1].float()
        scale = 1.0
        if self.x is not None:
            x = t["x"][r0:r1].float()
            if self.norm_width is None:
                ms = x.pow(2).mean(-1, keepdim=True)
            else:
                ms = x.sum(-1, keepdim=True) / self.norm_width
            scale = torch.rsqrt(ms + self.norm_eps)
        v = part[:, :, c0:c1].sum(0) * scale
        if self.epilogue == "silu_mul":
            v = F.silu(v) * (part[:, :, n + c0 : n + c1].sum(0) * scale)
        if self.r is not None:
            v = v + t["r"][r0:r1, c0:c1].float()
        c = t["c"][r0:r1, c0:c1] = v.to(t["c"].dtype)
        if self.sumsq:
            t["ss"][r0:r1, coord[1]] = c.float().pow(2).sum(-1)
        if self.out_norm is not None:  # ``ops.rmsnorm``'s reference on the stored rows
            cf = c.float()
            y = cf * (cf.pow(2).mean(dim=-1, keepdim=True) + self.out_norm_eps).rsqrt()
            t["y"][r0:r1] = (y * t["out_norm"].float()).to(t["y"].dtype)

    def device_smem_bytes(self) -> int:
        # the warp sums of a row norm or of the rows' sums of squares
        block_sums = self.sumsq or (self.x is not None and self.norm_width is None)
        return 4 * NUM_WARPS if block_sums or self.out_norm is not None else 0

    @cute.jit
    def _row_rstd(self, mX, row: Int32, tidx: Int32, sSum) -> Float32:
        """1 / sqrt(mean(x[row]^2) + eps) over the SIMT group: every thread sums the squares
        of its columns, a warp all-reduce, the warps' sums through shared memory."""
        k = self.x.shape[1]
        vx = vec16(self.x.dtype.itemsize, k)
        nvx = k // vx
        x3 = row_vectors(mX, mX.shape[0], k, vx)
        ss = Float32(0.0)
        for i in cutlass.range_constexpr(-(-nvx // NUM_THREADS)):
            c = tidx + i * NUM_THREADS
            if c < nvx:
                xv = cute.make_rmem_tensor((vx,), mX.element_type)
                cute.autovec_copy(x3[row, c, None], xv)
                for e in cutlass.range_constexpr(vx):
                    v = xv[e].to(Float32)
                    ss = ss + v * v
        tot = self._block_sum(ss, tidx, sSum)
        return cute.math.rsqrt(tot / Float32(k) + Float32(self.norm_eps))

    @cute.jit
    def _row_rstd_of_sums(self, mSS, row: Int32) -> Float32:
        """The row's scale from its sums of squares in column blocks (``norm_width``), added in
        block order; every thread loads them (the same words: one broadcast per warp)."""
        tot = mSS[row, 0]
        for j in cutlass.range_constexpr(1, self.x.shape[1]):
            tot = tot + mSS[row, j]
        return cute.math.rsqrt(tot / Float32(self.norm_width) + Float32(self.norm_eps))

    @cute.jit
    def _block_sum(self, v: Float32, tidx: Int32, sSum) -> Float32:
        """The SIMT group's sum of ``v``, in a fixed order, to every thread."""
        v = cute.arch.warp_reduction_sum(v)
        if tidx % WARP_SIZE == 0:
            sSum[tidx // WARP_SIZE] = v
        simt_sync()
        tot = sSum[0]
        for w in cutlass.range_constexpr(1, NUM_WARPS):
            tot = tot + sSum[w]
        simt_sync()  # read before the next row's sums
        return tot

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Tile (coord0, coord1) of C; ``tensors`` = (mPart, [mX,] [mR,] mC [, mSS]). A thread
        owns ``_vec`` consecutive columns of every row of the tile: it loads every range's
        partials of them at once (one round trip to memory), sums in fp32, applies the row's
        norm scale (with ``x``) and the epilogue, and stores; with ``sumsq`` the group then
        adds up the squares of the row's stored values for ``ss``; with ``out_norm`` see
        :meth:`_tile_with_out_norm`."""
        sSum = cute.make_tensor(
            cute.recast_ptr(smem_ptr, dtype=Float32), cute.make_layout((NUM_WARPS,))
        )
        if cutlass.const_expr(self.out_norm is not None):
            self._tile_with_out_norm(tensors, coord0, tidx, sSum)
        else:
            self._tile(tensors, coord0, coord1, tidx, sSum)

    @cute.jit
    def _tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, sSum):
        """:meth:`device_tile` without ``out_norm``."""
        n_in = len(self.inputs)
        mP, mC, mSS = tensors[0], tensors[n_in], tensors[len(tensors) - 1]
        fused = self.epilogue == "silu_mul"
        vec, splits = self._vec, self.splits
        rows = mC.shape[0]
        n = mC.shape[1]
        ncols = mP.shape[2]
        if cutlass.const_expr(vec > 1):  # static widths: the vector accesses are aligned
            n = self.n
            ncols = self.part.shape[2]
        nv = n // vec
        # the split ranges' stride is the tensor's own: a buffer allocated for more rows than
        # the launch binds (a live token count, ``cutemk.live``) is not compact in rows
        p_split = cute.assume(mP.stride[0], divby=vec)
        p4 = cute.make_tensor(
            mP.iterator,
            cute.make_layout((splits, rows, ncols // vec, vec), stride=(p_split, ncols, vec, 1)),
        )
        c3 = cute.make_tensor(mC.iterator, cute.make_layout((rows, nv, vec), stride=(n, vec, 1)))
        r3 = c3
        if cutlass.const_expr(self.r is not None):
            r3 = cute.make_tensor(
                tensors[n_in - 1].iterator,
                cute.make_layout((rows, nv, vec), stride=(n, vec, 1)),
            )
        row0 = coord0 * self.block_m
        tile_v = self.block_n // vec  # vectors of a tile row (block_n is a multiple of vec)
        v0 = coord1 * tile_v
        for r in cutlass.range(self.block_m, unroll=1):
            row = row0 + r
            scale = Float32(1.0)
            if cutlass.const_expr(self.x is not None):
                if row < rows:  # uniform over the group: the norm's barriers are safe
                    scale = self._row_scale(tensors, row, tidx, sSum)
            sq = Float32(0.0)
            for j in cutlass.range_constexpr(-(-tile_v // NUM_THREADS)):
                lv = tidx + j * NUM_THREADS
                cv = v0 + lv
                if row < rows and lv < tile_v and cv < nv:
                    gs, us = load_ranges(p4, splits, row, cv, vec, nv if fused else None)
                    res = None
                    if cutlass.const_expr(self.r is not None):
                        res = cute.make_rmem_tensor((vec,), mC.element_type)
                        cute.autovec_copy(r3[row, cv, None], res)
                    out = cute.make_rmem_tensor((vec,), mC.element_type)
                    reduce_vector(gs, us, out, vec, scale=scale, res=res)
                    if cutlass.const_expr(self.sumsq):
                        sq = add_squares(out, vec, sq)
                    cute.autovec_copy(out, c3[row, cv, None])
            if cutlass.const_expr(self.sumsq):
                if row < rows:  # uniform over the group
                    tot = self._block_sum(sq, tidx, sSum)
                    if tidx == 0:
                        mSS[row, coord1] = tot

    @cute.jit
    def _row_scale(self, tensors, row: Int32, tidx: Int32, sSum) -> Float32:
        """The folded input norm's scale of ``row`` (1 without one); ``row`` must be live (the
        block sum's barriers)."""
        scale = Float32(1.0)
        if cutlass.const_expr(self.norm_width is not None):
            scale = self._row_rstd_of_sums(tensors[1], row)
        elif cutlass.const_expr(self.x is not None):
            scale = self._row_rstd(tensors[1], row, tidx, sSum)
        return scale

    @cute.jit
    def _tile_with_out_norm(self, tensors, coord0: Int32, tidx: Int32, sSum):
        """Whole rows of C and of y = rmsnorm(C) * g (``out_norm``); ``tensors`` = (mPart,
        [mX,] [mR,] mG, mC, mY). Row by row: a thread loads every range's partials of its
        vectors of the row (clamped indices: all loads unconditional, one round trip), with the
        residual's and g's; sums and stores C keeping its vectors in registers; the group adds
        up the squares of the stored values (``ops.rmsnorm``'s arithmetic: rsqrt(ss / N +
        eps), then times g); then y is stored."""
        n_in = len(self.inputs)
        mP, mG, mC, mY = tensors[0], tensors[n_in - 1], tensors[n_in], tensors[n_in + 1]
        vec, splits, n = VEC, self.splits, self.n
        nv = n // vec
        per = -(-nv // NUM_THREADS)
        whole = nv % NUM_THREADS == 0  # every thread's vectors exist: no store guards
        rows = mC.shape[0]
        p_split = cute.assume(mP.stride[0], divby=vec)
        p4 = cute.make_tensor(
            mP.iterator, cute.make_layout((splits, rows, nv, vec), stride=(p_split, n, vec, 1))
        )
        c3 = row_vectors(mC, rows, n, vec)
        y3 = row_vectors(mY, rows, n, vec)
        g2 = cute.make_tensor(mG.iterator, cute.make_layout((nv, vec), stride=(vec, 1)))
        r3 = c3
        if cutlass.const_expr(self.r is not None):
            r3 = row_vectors(tensors[1 + (self.x is not None)], rows, n, vec)
        inv_n = Float32(1.0) / Float32(n)
        row0 = coord0 * self.block_m
        for i in cutlass.range(self.block_m, unroll=1):
            row = row0 + i
            if row < rows:  # uniform over the group: the block sums' barriers are safe
                scale = self._row_scale(tensors, row, tidx, sSum)
                got = []
                for j in cutlass.range_constexpr(per):
                    cv = cute.min(tidx + j * NUM_THREADS, nv - 1)
                    gs, _ = load_ranges(p4, splits, row, cv, vec)
                    res = None
                    if cutlass.const_expr(self.r is not None):
                        res = cute.make_rmem_tensor((vec,), mC.element_type)
                        cute.autovec_copy(r3[row, cv, None], res)
                    gw = cute.make_rmem_tensor((vec,), mG.element_type)
                    cute.autovec_copy(g2[cv, None], gw)
                    got.append((gs, res, gw))
                sq = Float32(0.0)
                outs = []
                for j in cutlass.range_constexpr(per):
                    gs, res, _ = got[j]
                    out = cute.make_rmem_tensor((vec,), mC.element_type)
                    reduce_vector(gs, [], out, vec, scale=scale, res=res)
                    outs.append(out)
                    lv = tidx + j * NUM_THREADS
                    if cutlass.const_expr(whole):
                        sq = add_squares(out, vec, sq)
                        cute.autovec_copy(out, c3[row, lv, None])
                    else:
                        if lv < nv:
                            sq = add_squares(out, vec, sq)
                            cute.autovec_copy(out, c3[row, lv, None])
                tot = self._block_sum(sq, tidx, sSum)
                rstd = cute.math.rsqrt(tot * inv_n + Float32(self.out_norm_eps))
                for j in cutlass.range_constexpr(per):
                    gw = got[j][2]
                    yv = cute.make_rmem_tensor((vec,), mY.element_type)
                    for e in cutlass.range_constexpr(vec):
                        yv[e] = (outs[j][e].to(Float32) * rstd * gw[e].to(Float32)).to(
                            mY.element_type
                        )
                    lv = tidx + j * NUM_THREADS
                    if cutlass.const_expr(whole):
                        cute.autovec_copy(yv, y3[row, lv, None])
                    else:
                        if lv < nv:
                            cute.autovec_copy(yv, y3[row, lv, None])


def gemm_partial(
    a: TensorSpec,
    b: TensorSpec,
    *,
    split_k: int,
    block_m: int = 64,
    block_n: int = 256,
    l2_prefetch: bool = False,
) -> GemmPartialTile:
    """fp32 partial products of ``a @ b^T`` over ``split_k`` K ranges: (split_k, M, N).
    ``l2_prefetch``: see ``GemmTile``."""
    return GemmPartialTile(
        a, b, block_m, block_n, None, torch.float32, None, split_k, l2_prefetch=l2_prefetch
    )


def gemm_split_reduce(
    part: TensorSpec,
    *operands: TensorSpec,
    epilogue: Optional[str] = None,
    norm_eps: Optional[float] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int = 2,
    block_n: Optional[int] = None,
    norm_width: Optional[int] = None,
    sumsq: bool = False,
    out_norm: Optional[TensorSpec] = None,
    out_norm_eps: Optional[float] = None,
) -> SplitReduceTile:
    """``epilogue(part.sum(0) * row scale)`` in ``out_dtype``. ``operands``: ``x`` first where
    ``norm_eps`` is given (the row scale is its RMSNorm's; with ``norm_width``, x is the row
    sums of squares another reduce's ``sumsq`` wrote), then the residual ``r`` (which implies
    the residual epilogue). ``sumsq``: also return ``ss``, the rows' sums of squares of C in
    column blocks of ``block_n``. ``out_norm`` (g (N,), with ``out_norm_eps``): also return
    ``y`` = RMSNorm(C) * g; the tile then spans whole rows (``block_n`` defaults to N)."""
    if len(operands) > 1 + (norm_eps is not None):
        raise ValueError(
            f"gemm_split_reduce takes x (with norm_eps) and r, got {len(operands)} operands"
        )
    operands = list(operands)
    x = operands.pop(0) if norm_eps is not None and operands else None
    r = operands.pop(0) if operands else None
    if r is not None and epilogue is None:
        epilogue = "residual"
    expect_ndim(part, 3, "gemm_split_reduce part")
    if block_n is None:
        n = part.shape[2]
        block_n = n if out_norm is not None and isinstance(n, int) else VEC * NUM_THREADS
    return SplitReduceTile(
        part,
        r,
        epilogue,
        out_dtype,
        block_m,
        block_n,
        x,
        norm_eps,
        norm_width,
        sumsq,
        out_norm,
        out_norm_eps,
    )


DECODE_GATE_UP_WIDTHS = (64, 80, 96, 112, 128)
"""Fused gate/up tile widths an unsplit decode GEMM picks from (:func:`wave_fit_width`)."""


def wave_fit_width(columns: int, row_tiles: int, num_sms: int, widths=DECODE_GATE_UP_WIDTHS):
    """The tile width (of ``widths``) whose busiest SM streams the fewest weight columns when
    ``row_tiles`` x ``columns / width`` tiles run in waves over ``num_sms`` SMs; ties go to the
    wider tile (fewer tiles). An unsplit weight stream's time is its busiest SM's share: 192
    tiles of 64 columns (Qwen3-8B's gate/up at 128 tokens) are 1.45 waves, so 60 SMs stream two
    tiles while 72 stream one; 128 tiles of 96 columns are one wave of 3/4 of that share."""

    def busiest(w: int) -> int:
        tiles = row_tiles * -(-columns // w)
        return -(-tiles // num_sms) * w

    return min(sorted(widths, reverse=True), key=busiest)


SPLIT_WIDTHS = (256, 192, 128)
"""Partial tile widths :func:`choose_split` picks from (64-row tiles: two consumer warpgroups
of 128, 96 or 64 columns)."""


def _stream_us(m_max, n, k, block_m, width, s, itemsize, hw, reduce_us) -> float:
    """A model of the weight-bound regime: each wave of tiles streams one tile's share of the
    weights per SM at ``hw.mem_bw / hw.num_sms``; a split adds its partials' traffic (written
    and read back in fp32) and a reduction phase (``reduce_us``: a hop plus the reduce tiles)."""
    tiles = math.ceil(m_max / block_m) * math.ceil(n / width)
    waves = math.ceil(tiles * s / hw.num_sms)
    task = width * (k // s) * itemsize / (hw.mem_bw / hw.num_sms) * 1e6 + hw.task_overhead_us
    if s == 1:
        return waves * task
    return waves * task + 2 * s * m_max * n * 4 / hw.mem_bw * 1e6 + reduce_us


def choose_split(
    m_max: int,
    n: int,
    k: int,
    block_m: int,
    unsplit_width: int | None = None,
    widths: tuple[int, ...] = SPLIT_WIDTHS,
    itemsize: int = 2,
    hw: Hardware = H200,
    reduce_us: float = 3.0,
) -> tuple[int, int]:
    """``(split_k, width)``: the K ranges and partial tile width (of ``widths``) that stream
    the weights fastest on ``hw``, or ``(1, unsplit_width)`` where one unsplit GEMM of tiles
    ``unsplit_width`` weight rows wide does (None: the GEMM must be split, e.g. because its
    reduce applies a folded norm). Only splits that keep every range a whole number of
    k-slices (at least 2 each) count; ties go to fewer ranges, then wider tiles. The width
    matters where the tiles fill whole waves badly: Qwen3-8B's fused QKV (6144 columns) at 64
    rows is 24 tiles of 256 columns, so 4 ranges leave 36 of 132 SMs idle, while 32 tiles of
    192 fill 128."""
    slices = k // SLICE if k % SLICE == 0 else 0
    cands = [(s, w) for s in range(2, slices // 2 + 1) if slices % s == 0 for w in widths]
    if unsplit_width is not None or not cands:
        cands.append((1, unsplit_width or widths[0]))

    def key(c):
        s, w = c
        return (_stream_us(m_max, n, k, block_m, w, s, itemsize, hw, reduce_us), s, -w)

    return min(cands, key=key)


def choose_split_k(
    m_max: int,
    n: int,
    k: int,
    block_m: int,
    block_n: int,
    itemsize: int = 2,
    hw: Hardware = H200,
    reduce_us: float = 3.0,
) -> int:
    """The number of K ranges of ``block_n``-wide tiles that streams the weights fastest on
    ``hw``, 1 for no split (:func:`choose_split` with one width)."""
    return choose_split(m_max, n, k, block_m, block_n, (block_n,), itemsize, hw, reduce_us)[0]
