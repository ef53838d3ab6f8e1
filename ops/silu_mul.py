"""SiLU-and-multiply tile op: out = silu(h[:, :n]) * h[:, n:], one block of rows a task.

With ``tile_info`` (from ``moe_route``) the rows are the grouped-GEMM padded layout: tile i is
row block i of ``block_m`` rows and exists only when ``tile_info[i, 0] >= 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
import cutlass
from cutlass import Float32, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.errors import ShapeError
from cutemk.symbolic import cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    register_op,
)


@register_op
@dataclass(frozen=True)
class SiluMulTile(TileOp):
    h: TensorSpec  # (rows, 2n)
    tile_info: Optional[TensorSpec] = None  # (tiles, 2) int32, grouped layout only
    block_m: int = 64
    block_n: int = 1024  # output columns per tile: wide layers spread over many SMs

    name: ClassVar[str] = "silu_mul"
    token_local: ClassVar[bool] = True
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    data_inputs: ClassVar[tuple[str, ...]] = ("tile_info",)

    def __post_init__(self) -> None:
        expect_ndim(self.h, 2, "silu_mul h")
        expect_dtype(self.h, FLOAT_DTYPES, "silu_mul h")
        if isinstance(self.h.shape[1], int) and self.h.shape[1] % 2:
            raise ShapeError(f"silu_mul h.shape[1] must be even, got {self.h.shape[1]}")
        for f in ("block_m", "block_n"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"silu_mul {f} must be a positive int, got {getattr(self, f)!r}")
        if self.tile_info is not None:
            expect_ndim(self.tile_info, 2, "silu_mul tile_info")
            expect_dtype(self.tile_info, (torch.int32,), "silu_mul tile_info")
            expect_same_dim(
                self.h.shape[0],
                self.tile_info.shape[0] * self.block_m,
                "silu_mul: h rows vs tiles*block_m (block_m must be moe_route's)",
            )

    def check_bindings(self, env) -> None:
        width = self.h.concrete(env)[1]
        if width % 2:
            raise ShapeError(f"silu_mul h.shape[1] = {self.h.shape[1]} must be even, got {width}")

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("h",) if self.tile_info is None else ("h", "tile_info")

    def output_specs(self):
        return {"out": TensorSpec((self.h.shape[0], self.h.shape[1] // 2), self.h.dtype)}

    def grid(self):
        col_blocks = cdiv(self.h.shape[1] // 2, self.block_n)
        if self.tile_info is not None:
            return (self.tile_info.shape[0], col_blocks)
        return (cdiv(self.h.shape[0], self.block_m), col_blocks)

    def _dims(self, env):
        return tuple(d if isinstance(d, int) else d.eval(env) for d in self.h.shape)

    def exists(self, coord, env, data):
        return self.tile_info is None or int(data["tile_info"][coord[0], 0]) >= 0

    def reads(self, coord, env, data=None):
        rows, cols = self._dims(env)
        r_box = block(coord[0], self.block_m, rows)
        c0, c1 = block(coord[1], self.block_n, cols // 2)
        n = cols // 2
        r = {"h": [(r_box, (c0, c1)), (r_box, (n + c0, n + c1))]}  # gate and up columns
        if self.tile_info is not None:
            r["tile_info"] = ((coord[0], coord[0] + 1), (0, 2))
        return r

    def writes(self, coord, env, data=None):
        rows, cols = self._dims(env)
        return {
            "out": (block(coord[0], self.block_m, rows), block(coord[1], self.block_n, cols // 2))
        }

    def cost(self, coord, env):
        _, cols = self._dims(env)
        es = self.h.dtype.itemsize
        width = min(self.block_n, cols // 2)
        return tile_time_us(
            8.0 * self.block_m * width, 3.0 * self.block_m * width * es, self.h.dtype
        )

    def reference(self, coord, env, t):
        _, cols = self._dims(env)
        (r0, r1), (c0, c1) = self.writes(coord, env)["out"]
        n = cols // 2
        g = t["h"][r0:r1, c0:c1].float()
        u = t["h"][r0:r1, n + c0 : n + c1].float()
        t["out"][r0:r1, c0:c1] = (F.silu(g) * u).to(t["out"].dtype)

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0  # purely elementwise

    exists_on_device: ClassVar[bool] = True

    @cute.jit
    def device_exists(self, tensors, coord0: Int32, coord1: Int32) -> cutlass.Boolean:
        """Grouped layout: row tile ``coord0`` exists iff ``tile_info[coord0, 0] >= 0``."""
        ok = cutlass.Boolean(True)
        if cutlass.const_expr(self.tile_info is not None):
            ok = tensors[1][coord0, 0] >= 0
        return ok

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Rows ``[coord0 * block_m, +block_m)``, columns ``[coord1 * block_n, +block_n)`` of out;
        ``tensors`` = (mH, [mTileInfo,] mOut).

        mH: (rows, 2n), mOut: (rows, n). The grouped layout uses the same row block: whether
        the tile exists (``tile_info[coord0, 0] >= 0``) is the caller's check, so ``tile_info``
        is not read here. The whole CTA sweeps each row (consecutive threads on consecutive
        columns: coalesced) so that a block with a single valid row (decode) still uses every
        thread.
        """
        mH = tensors[0]
        mOut = tensors[len(tensors) - 1]
        rows = mH.shape[0]
        n = mOut.shape[1]
        row0 = coord0 * self.block_m
        row_end = cute.min(row0 + self.block_m, rows)
        col0 = coord1 * self.block_n
        col_end = cute.min(col0 + self.block_n, n)
        for row in range(row0, row_end):
            for c in cutlass.range(col0 + tidx, col_end, NUM_THREADS, unroll=4):
                g = mH[row, c].to(Float32)
                u = mH[row, n + c].to(Float32)
                # silu(g) = g * sigmoid(g); exp(-g) overflowing to inf gives g / inf = -0: right.
                mOut[row, c] = (g / (Float32(1.0) + cute.math.exp(-g)) * u).to(mOut.element_type)


def silu_mul(
    h: TensorSpec, tile_info: Optional[TensorSpec] = None, *, block_m: int = 64, block_n: int = 1024
) -> SiluMulTile:
    """silu(gate) * up of a [gate | up] tensor; grouped layout when ``tile_info`` is given."""
    return SiluMulTile(h, tile_info, block_m, block_n)
