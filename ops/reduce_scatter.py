"""Reduce-scatter tile op: this rank's row chunk of the sum of every rank's ``partial``.

Tensor-parallel row-split layers (the MLP's down projection, attention's output projection)
leave each rank with a full-size partial sum; rank r keeps rows ``[r * m / W, (r + 1) * m / W)``
of their total. A tile reads its block from every rank's ``partial`` (symmetric memory, peers'
copies over NVLink), sums in fp32 in rank order (so every rank rounds the same way) and writes
its block of ``out``.

Dependencies: a tile must wait for the producers of its block *on every rank*. Those are
declared with an explicit event and ``remote_wait`` (``cutemk.layers.gemm_rs_graph``); the
region declared here is the local block only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
from cutlass import Float32, Int32, cute

from cutemk.comm import peer_key
from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.device.peers import peer_tensors
from cutemk.errors import ShapeError
from cutemk.symbolic import cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    expect_dtype,
    expect_ndim,
    expect_positive_int,
    register_op,
)

VEC = 8
"""Elements per thread per step of the device tile."""


@register_op
@dataclass(frozen=True)
class ReduceScatterTile(TileOp):
    partial: TensorSpec  # (m, n): this rank's summand, in symmetric memory
    world: int
    block_m: int = 16
    block_n: int = 1024

    name: ClassVar[str] = "reduce_scatter"
    inputs: ClassVar[tuple[str, ...]] = ("partial",)
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    peer_values: ClassVar[tuple[str, ...]] = ("partial",)

    def __post_init__(self) -> None:
        expect_ndim(self.partial, 2, "reduce_scatter partial")
        expect_dtype(self.partial, FLOAT_DTYPES, "reduce_scatter partial")
        for f in ("world", "block_m", "block_n"):
            expect_positive_int(getattr(self, f), f"reduce_scatter {f}")
        m = self.partial.shape[0]
        if isinstance(m, int) and m % self.world:
            raise ShapeError(f"reduce_scatter: {m} rows do not split over {self.world} ranks")

    def output_specs(self):
        m, n = self.partial.shape
        return {"out": TensorSpec((m // self.world, n), self.partial.dtype)}

    def grid(self):
        m, n = self.partial.shape
        return (cdiv(m // self.world, self.block_m), cdiv(n, self.block_n))

    def _dims(self, env):
        m, n = (d if isinstance(d, int) else d.eval(env) for d in self.partial.shape)
        if m % self.world:
            raise ShapeError(
                f"reduce_scatter: {m} rows do not split over {self.world} ranks (pass a multiple "
                f"of {self.world} tokens)"
            )
        return m, n, m // self.world, env.get("RANK", 0)

    def reads(self, coord, env, data=None):
        _, n, chunk, rank = self._dims(env)
        r0, r1 = block(coord[0], self.block_m, chunk)
        return {
            "partial": ((rank * chunk + r0, rank * chunk + r1), block(coord[1], self.block_n, n))
        }

    def writes(self, coord, env, data=None):
        _, n, chunk, _ = self._dims(env)
        return {"out": (block(coord[0], self.block_m, chunk), block(coord[1], self.block_n, n))}

    def cost(self, coord, env):
        _, n, _, _ = self._dims(env)
        es = self.partial.dtype.itemsize
        elems = self.block_m * min(self.block_n, n)
        return tile_time_us(self.world * elems, (self.world + 1) * elems * es, self.partial.dtype)

    def reference(self, coord, env, t):
        _, _, chunk, rank = self._dims(env)
        (r0, r1), (c0, c1) = self.writes(coord, env)["out"]
        peers = t[peer_key("partial")]
        acc = None
        for s in range(peers.world):  # rank order, as on the device
            v = peers.tensors[s][rank * chunk + r0 : rank * chunk + r1, c0:c1].float()
            acc = v if acc is None else acc + v
        t["out"][r0:r1, c0:c1] = acc.to(t["out"].dtype)

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """``tensors`` = (mPartial, mOut, mPeers). mPartial: (m, n) local; mOut: (m / W, n);
        mPeers: int64 ``[rank, addr_0, ..., addr_{W-1}]`` of every rank's ``partial``. The CTA
        sweeps each row with consecutive threads on consecutive columns (coalesced over NVLink)."""
        mPartial, mOut = tensors[0], tensors[1]
        rank, srcs = peer_tensors(tensors[2], mPartial, self.world)
        chunk = mOut.shape[0]
        n = mOut.shape[1]
        row0 = coord0 * self.block_m
        rows = cute.min(row0 + self.block_m, chunk) - row0
        col0 = coord1 * self.block_n
        col_end = cute.min(col0 + self.block_n, n)
        src_row0 = rank * chunk + row0
        # VEC rows at a time: a thread issues all VEC * world loads of a step (unconditional,
        # rows past the tile clamped to its last row) before any store, so they are in flight
        # together (the compiler cannot move a load above a store that may alias it)
        acc = cute.make_rmem_tensor((VEC,), Float32)
        for rb in range(0, rows, VEC):
            for c in range(col0 + tidx, col_end, NUM_THREADS):
                for v in cutlass.range_constexpr(VEC):
                    r = src_row0 + cute.min(rb + v, rows - 1)
                    acc[v] = Float32(0.0)
                    for s in cutlass.range_constexpr(self.world):
                        acc[v] = acc[v] + srcs[s][r, c].to(Float32)
                for v in cutlass.range_constexpr(VEC):
                    if rb + v < rows:
                        mOut[row0 + rb + v, c] = acc[v].to(mOut.element_type)


def reduce_scatter(
    partial: TensorSpec, *, world: int, block_m: int = 16, block_n: int = 1024
) -> ReduceScatterTile:
    """Rows ``[rank * m / world, (rank + 1) * m / world)`` of the sum over ranks of ``partial``."""
    return ReduceScatterTile(partial, world, block_m, block_n)
