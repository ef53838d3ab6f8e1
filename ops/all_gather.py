"""All-gather tile op: every rank's shard of rows, stacked in rank order on every rank.

Rank r's tile copies a block of its shard ``x`` into rows ``r * s + ...`` of ``out`` on every
rank (its own copy and each peer's, through symmetric memory over NVLink: a push). A consumer
on rank q that reads rows of rank r's shard waits for rank r's copy tiles with an explicit event
and ``remote_wait`` (``cutemk.layers.ag_gemm_graph``); the region declared here is the rows this
rank writes into its own ``out``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
from cutlass import Int32, cute

from cutemk.comm import peer_key
from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.device.peers import peer_tensors
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
class AllGatherTile(TileOp):
    x: TensorSpec  # (s, k): this rank's shard
    world: int
    block_m: int = 16
    block_n: int = 1024

    name: ClassVar[str] = "all_gather"
    inputs: ClassVar[tuple[str, ...]] = ("x",)
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    peer_values: ClassVar[tuple[str, ...]] = ("out",)

    def __post_init__(self) -> None:
        expect_ndim(self.x, 2, "all_gather x")
        expect_dtype(self.x, FLOAT_DTYPES, "all_gather x")
        for f in ("world", "block_m", "block_n"):
            expect_positive_int(getattr(self, f), f"all_gather {f}")

    def output_specs(self):
        s, k = self.x.shape
        return {"out": TensorSpec((s * self.world, k), self.x.dtype)}

    def grid(self):
        s, k = self.x.shape
        return (cdiv(s, self.block_m), cdiv(k, self.block_n))

    def _dims(self, env):
        s, k = (d if isinstance(d, int) else d.eval(env) for d in self.x.shape)
        return s, k, env.get("RANK", 0)

    def reads(self, coord, env, data=None):
        s, k, _ = self._dims(env)
        return {"x": (block(coord[0], self.block_m, s), block(coord[1], self.block_n, k))}

    def writes(self, coord, env, data=None):
        s, k, rank = self._dims(env)
        r0, r1 = block(coord[0], self.block_m, s)
        return {"out": ((rank * s + r0, rank * s + r1), block(coord[1], self.block_n, k))}

    def cost(self, coord, env):
        _, k, _ = self._dims(env)
        elems = self.block_m * min(self.block_n, k)
        return tile_time_us(0.0, (self.world + 1) * elems * self.x.dtype.itemsize, self.x.dtype)

    def reference(self, coord, env, t):
        s, _, rank = self._dims(env)
        (r0, r1), (c0, c1) = self.reads(coord, env)["x"]
        peers = t[peer_key("out")]
        for q in range(peers.world):
            peers.tensors[q][rank * s + r0 : rank * s + r1, c0:c1] = t["x"][r0:r1, c0:c1]

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """``tensors`` = (mX, mOut, mPeers). mX: (s, k); mOut: (s * W, k) local; mPeers: int64
        ``[rank, addr_0, ..., addr_{W-1}]`` of every rank's ``out``. Each element is loaded once
        and stored to every rank (remote stores are posted: no round trip is waited for)."""
        mX, mOut = tensors[0], tensors[1]
        rank, dsts = peer_tensors(tensors[2], mOut, self.world)
        s_rows = mX.shape[0]
        k = mX.shape[1]
        row0 = coord0 * self.block_m
        rows = cute.min(row0 + self.block_m, s_rows) - row0
        col0 = coord1 * self.block_n
        col_end = cute.min(col0 + self.block_n, k)
        dst_row0 = rank * s_rows + row0
        # VEC rows at a time, all loads before the stores (see reduce_scatter)
        vals = cute.make_rmem_tensor((VEC,), mX.element_type)
        for rb in range(0, rows, VEC):
            for c in range(col0 + tidx, col_end, NUM_THREADS):
                for v in cutlass.range_constexpr(VEC):
                    vals[v] = mX[row0 + cute.min(rb + v, rows - 1), c]
                for v in cutlass.range_constexpr(VEC):
                    if rb + v < rows:
                        for q in cutlass.range_constexpr(self.world):
                            dsts[q][dst_row0 + rb + v, c] = vals[v]


def all_gather(
    x: TensorSpec, *, world: int, block_m: int = 16, block_n: int = 1024
) -> AllGatherTile:
    """Every rank's ``x`` stacked in rank order: ``out[r * s:(r + 1) * s] = x of rank r``."""
    return AllGatherTile(x, world, block_m, block_n)
