"""MoE permute tile op: gather token rows into ``moe_route``'s grouped (padded) layout.

``xp[r] = x[row_token[r]]`` for the valid rows of each existing row tile, so the grouped GEMM
reads its A operand as whole tiles through TMA (Hopper has no TMA gather). Tile i is row tile i
of ``block_m`` rows and exists only when ``tile_info[i, 0] >= 0``; its padding rows (past
``tile_info[i, 1]``) are not written: their values are unspecified and only ever reach padding
rows of later outputs (a GEMM's row r depends on its A row r alone). The reference poisons them
with NaN so the interpreter shows any op that reads them.

One task copies one row tile, ``block_m`` rows of ``x``'s full width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import numpy as np
import torch
from cutlass import Boolean, Int32, Int64, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import SIMT_WIDE_THREADS
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

UNROLL_BYTES = 256
"""Bytes a thread has in flight before it stores them (a copy is latency bound): 16 words of
16 bytes or 32 of 8 (64 registers; the megakernel's threads have 168, and 512 spilled)."""


@register_op
@dataclass(frozen=True)
class MoePermuteTile(TileOp):
    x: TensorSpec  # (tokens, hidden), token-major
    tile_info: TensorSpec  # (tiles, 2) int32
    row_token: TensorSpec  # (tiles*block_m,) int32
    block_m: int = 64

    name: ClassVar[str] = "moe_permute"
    token_local: ClassVar[bool] = True
    # a latency-bound gather: both consumer warpgroups, twice the loads in flight an SM
    simt_threads: ClassVar[int] = SIMT_WIDE_THREADS
    inputs: ClassVar[tuple[str, ...]] = ("x", "tile_info", "row_token")
    outputs: ClassVar[tuple[str, ...]] = ("xp",)
    data_inputs: ClassVar[tuple[str, ...]] = ("tile_info", "row_token")

    def __post_init__(self) -> None:
        expect_ndim(self.x, 2, "moe_permute x")
        expect_ndim(self.tile_info, 2, "moe_permute tile_info")
        expect_ndim(self.row_token, 1, "moe_permute row_token")
        expect_dtype(self.x, FLOAT_DTYPES, "moe_permute x")
        expect_dtype(self.tile_info, (torch.int32,), "moe_permute tile_info")
        expect_dtype(self.row_token, (torch.int32,), "moe_permute row_token")
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"moe_permute block_m must be a positive int, got {self.block_m!r}")
        if not isinstance(self.x.shape[1], int):
            raise ValueError("moe_permute: the hidden size must be a static int")
        expect_same_dim(
            self.row_token.shape[0],
            self.tile_info.shape[0] * self.block_m,
            "moe_permute: row_token rows vs tiles*block_m (block_m must be moe_route's)",
        )

    def output_specs(self):
        return {"xp": TensorSpec((self.row_token.shape[0], self.x.shape[1]), self.x.dtype)}

    def grid(self):
        return (self.tile_info.shape[0],)

    def exists(self, coord, env, data):
        return int(data["tile_info"][coord[0], 0]) >= 0

    def _rows(self, coord, env):
        rows = self.row_token.concrete(env)[0]
        return block(coord[0], self.block_m, rows)

    def reads(self, coord, env, data=None):
        i = coord[0]
        rows = self._rows(coord, env)
        r = {
            "tile_info": ((i, i + 1), (0, 2)),
            "row_token": (rows,),
            "x": full_box(self.x.concrete(env)),  # which tokens: data
        }
        if data is not None:
            valid = int(data["tile_info"][i, 1])
            toks = data["row_token"][rows[0] : rows[0] + valid]
            if toks.numel():
                r["x"] = ((int(toks.min()), int(toks.max()) + 1), (0, self.x.concrete(env)[1]))
        return r

    def writes(self, coord, env, data=None):
        return {"xp": (self._rows(coord, env), (0, self.x.concrete(env)[1]))}

    uniform_cost: ClassVar[bool] = True

    def region_arrays(self, which, env, coords):
        n_t, i = len(coords), coords[:, 0]
        rows = blocks(i, self.block_m, self.row_token.concrete(env)[0])
        x = self.x.concrete(env)
        if which == "writes":
            return {"xp": boxes(rows, span(0, x[1], n_t))}
        return {
            "tile_info": boxes(np.stack([i, i + 1], axis=1), span(0, 2, n_t)),
            "row_token": boxes(rows),
            "x": boxes(*(span(0, d, n_t) for d in x)),
        }

    def cost(self, coord, env):
        es = self.x.dtype.itemsize
        return tile_time_us(0.0, 2.0 * self.block_m * self.x.concrete(env)[1] * es, self.x.dtype)

    def reference(self, coord, env, t):
        i = coord[0]
        (r0, r1), _ = self.writes(coord, env)["xp"]
        valid = int(t["tile_info"][i, 1])
        t["xp"][r0 : r0 + valid] = t["x"][t["row_token"][r0 : r0 + valid].long()]
        t["xp"][r0 + valid : r1] = float("nan")  # padding: unspecified, poisoned for the checks

    # -- device -----------------------------------------------------------------------------
    def _word(self) -> int:
        """Bytes one thread moves per load: 16 or 8 where a row is a whole number of such words
        (the rows then start on a word: the tensors are 16-byte aligned), else 1 element."""
        row = self.x.shape[1] * self.x.dtype.itemsize
        for word in (16, 8):
            if row % word == 0:
                return word
        return self.x.dtype.itemsize

    def _unroll(self) -> int:
        """Words a thread loads before its stores: ``UNROLL_BYTES`` of them."""
        return max(1, UNROLL_BYTES // self._word())

    exists_on_device: ClassVar[bool] = True

    @cute.jit
    def device_exists(self, tensors, coord0: Int32, coord1: Int32) -> Boolean:
        return tensors[1][coord0, 0] >= 0

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Row tile ``coord0``; ``tensors`` = (mX, mTileInfo, mRowToken, mXp).

        mX: (T, H), mTileInfo: (tiles, 2), mRowToken: (tiles*block_m,) int32, mXp:
        (tiles*block_m, H). The valid rows are copied as one flat range of words (8 bytes where
        rows allow), consecutive threads on consecutive words, ``UNROLL_BYTES`` of loads in
        flight per thread before their stores; each thread loads the source row of each word
        itself (an L1 hit after the first), so nothing passes between the body's warpgroups
        through shared memory (a hand-over ``compute-sanitizer --tool racecheck`` reported)."""
        mX, mTileInfo, mRowToken, mXp = tensors
        bm = self.block_m
        hidden = self.x.shape[1]
        valid = mTileInfo[coord0, 1]
        r0 = coord0 * bm
        word = self._word()
        lanes = max(word // 8, 1)  # 8-byte lanes of a word (a 16-byte word: two)
        src, dst = mX, mXp
        width = hidden
        if cutlass.const_expr(word >= 8):
            width = hidden * self.x.dtype.itemsize // word
            src = cute.make_tensor(
                cute.recast_ptr(mX.iterator, dtype=Int64),
                cute.make_layout((mX.shape[0], width, lanes), stride=(width * lanes, lanes, 1)),
            )
            dst = cute.make_tensor(
                cute.recast_ptr(mXp.iterator, dtype=Int64),
                cute.make_layout((mXp.shape[0], width, lanes), stride=(width * lanes, lanes, 1)),
            )
        total = valid * width
        unroll = self._unroll()
        step = self.simt_threads * unroll
        for base in range(0, total, step):
            # unconditional loads (clamped into the range) so all of them are in flight at once
            vals = []
            for u in cutlass.range_constexpr(unroll):
                idx = cute.min(base + u * self.simt_threads + tidx, total - 1)
                if cutlass.const_expr(word >= 8):
                    v = cute.make_rmem_tensor((lanes,), Int64)
                    cute.autovec_copy(src[mRowToken[r0 + idx // width], idx % width, None], v)
                    vals.append(v)
                else:
                    vals.append(src[mRowToken[r0 + idx // width], idx % width])
            for u in cutlass.range_constexpr(unroll):
                idx = base + u * self.simt_threads + tidx
                if idx < total:
                    if cutlass.const_expr(word >= 8):
                        cute.autovec_copy(vals[u], dst[r0 + idx // width, idx % width, None])
                    else:
                        dst[r0 + idx // width, idx % width] = vals[u]


def moe_permute(
    x: TensorSpec, tile_info: TensorSpec, row_token: TensorSpec, *, block_m: int = 64
) -> MoePermuteTile:
    """Token rows of ``x`` into the grouped layout of ``moe_route`` (see the module doc)."""
    return MoePermuteTile(x, tile_info, row_token, block_m)
