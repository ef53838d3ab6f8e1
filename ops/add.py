"""Elementwise sum of two (rows, cols) tensors, one block of rows a task: a residual add where
the op producing one side has no residual epilogue (e.g. the MoE combine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
from cutlass import Float32, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.device.vectors import row_vectors, vec16
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
    expect_positive_int,
    expect_same_dim,
    register_op,
    span,
)

ADD_BATCH = 8  # 16-byte vectors of each input a thread loads before it stores


@register_op
@dataclass(frozen=True)
class AddTile(TileOp):
    a: TensorSpec  # (rows, cols)
    b: TensorSpec  # (rows, cols)
    block_m: int = 4

    name: ClassVar[str] = "add"
    inputs: ClassVar[tuple[str, ...]] = ("a", "b")
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    uniform_cost: ClassVar[bool] = True
    token_local: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            expect_ndim(getattr(self, name), 2, f"add {name}")
            expect_dtype(getattr(self, name), FLOAT_DTYPES, f"add {name}")
        if self.b.dtype != self.a.dtype:
            raise TypeError(f"add b must have a's dtype {self.a.dtype}, got {self.b.dtype}")
        expect_same_dim(self.a.shape[0], self.b.shape[0], "add rows")
        expect_same_dim(self.a.shape[1], self.b.shape[1], "add cols")
        expect_positive_int(self.block_m, "add block_m")

    def output_specs(self):
        return {"out": TensorSpec(self.a.shape, self.a.dtype)}

    def grid(self):
        return (cdiv(self.a.shape[0], self.block_m),)

    def _box(self, coord, env):
        rows, cols = self.a.concrete(env)
        return block(coord[0], self.block_m, rows), (0, cols)

    def reads(self, coord, env, data=None):
        box = self._box(coord, env)
        return {"a": box, "b": box}

    def writes(self, coord, env, data=None):
        return {"out": self._box(coord, env)}

    def region_arrays(self, which, env, coords):
        rows, cols = self.a.concrete(env)
        b = boxes(blocks(coords[:, 0], self.block_m, rows), span(0, cols, len(coords)))
        return {"out": b} if which == "writes" else {"a": b, "b": b}

    def cost(self, coord, env):
        cols = self.a.concrete(env)[1]
        return tile_time_us(self.block_m * cols, 3.0 * self.block_m * cols * 2, self.a.dtype)

    def reference(self, coord, env, t):
        (r0, r1), _ = self._box(coord, env)
        t["out"][r0:r1] = (t["a"][r0:r1].float() + t["b"][r0:r1].float()).to(t["out"].dtype)

    @property
    def _vec(self) -> int:
        """Elements a thread moves at once: a 16-byte vector where the width is a static
        multiple of one, else 1."""
        return vec16(self.a.dtype.itemsize, self.a.shape[1])

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Rows of block ``coord0``; ``tensors`` = (mA, mB, mOut). At a static width the tile
        is one flat run of 16-byte vectors, consecutive threads on consecutive vectors: a
        thread issues the loads of ``ADD_BATCH`` vectors of each input before it adds and
        stores them (a load may not pass an earlier store to memory that could alias it), so
        a tile costs a round trip to memory a batch, not one a vector. A width known only at
        run time goes element by element."""
        mA, mB, mOut = tensors
        rows = mA.shape[0]
        r0 = coord0 * self.block_m
        vec = self._vec
        if cutlass.const_expr(vec > 1):
            cols = self.a.shape[1]
            nv = cols // vec
            a3 = row_vectors(mA, rows, cols, vec)
            b3 = row_vectors(mB, rows, cols, vec)
            o3 = row_vectors(mOut, rows, cols, vec)
            total = self.block_m * nv
            per = -(-total // NUM_THREADS)
            for j0 in cutlass.range_constexpr(0, per, ADD_BATCH):
                batch = range(j0, min(per, j0 + ADD_BATCH))
                avs, bvs = [], []
                for j in cutlass.range_constexpr(batch.start, batch.stop):
                    idx = tidx + j * NUM_THREADS
                    r = r0 + idx // nv
                    av = cute.make_rmem_tensor((vec,), mA.element_type)
                    bv = cute.make_rmem_tensor((vec,), mB.element_type)
                    if idx < total and r < rows:
                        cute.autovec_copy(a3[r, idx % nv, None], av)
                        cute.autovec_copy(b3[r, idx % nv, None], bv)
                    avs.append(av)
                    bvs.append(bv)
                for j in cutlass.range_constexpr(batch.start, batch.stop):
                    idx = tidx + j * NUM_THREADS
                    r = r0 + idx // nv
                    if idx < total and r < rows:
                        ov = cute.make_rmem_tensor((vec,), mOut.element_type)
                        av, bv = avs[j - j0], bvs[j - j0]
                        for e in cutlass.range_constexpr(vec):
                            s = av[e].to(Float32) + bv[e].to(Float32)
                            ov[e] = s.to(mOut.element_type)
                        cute.autovec_copy(ov, o3[r, idx % nv, None])
        else:
            cols = mA.shape[1]
            n = (cute.min(r0 + self.block_m, rows) - r0) * cols
            for i in cutlass.range(tidx, n, NUM_THREADS, unroll=4):
                r = r0 + i // cols
                c = i % cols
                s = mA[r, c].to(Float32) + mB[r, c].to(Float32)
                mOut[r, c] = s.to(mOut.element_type)


def add(a: TensorSpec, b: TensorSpec, *, block_m: int = 4) -> AddTile:
    """``a + b`` elementwise (computed in fp32, rounded once)."""
    return AddTile(a, b, block_m)
